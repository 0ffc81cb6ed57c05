"""JFA and SWA sections of the attention benchmark (shapes as in docs/PERF.md).

jfa: lengths ~ U[1, N], about 64K tokens, H 4, D 128, N 512..8192, causal and not; plus N 256 with H 2, D 64.
swa: lengths ~ U[N/2, N], about 48K tokens, H 4, D 128, causal window (512, 0), N 16384/32768/65536.

Timings: forward alone under no_grad; backward alone = torch.autograd.grad on a retained graph (the forward is
not in the backward figure). Padded SDPA times the attention call on already padded tensors (padding and
unpadding excluded); FlexAttention's block mask is built once outside the timed region.
TFLOP/s count real tokens only: fwd = 4*H*D*sum(L^2) (halved when causal; SWA counts visible pairs), bwd = 2.5 x fwd.

--jfa-anchors varlen_attn (comma list, or "none") keeps only those competitors (default: all of them).
"""

from __future__ import annotations

import inspect
import math
import traceback

import torch

from gem.bench.kernels import Row, attn_flops, bench_ms, jagged_lengths, offsets_of, peak_mem_mb

TOKENS = 65536
SWA_TOKENS = 49152
SWA_WINDOW = 512
DEVICE = "cuda"


# ------------------------------------------------------------------------------------------ implementations
# Each maker takes the batch and returns fwd() -> output tensor (differentiable wrt the returned inputs).


class CaseUnsupported(Exception):
    """A competitor that has no form of this case's mask: its row is reported as skipped with the reason."""


def _ours(mask_mode):
    def make(b):
        from gem.ops.jfa import jagged_attention

        def fwd():
            return jagged_attention(b["q"], b["k"], b["v"], b["off"], b["max_len"], causal=b["causal"],
                                    window=b["window"], kernel="triton", mask_mode=mask_mode)

        return fwd, (b["q"], b["k"], b["v"])

    return make


def _sdpa(b):
    import torch.nn.functional as F

    from gem.ops._common import jagged_to_padded

    if b["window"] is not None:
        raise CaseUnsupported("no sliding-window mask without a dense [N, N] mask")
    qp, mask = jagged_to_padded(b["q"].detach(), b["off"], b["max_len"])
    kp, _ = jagged_to_padded(b["k"].detach(), b["off"], b["max_len"])
    vp, _ = jagged_to_padded(b["v"].detach(), b["off"], b["max_len"])
    qp, kp, vp = (x.transpose(1, 2).contiguous().requires_grad_() for x in (qp, kp, vp))
    if b["causal"]:
        # right padding + causal: real queries only reach real keys, so is_causal is exact (flash backend)
        def fwd():
            return F.scaled_dot_product_attention(qp, kp, vp, is_causal=True)
    else:
        key_mask = mask[:, None, None, :]  # [B, 1, 1, N]: pads rows compute junk that is never read

        def fwd():
            return F.scaled_dot_product_attention(qp, kp, vp, attn_mask=key_mask)

    return fwd, (qp, kp, vp)


def _sdpa_masked(b):
    """Causal padded SDPA as a user with a padding mask writes it: one boolean [B, 1, N, N] mask (causal and key
    padding), so SDPA leaves the flash backend. The "padded SDPA" row is the exact is_causal flash call, which right
    padding allows."""
    import torch.nn.functional as F

    from gem.ops._common import jagged_to_padded

    if not b["causal"] or b["window"] is not None:
        raise CaseUnsupported("non-causal: the same call as padded SDPA")
    qp, mask = jagged_to_padded(b["q"].detach(), b["off"], b["max_len"])
    kp, _ = jagged_to_padded(b["k"].detach(), b["off"], b["max_len"])
    vp, _ = jagged_to_padded(b["v"].detach(), b["off"], b["max_len"])
    qp, kp, vp = (x.transpose(1, 2).contiguous().requires_grad_() for x in (qp, kp, vp))
    n = qp.shape[2]
    tril = torch.ones(n, n, dtype=torch.bool, device=qp.device).tril()
    full_mask = (tril[None] & mask[:, None, :])[:, None]  # [B, 1, N, N]
    full_mask[..., 0] = True  # no all-masked row (NaN) even for an empty sequence; pad rows are never read

    def fwd():
        return F.scaled_dot_product_attention(qp, kp, vp, attn_mask=full_mask)

    return fwd, (qp, kp, vp)


