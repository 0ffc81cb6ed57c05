"""GDPA section of the attention benchmark: our Triton GDPA vs the padded torch.compile of the same math.

Cases (bf16, H 4, D 128, about 64K tokens):
  self   SiLU, causal, lengths ~ U[1, N], N 512..4096
  cross  GELU(tanh), jagged q ~ U[1, N] (N 256..1024) x short K/V ~ U[1, M] (M 64..256)
  fixed  GELU(tanh) cross, jagged q ~ U[1, 1024] x exactly 256 keys per sequence (a fixed set of feature tokens)
  skew   SiLU self, lognormal lengths: longest-first work order vs sequence order
Each of ours also runs with approx="poly6" and with the exp + divide form of gelu_tanh / silu (the kernels' form
for fp16/fp32, patched in here; bf16 takes one tanh.approx instruction); the cross case also with the short-K/V
paths forced off (the tiled forward and the two-pass backward). A row's patch holds for its forward and backward
alike. Work tables are cached per offsets tensor, as in a model whose layers share one batch's offsets: after the
first call a timed call launches only its kernels.
Times are eager (CUDA events around each call, Python launch overhead included, as a user sees them), and each row
also carries its kernels' device time (dev_fwd_ms, dev_bwd_ms; torch.profiler) with the speedups by it; the cross
cases hold 512K query tokens (also with --quick) so that kernels, not launches, dominate.
The padded torch.compile row is compiled per case for that case's shapes (common.compile_static): a static graph
per case, no dynamic-shape recompiles.
TFLOP/s count real tokens: fwd = 4*H*D*sum(Lq*Lk) (halved when causal), bwd = 2.5 x fwd.
Memory roofline: the first row times a device copy of 1 GiB (read + write, torch.profiler), and each of our rows
carries fwd_TBps / bwd_TBps: the least traffic any implementation moves (each input read once, each output written
once: q, k, v, o forward; q, k, v, dO, dq, dk, dv backward) over its kernels' device time, and that as a share of
the copy's rate (fwd_of_copy, bwd_of_copy). Short-K/V cross attention is bound there, not by its FLOPs.
"""

from __future__ import annotations

import math
import traceback

import torch

from gem.bench.kernels import (
    Row,
    attn_flops,
    bench_ms,
    compile_static,
    copy_rate,
    device_ms,
    jagged_lengths,
    offsets_of,
    patched,
    peak_mem_mb,
)
from gem.ops import triton_gdpa

SECTION = "gdpa"
H, D = 4, 128
TOKENS = 65536
CROSS_TOKENS = 8 * TOKENS


def _ours(q, k, v, oq, mq, ok, mk, **kw):
    """A call of our gdpa."""
    from gem.ops.gdpa import gdpa

    return lambda: gdpa(q, k, v, oq, mq, ok, mk, kernel="triton", **kw)


def _padded_compiled(q, k, v, oq, mq, ok, mk, *, activation, causal):
    """The user's alternative: pad to [B, H, N, D], matmul, activation, mask, matmul; compiled."""
    from gem.ops._common import jagged_to_padded
    from gem.ops.gdpa import activation_fn

    qp, maskq = jagged_to_padded(q.detach(), oq, mq)
    kp, maskk = jagged_to_padded(k.detach(), ok, mk)
    vp, _ = jagged_to_padded(v.detach(), ok, mk)
    qp, kp, vp = (x.transpose(1, 2).contiguous().requires_grad_() for x in (qp, kp, vp))
    lq, lk = maskq.sum(1), maskk.sum(1)
    i = torch.arange(mq, device=q.device)[None, :, None]
    j = torch.arange(mk, device=q.device)[None, None, :]
    vis = maskq[:, :, None] & maskk[:, None, :]
    if causal:
        vis = vis & (j <= i + (lk - lq)[:, None, None])
    vis = vis[:, None]
    scale = q.shape[-1] ** -0.5

    def f(qp, kp, vp):
        s = (qp @ kp.transpose(-1, -2)) * scale
        a = torch.where(vis, activation_fn(s, activation), 0.0).to(vp.dtype)
        return a @ vp

    fc = compile_static(f)
    return (lambda: fc(qp, kp, vp)), (qp, kp, vp)


