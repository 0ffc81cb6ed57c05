"""BlockAttention section of the attention benchmark: time vs sequence length with RoPE fused or separate.

Cases (bf16, H 4, D 128, about 64K tokens per batch, lengths ~ U[L/2, L], causal): L 1K..64K with block 512, and
blocks 64/128/256/512 at L 16K. Every competitor applies the same RoPE (NeoX, positions restart per sequence):
  block fused RoPE     gem.ops.block_attention(rope=RopeConfig())
  block + rope op      gem.ops.rope on q and k, then block_attention without rope
  block + torch rope   RoPE in plain PyTorch (cos/sin gathered once per batch), then block_attention without rope
  block + compiled rope  the same PyTorch RoPE under torch.compile, then block_attention without rope
  block no RoPE        block_attention without any RoPE (the floor)
  JFA full causal      gem.ops.jagged_attention(causal=True) + rope op (the O(L^2) baseline)
  JFA window           gem.ops.jagged_attention(window=(block-1, 0)) + rope op (sliding window, same cost order)
  flex block-causal    torch FlexAttention with a document + block-causal mask, RoPE in PyTorch, compiled
bwd_ms is the backward alone; extra holds fwd+bwd ms, ms per 1K tokens (flat in L when cost is linear), the
fwd+bwd's device time (dev_fwd+bwd_ms: its kernels by torch.profiler, without the host gaps event times include)
and, on the fused row, the ratios of each separate-RoPE row and of flex to it, by both. TFLOP/s count allowed
(block-causal) pairs only: 4*H*D*pairs, bwd 2.5x.
"""

from __future__ import annotations

import math
import traceback

import torch

from gem.bench.kernels import Row, bench_ms, compile_static, device_ms, jagged_lengths, offsets_of, peak_mem_mb

SECTION = "block"
H, D = 4, 128
TOKENS = 65536


def _pairs(lengths: torch.Tensor, block: int) -> float:
    """Allowed (query, key) pairs of block-causal attention."""
    n = lengths.double()
    full = torch.div(n, block, rounding_mode="floor")
    rest = n - full * block
    return float((full * block * (block + 1) / 2 + rest * (rest + 1) / 2).sum())


def _rope_cfg():
    from gem.ops.rotary import RopeConfig

    return RopeConfig()


def _ours_fused(q, k, v, off, max_len, block):
    from gem.ops.block import block_attention

    cfg = _rope_cfg()
    return lambda: block_attention(q, k, v, off, max_len, block_size=block, rope=cfg, kernel="triton")


def _ours_unfused(q, k, v, off, max_len, block, rope_op=True):
    from gem.ops.block import block_attention
    from gem.ops.rotary import rope

    cfg = _rope_cfg()

    def f():
        if not rope_op:  # the attention alone: the floor any RoPE scheme adds to
            return block_attention(q, k, v, off, max_len, block_size=block, kernel="triton")
        qr = rope(q, off, max_len, config=cfg, kernel="triton")
        kr = rope(k, off, max_len, config=cfg, kernel="triton")
        return block_attention(qr, kr, v, off, max_len, block_size=block, kernel="triton")

    return f


def _torch_rope_unfused(q, k, v, off, max_len, block, compiled):
    """RoPE as a user writes it in PyTorch (NeoX halves, fp32 math), then our block kernel without RoPE. The
    positions and the cos/sin rows are gathered once, outside the timed call, as a model shares them per batch."""
    from gem.ops.block import block_attention
    from gem.ops.rotary import cos_sin_table, positions_of

    pos = positions_of(off, q.shape[0])
    cos, sin = cos_sin_table(max_len, D, 10000.0, q.device)
    c, s = cos[pos][:, None, :], sin[pos][:, None, :]

    def rot(x):
        x1, x2 = x.float().chunk(2, dim=-1)
        return torch.cat((x1 * c - x2 * s, x2 * c + x1 * s), -1).to(x.dtype)

    rot_fn = compile_static(rot) if compiled else rot

    def f():
        return block_attention(rot_fn(q), rot_fn(k), v, off, max_len, block_size=block, kernel="triton")

    return f