def _varlen(b):
    from torch.nn.attention.varlen import varlen_attn

    params = inspect.signature(varlen_attn).parameters
    kw = {}
    if b["window"] is not None:
        if "window_size" not in params:
            raise CaseUnsupported("this torch's varlen_attn has no window_size")
        kw["window_size"] = (b["window"], 0)
    elif b["causal"]:
        if "is_causal" in params:
            kw["is_causal"] = True
        else:
            kw["window_size"] = (-1, 0)
    off = b["off"].to(torch.int32)

    def fwd():
        return varlen_attn(b["q"], b["k"], b["v"], off, off, b["max_len"], b["max_len"], **kw)

    return fwd, (b["q"], b["k"], b["v"])


_FLEX_COMPILED = {}


def _flex(b):
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    if "fn" not in _FLEX_COMPILED:
        _FLEX_COMPILED["fn"] = torch.compile(flex_attention, dynamic=False)
    flex = _FLEX_COMPILED["fn"]
    t = b["q"].shape[0]
    # pad the packed batch to a multiple of 16K tokens so cases reuse one compiled kernel; pads see nothing
    tp = -(-t // 16384) * 16384
    lengths = b["lengths"].to(torch.long)
    doc = torch.repeat_interleave(torch.arange(lengths.numel(), device=lengths.device), lengths)
    doc = torch.cat([doc, doc.new_full((tp - t,), -1)])
    causal, window = b["causal"], b["window"]

    def mask_mod(bi, hi, qi, ki):
        m = (doc[qi] == doc[ki]) & (doc[qi] >= 0)
        if causal or window is not None:
            m = m & (qi >= ki)
        if window is not None:
            m = m & (qi - ki <= window)
        return m

    block_mask = create_block_mask(mask_mod, 1, None, tp, tp, device=b["q"].device)

    def packed(x):
        x = torch.nn.functional.pad(x.detach(), (0, 0, 0, 0, 0, tp - t))
        return x.transpose(0, 1)[None].contiguous().requires_grad_()  # [1, H, Tp, D]

    qp, kp, vp = packed(b["q"]), packed(b["k"]), packed(b["v"])

    def fwd():
        return flex(qp, kp, vp, block_mask=block_mask)

    return fwd, (qp, kp, vp)


def _fbgemm_sll(b):
    if b["causal"] or b["window"] is not None:
        raise CaseUnsupported("FBGEMM sll multi-head JFA has no causal / window mask")
    import fbgemm_gpu.sll  # noqa: F401  (registers the sll ops)
    from fbgemm_gpu.sll.triton import multi_head_jagged_flash_attention

    qh, kh, vh = (x.detach().transpose(0, 1).contiguous().requires_grad_() for x in (b["q"], b["k"], b["v"]))
    off = b["off"].to(torch.int64)

    def fwd():
        return multi_head_jagged_flash_attention(qh, kh, vh, off, b["max_len"])

    return fwd, (qh, kh, vh)


JFA_IMPLS = {
    "ours (sub mask)": _ours("sub"),
    "ours (-inf mask)": _ours("inf"),
    "padded SDPA": _sdpa,
    "padded SDPA (mask)": _sdpa_masked,
    "varlen_attn": _varlen,
    "FlexAttention doc mask": _flex,
    "FBGEMM sll JFA": _fbgemm_sll,
}


# ------------------------------------------------------------------------------------------ measurement


def _batch(lengths, heads, dim, *, causal, window=None):
    off = offsets_of(lengths)
    t = int(off[-1])
    g = torch.Generator(device=DEVICE).manual_seed(0)

    def mk(h):
        return torch.randn(t, h, dim, device=DEVICE, dtype=torch.bfloat16, generator=g).requires_grad_()

    return {"q": mk(heads), "k": mk(heads), "v": mk(heads), "off": off, "lengths": lengths,
            "max_len": int(lengths.max()), "causal": causal, "window": window}


def _measure(section, case, impl, make, b, fwd_flops, args) -> Row:
    row = Row(section, case, impl)
    try:
        fwd, inputs = make(b)
        with torch.no_grad():
            fwd()  # compile / autotune outside the timed region
        warm, rep = (10, 40) if args.quick else (25, 100)
        with torch.no_grad():
            row.fwd_ms = bench_ms(fwd, warmup=warm, rep=rep)
        out = fwd()
        do = torch.randn_like(out)
        torch.autograd.grad(out, inputs, do, retain_graph=True)
        row.bwd_ms = bench_ms(lambda: torch.autograd.grad(out, inputs, do, retain_graph=True), warmup=warm, rep=rep)
        out = None  # free the retained graph before the memory run
        row.mem_mb = peak_mem_mb(lambda: torch.autograd.grad(fwd(), inputs, do))
        row.fwd_tflops = fwd_flops / row.fwd_ms / 1e9
        row.bwd_tflops = 2.5 * fwd_flops / row.bwd_ms / 1e9
    except torch.cuda.OutOfMemoryError:
        row.extra["skipped"] = "OOM"
    except CaseUnsupported as e:
        row.extra["skipped"] = str(e)
    except Exception as e:  # a competitor missing on this stack must not stop the run  # noqa: BLE001
        msg = str(e).splitlines()[0][:80].replace("|", "/") if str(e) else ""
        row.extra["skipped"] = f"{type(e).__name__}: {msg}"
        if getattr(args, "verbose", False):
            traceback.print_exc()
    finally:
        torch.cuda.empty_cache()
    return row


def _keep(impl, args) -> bool:
    """Our own rows always; competitors as --jfa-anchors says."""
    spec = getattr(args, "jfa_anchors", None)
    if impl.startswith("ours") or not spec or spec == "all":
        return True
    return impl in [a.strip() for a in spec.split(",")]


def _add_ratios(rows, ours="ours (sub mask)", others=("varlen_attn", "padded SDPA", "padded SDPA (mask)",
                                                        "FlexAttention doc mask",
                                                        "FBGEMM sll JFA", "FlexAttention sliding window",
                                                        "ours full causal")):
    mine = next((r for r in rows if r.impl == ours), None)
    if mine is None:
        return
    for r in rows:
        if r.impl in others and not math.isnan(r.fwd_ms) and not math.isnan(mine.fwd_ms):
            tag = r.impl.split()[0].replace("FlexAttention", "flex").replace("padded", "sdpa")
            if r.impl == "ours full causal":
                tag = "full"
            elif r.impl == "padded SDPA (mask)":
                tag = "sdpa_mask"
            mine.extra[f"x{tag}"] = f"{r.fwd_ms / mine.fwd_ms:.2f}/{r.bwd_ms / mine.bwd_ms:.2f}"


def run_jfa(args) -> list[Row]:
    ns = [1024, 4096] if args.quick else [512, 1024, 2048, 4096, 8192]
    cases = [(n, 4, 128, c) for c in (False, True) for n in ns] + [(256, 2, 64, False)]
    rows = []
    for n, heads, dim, causal in cases:
        lengths = jagged_lengths(n, TOKENS, seed=n, device=DEVICE)
        b = _batch(lengths, heads, dim, causal=causal)
        flops = attn_flops(lengths, heads, dim, causal=causal)
        case = f"{'causal' if causal else 'full'} N={n} H={heads} D={dim} B={lengths.numel()}"
        case_rows = []
        for impl, make in JFA_IMPLS.items():
            if not _keep(impl, args):
                continue
            r = _measure("jfa", case, impl, make, b, flops, args)
            r.extra["N"] = n
            case_rows.append(r)
        _add_ratios(case_rows)
        rows += case_rows
        del b
    return rows


def _swa_flops(lengths, heads, dim, window):
    f = 0.0
    for L in lengths.tolist():
        w = min(window + 1, L)  # rows 0..w-1 see i+1 keys, the rest see window+1
        f += w * (w + 1) / 2 + (L - w) * (window + 1)
    return 4.0 * heads * dim * f


def run_swa(args) -> list[Row]:
    ns = [16384, 65536] if args.quick else [16384, 32768, 65536]
    impls = {
        "ours (sub mask)": _ours("sub"),
        "ours (-inf mask)": _ours("inf"),
        "varlen_attn": _varlen,
        "FlexAttention sliding window": _flex,
    }
    rows = []
    for n in ns:
        lengths = jagged_lengths(n, SWA_TOKENS, low=n // 2, seed=n, device=DEVICE)
        case = f"window {SWA_WINDOW} N={n} B={lengths.numel()}"
        b = _batch(lengths, 4, 128, causal=True, window=SWA_WINDOW)
        flops = _swa_flops(lengths, 4, 128, SWA_WINDOW)
        case_rows = []
        for impl, make in impls.items():
            if not _keep(impl, args):
                continue
            r = _measure("swa", case, impl, make, b, flops, args)
            r.extra["N"] = n
            case_rows.append(r)
        full = dict(b, window=None)
        r = _measure("swa", case, "ours full causal", _ours("sub"), full, attn_flops(lengths, 4, 128, causal=True),
                     args)
        r.extra["N"] = n
        case_rows.append(r)
        _add_ratios(case_rows)
        _add_ratios(case_rows, ours="ours (-inf mask)")  # the default mask of windowed calls
        rows += case_rows
        del b, full
    return rows


def run(args) -> list[Row]:
    """Both sections; bench_attention.py calls run_jfa / run_swa separately when asked for one."""
    return run_jfa(args) + run_swa(args)