def _measure(section, case, impl, make, inputs, flops, extra=None) -> Row:
    """fwd and fwd+bwd milliseconds (eager, CUDA events); bwd = (fwd+bwd) - fwd."""
    row = Row(section, case, impl, extra=dict(extra or {}))
    try:
        fn = make()
        out = fn()
        g = torch.randn_like(out)

        def step():
            # compiled graphs donate buffers, so each backward runs on a fresh forward (no retain_graph)
            return torch.autograd.grad(fn(), inputs, g)

        row.fwd_ms = bench_ms(fn)
        row.bwd_ms = bench_ms(step) - row.fwd_ms
        row.fwd_tflops = flops / row.fwd_ms / 1e9
        row.bwd_tflops = 2.5 * flops / row.bwd_ms / 1e9
        row.mem_mb = peak_mem_mb(fn)
        # kernels only (torch.profiler): where these sit below the event times, the call is host-bound
        dev_fwd = device_ms(fn)
        row.extra["dev_fwd_ms"] = round(dev_fwd, 3)
        row.extra["dev_bwd_ms"] = round(device_ms(step) - dev_fwd, 3)
    except Exception as e:  # noqa: BLE001 - one failing competitor must not sink the section
        row.extra["error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:120] if str(e) else ''}"
        traceback.print_exc()
    return row


def _jagged(lengths_q, lengths_k, dtype):
    oq, ok = offsets_of(lengths_q), offsets_of(lengths_k)
    hk = H
    q = torch.randn(int(lengths_q.sum()), H, D, device="cuda", dtype=dtype, requires_grad=True)
    k = torch.randn(int(lengths_k.sum()), hk, D, device="cuda", dtype=dtype, requires_grad=True)
    v = torch.randn(int(lengths_k.sum()), hk, D, device="cuda", dtype=dtype, requires_grad=True)
    return q, k, v, oq, int(lengths_q.max()), ok, int(lengths_k.max())


def _case_rows(case, lq, lk, *, activation, causal, extra_impls=(), compare=True) -> list[Row]:
    dtype = torch.bfloat16
    q, k, v, oq, mq, ok, mk = _jagged(lq, lk, dtype)
    flops = attn_flops(lq, H, D, causal=causal, lengths_k=None if lk is lq else lk)
    info = {"B": lq.numel(), "tokens": int(lq.sum())}
    qb, kb = q.numel() * q.element_size(), k.numel() * k.element_size()
    least = {"fwd": 2 * qb + 2 * kb, "bwd": 3 * qb + 4 * kb}  # bytes: each input read once, each output written once
    rows = []
    impls = [("gdpa", {}), ("gdpa poly6", {"approx": "poly6"}),
             ("gdpa exp+div", {"patch": {"tanh_form": lambda *a: False}})] + list(extra_impls)
    for name, kw in impls:
        kw = dict(kw)
        with patched(triton_gdpa, kw.pop("patch", None)):  # a row's patch holds for its forward and backward
            rows.append(
                _measure(
                    SECTION,
                    case,
                    name,
                    lambda kw=kw: _ours(q, k, v, oq, mq, ok, mk, activation=activation, causal=causal, **kw),
                    (q, k, v),
                    flops,
                    info,
                )
            )
    for row in rows:  # ours: achieved traffic rate by device time
        for part in ("fwd", "bwd"):
            ms = row.extra.get(f"dev_{part}_ms", math.nan)
            if math.isfinite(ms) and ms > 0:
                row.extra[f"{part}_TBps"] = round(least[part] / ms / 1e9, 2)
                if math.isfinite(COPY_TBPS.get("rate", math.nan)):
                    row.extra[f"{part}_of_copy"] = round(least[part] / ms / 1e9 / COPY_TBPS["rate"], 2)
    if compare:
        holder = {}

        def make():
            fn, ins = _padded_compiled(q, k, v, oq, mq, ok, mk, activation=activation, causal=causal)
            holder["ins"] = ins
            return fn

        row = Row(SECTION, case, "padded torch.compile", extra=dict(info))
        try:
            fn = make()
            row = _measure(SECTION, case, "padded torch.compile", lambda: fn, holder["ins"], flops, info)
        except Exception as e:  # noqa: BLE001 - as above
            row.extra["error"] = f"{type(e).__name__}"
            traceback.print_exc()
        rows.append(row)
        ours = rows[0]
        if math.isfinite(row.fwd_ms) and math.isfinite(ours.fwd_ms):
            ours.extra["fwd_speedup"] = round(row.fwd_ms / ours.fwd_ms, 2)
        if math.isfinite(row.bwd_ms) and math.isfinite(ours.bwd_ms):
            ours.extra["bwd_speedup"] = round(row.bwd_ms / ours.bwd_ms, 2)
        for part in ("fwd", "bwd"):  # the same ratios by device time
            a, b = row.extra.get(f"dev_{part}_ms", math.nan), ours.extra.get(f"dev_{part}_ms", math.nan)
            if math.isfinite(a) and math.isfinite(b) and b > 0:
                ours.extra[f"dev_{part}_speedup"] = round(a / b, 2)
    torch.cuda.empty_cache()
    return rows


def _lognormal_lengths(tokens: int, median: float, sigma: float, cap: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    out, total = [], 0
    while total < tokens:
        n = int(min(cap, max(1.0, math.exp(math.log(median) + sigma * float(torch.randn(1, generator=g))))))
        out.append(n)
        total += n
    return torch.tensor(out, device="cuda")


COPY_TBPS: dict = {}


def _copy_row() -> Row:
    """The memory anchor, measured in this run (common.copy_rate)."""
    ms, rate = copy_rate()
    COPY_TBPS["rate"] = rate
    return Row(SECTION, "memory anchor: 1 GiB copy", "torch copy_ (device ms)", fwd_ms=ms,
               extra={"TBps": round(rate, 2)})


def run(args) -> list[Row]:
    quick = bool(getattr(args, "quick", False))
    only = tuple(x.strip() for x in (getattr(args, "gdpa_cases", None) or "").split(",") if x.strip())

    def wanted(case: str) -> bool:  # --gdpa-cases, as --block-impls: case-insensitive
        return not only or any(o.lower() in case.lower() for o in only)

    tokens = TOKENS  # --quick drops shapes, never tokens: smaller batches would time launches
    rows: list[Row] = [_copy_row()]
    torch.cuda.empty_cache()
    for n in (512, 2048) if quick else (512, 1024, 2048, 4096):
        case = f"self SiLU causal N={n}"
        if wanted(case):
            lq = jagged_lengths(n, tokens, seed=n)
            rows += _case_rows(case, lq, lq, activation="silu", causal=True)
    cross = [(256, 64), (1024, 256)] if quick else [(256, 64), (512, 128), (1024, 128), (1024, 256)]
    for n, m in cross:
        case = f"cross GELU(tanh) N={n} M={m}"
        if not wanted(case):
            continue
        lq = jagged_lengths(n, CROSS_TOKENS, seed=n)  # --quick too: smaller cases only time launches
        g = torch.Generator().manual_seed(m)
        lk = torch.randint(1, m + 1, (lq.numel(),), generator=g).to("cuda")
        rows += _case_rows(
            case,
            lq,
            lk,
            activation="gelu_tanh",
            causal=False,
            extra_impls=[("gdpa long-K/V path", {"short_kv": False})],
        )
    case = "cross GELU(tanh) N=1024 M=256 fixed"
    if wanted(case):
        lq = jagged_lengths(1024, CROSS_TOKENS, seed=1024)
        lk = torch.full_like(lq, 256)
        rows += _case_rows(case, lq, lk, activation="gelu_tanh", causal=False)
    case = "skew SiLU lognormal"
    if wanted(case):
        lq = _lognormal_lengths(tokens, 256, 1.2, 8192)
        rows += _case_rows(case, lq, lq, activation="silu", causal=False,
                           extra_impls=[("gdpa unordered", {"ordered": False})], compare=False)
    return rows


if __name__ == "__main__":
    import argparse

    from gem.bench.kernels import print_table

    p = argparse.ArgumentParser()
    p.add_argument("--quick", action="store_true")
    print_table(run(p.parse_args()), "GDPA")