def _jfa(q, k, v, off, max_len, block, window):
    from gem.ops import jagged_attention
    from gem.ops.rotary import rope

    cfg = _rope_cfg()

    def f():
        qr = rope(q, off, max_len, config=cfg, kernel="triton")
        kr = rope(k, off, max_len, config=cfg, kernel="triton")
        if window:
            return jagged_attention(qr, kr, v, off, max_len, causal=True, window=(block - 1, 0), kernel="triton")
        return jagged_attention(qr, kr, v, off, max_len, causal=True, kernel="triton")

    return f


def _flex(q, k, v, off, max_len, block):
    """FlexAttention over the whole batch as one [1, H, T, D] sequence with a document + block-causal mask."""
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    from gem.ops.rotary import cos_sin_table, positions_of

    t = q.shape[0]
    pos = positions_of(off, t)
    doc = torch.searchsorted(off[1:].long(), torch.arange(t, device=q.device), right=True)
    cos, sin = cos_sin_table(max_len, D, 10000.0, q.device)
    c, s = cos[pos][:, None, :], sin[pos][:, None, :]

    def mask_mod(b, h, qi, ki):
        return (doc[qi] == doc[ki]) & (pos[qi] // block == pos[ki] // block) & (ki <= qi)

    try:  # compiled mask construction avoids materialising the [T, T] mask
        bm = create_block_mask(mask_mod, 1, 1, t, t, device=q.device, _compile=True)
    except TypeError:
        bm = create_block_mask(mask_mod, 1, 1, t, t, device=q.device)

    def rot(x):
        x1, x2 = x.float().chunk(2, dim=-1)
        return torch.cat((x1 * c - x2 * s, x2 * c + x1 * s), -1).to(x.dtype)

    def f(q, k, v):
        qr, kr = rot(q), rot(k)
        o = flex_attention(qr.transpose(0, 1)[None], kr.transpose(0, 1)[None], v.transpose(0, 1)[None],
                           block_mask=bm)
        return o[0].transpose(0, 1)

    fc = compile_static(f)
    return lambda: fc(q, k, v)


def _measure(case, impl, make, inputs, flops, extra) -> Row:
    row = Row(SECTION, case, impl, extra=dict(extra))
    try:
        fn = make()
        out = fn()
        row.fwd_ms = bench_ms(fn)
        row.fwd_tflops = flops / row.fwd_ms / 1e9
        g = torch.randn_like(out)

        def fwd_bwd():
            return torch.autograd.grad(fn(), inputs, g)

        fwd_bwd()  # the backward's first call tunes its kernels: outside do_bench, whose rep count it would skew
        total = bench_ms(fwd_bwd)
        row.mem_mb = peak_mem_mb(fwd_bwd)
        row.bwd_ms = max(total - row.fwd_ms, 1e-6)
        row.bwd_tflops = 2.5 * flops / row.bwd_ms / 1e9
        row.extra["fwd+bwd_ms"] = round(total, 3)
        row.extra["ms_per_1k_tok"] = round(total / (row.extra["tokens"] / 1024), 4)
        row.extra["dev_fwd+bwd_ms"] = round(device_ms(fwd_bwd), 3)  # kernels only: host gaps excluded
    except Exception as e:  # noqa: BLE001 -- one failing competitor must not sink the section
        msg = str(e).splitlines()[0][:120] if str(e) else ""
        row.extra["error"] = f"{type(e).__name__}: {msg}"
        traceback.print_exc()
    # each row as it lands: a run cut short by its time limit still leaves what it measured
    print(f"row: {case} | {impl} | fwd {row.fwd_ms:.3f} ms | fwd+bwd {row.extra.get('fwd+bwd_ms', math.nan)} ms",
          flush=True)
    return row


def _case_rows(length: int, block: int, *, tokens: int, competitors: bool, only: tuple[str, ...] = ()) -> list[Row]:
    lengths = jagged_lengths(length, tokens, low=max(1, length // 2), seed=length)
    off = offsets_of(lengths)
    t, max_len = int(lengths.sum()), int(lengths.max())
    q, k, v = (torch.randn(t, H, D, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
    flops = 4.0 * H * D * _pairs(lengths, block)
    case = f"L={length} block={block}"
    info = {"B": lengths.numel(), "tokens": t}
    impls = [("block fused RoPE", lambda: _ours_fused(q, k, v, off, max_len, block)),
             ("block + rope op", lambda: _ours_unfused(q, k, v, off, max_len, block)),
             ("block + torch rope", lambda: _torch_rope_unfused(q, k, v, off, max_len, block, compiled=False)),
             ("block + compiled rope", lambda: _torch_rope_unfused(q, k, v, off, max_len, block, compiled=True)),
             ("block no RoPE", lambda: _ours_unfused(q, k, v, off, max_len, block, rope_op=False))]
    if competitors:
        impls += [("JFA full causal", lambda: _jfa(q, k, v, off, max_len, block, window=False)),
                  ("JFA window", lambda: _jfa(q, k, v, off, max_len, block, window=True)),
                  ("flex block-causal", lambda: _flex(q, k, v, off, max_len, block))]
    if only:  # --block-impls: the rows whose name holds one of these (the fused row always, for the ratios)
        impls = [(name, make) for name, make in impls
                 if name == "block fused RoPE" or any(o.lower() in name.lower() for o in only)]
    rows = []
    for name, make in impls:
        rows.append(_measure(case, name, make, (q, k, v), flops, info))
    by_name = {r.impl: r for r in rows}
    fused, unfused = rows[0], by_name.get("block + rope op")
    for key, a, b in (("unfused/fused fwd", unfused.fwd_ms if unfused else math.nan, fused.fwd_ms),
                      ("unfused/fused fwd+bwd", unfused.extra.get("fwd+bwd_ms", math.nan) if unfused else math.nan,
                       fused.extra.get("fwd+bwd_ms", math.nan))):
        if math.isfinite(a) and math.isfinite(b):
            fused.extra[key] = round(a / b, 2)
    flex = [r for r in rows if r.impl == "flex block-causal"]
    if flex and math.isfinite(flex[0].fwd_ms) and math.isfinite(fused.fwd_ms):
        fused.extra["flex/fused fwd"] = round(flex[0].fwd_ms / fused.fwd_ms, 2)
        if "fwd+bwd_ms" in flex[0].extra and "fwd+bwd_ms" in fused.extra:
            fused.extra["flex/fused fwd+bwd"] = round(flex[0].extra["fwd+bwd_ms"] / fused.extra["fwd+bwd_ms"], 2)
    for name, tag in (("block + torch rope", "torch rope"), ("block + compiled rope", "compiled rope")):
        other = by_name.get(name)
        a = other.extra.get("fwd+bwd_ms", math.nan) if other else math.nan
        b = fused.extra.get("fwd+bwd_ms", math.nan)
        if math.isfinite(a) and math.isfinite(b):
            fused.extra[f"{tag}/fused fwd+bwd"] = round(a / b, 2)
    for key, other in (("flex/fused dev fwd+bwd", flex[0] if flex else None), ("unfused/fused dev fwd+bwd", unfused),
                       ("torch rope/fused dev fwd+bwd", by_name.get("block + torch rope")),
                       ("compiled rope/fused dev fwd+bwd", by_name.get("block + compiled rope"))):
        a = other.extra.get("dev_fwd+bwd_ms", math.nan) if other else math.nan
        b = fused.extra.get("dev_fwd+bwd_ms", math.nan)
        if math.isfinite(a) and math.isfinite(b) and b > 0:
            fused.extra[key] = round(a / b, 2)
    return rows


def run(args) -> list[Row]:
    quick = bool(getattr(args, "quick", False))
    tokens = TOKENS  # --quick drops shapes, never tokens: smaller batches would time launches
    lengths = (1024, 8192, 16384) if quick else (1024, 2048, 4096, 8192, 16384, 32768, 65536)
    chosen = getattr(args, "block_lengths", None)
    if chosen:
        lengths = tuple(int(x) for x in chosen.split(",") if x.strip())
    only = tuple(x.strip() for x in (getattr(args, "block_impls", None) or "").split(",") if x.strip())
    rows: list[Row] = []
    for n in lengths:
        rows += _case_rows(n, 512, tokens=max(tokens, n), competitors=True, only=only)
    for block in () if quick or chosen else (64, 128, 256):  # each block size is a new tuning key (compiles)
        rows += _case_rows(16384, block, tokens=tokens, competitors=True, only=only)
    return rows


if __name__ == "__main__":
    import argparse

    from gem.bench.kernels import print_table

    p = argparse.ArgumentParser()
    p.add_argument("--quick", action="store_true")
    p.add_argument("--block-lengths", default=None, help="comma list of lengths at block 512 only")
    p.add_argument("--block-impls", default=None, help="comma list: only rows whose name holds one (e.g. flex)")
    print_table(run(p.parse_args()), "BlockAttention")
