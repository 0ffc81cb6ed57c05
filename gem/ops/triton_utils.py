"""What the Triton attention kernels (JFA, GDPA, BlockAttention) share: dot helpers, window masks and the split of a
tile loop into masked and unmasked runs, the HSTU mask and the tiles it leaves visible, length buckets, and the
per-batch work tables.

Work tables map a program to a (sequence, tile) item, built on the device (no host sync) and kept in the
call's JaggedBatch. One builder, work_table(), serves every op; each op gives the cost that orders its items.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from gem.ops._common import cached as batch_cached
from gem.ops._common import cdiv, next_pow2, triton_interpreting

# ----------------------------------------------------------------------------------------------- device helpers


@triton.jit
def dot(a, b, DOT_PREC: tl.constexpr):
    """a @ b in fp32. DOT_PREC "upcast" (interpreter only): the CPU interpreter mis-multiplies bf16/fp16 operands,
    so they are widened first (the same products, exact)."""
    if DOT_PREC == "upcast":
        return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    else:
        return tl.dot(a, b, input_precision=DOT_PREC)


@triton.jit
def dot_acc(a, b, acc, DOT_PREC: tl.constexpr):
    """acc + a @ b (see dot)."""
    if DOT_PREC == "upcast":
        return tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision="ieee")
    else:
        return tl.dot(a, b, acc, input_precision=DOT_PREC)


@triton.jit
def window_mask(m, diag, cols, left, right, HAS_LEFT, HAS_RIGHT):
    """m & (diag - left <= cols <= diag + right), each side only where it binds. The flags may be constexprs (the
    side is compiled in or out) or runtime booleans."""
    if HAS_LEFT:
        m = m & (cols >= diag - left)
    if HAS_RIGHT:
        m = m & (cols <= diag + right)
    return m


@triton.jit
def edge_runs(p0, p_last, lo, n_t, off, below, above, HAS_BELOW, HAS_ABOVE, BLOCK: tl.constexpr):
    """Of the n_t partner tiles (BLOCK wide, from lo) of rows [p0, p_last], row p seeing partners p + off - below ..
    p + off + above: [t_a, t_b) lie inside every row's window (no mask); tiles before t_a cross the lower edge,
    tiles from t_b on the upper one. Split loops let the unmasked run be pipelined with no per-tile branch."""
    t_a = 0
    t_b = n_t
    if HAS_BELOW:
        t_a = tl.cdiv(tl.maximum(p_last + off - below - lo, 0), BLOCK)
    if HAS_ABOVE:
        t_b = tl.maximum(p0 + off + above + 1 - lo, 0) // BLOCK
    t_a = tl.minimum(t_a, n_t)
    t_b = tl.minimum(tl.maximum(t_b, t_a), n_t)
    return t_a, t_b


@triton.jit
def hstu_visible(r, c, hstu):
    """generative-recommenders' HSTU mask (gem/ops/hstu_mask.py) for query rows r and key positions c of one
    sequence, broadcast against each other (r[:, None] and c[None, :], or transposed). hstu = (n keys, first target
    position, contextual_len, max_attn_len with 0 unbounded, qoff): query row r sits at key position r + qoff
    (Lk - Lq: 0 for self attention, the cached form's offset otherwise); positions outside [0, n) are invisible."""
    n, ft, ctx, max_attn, qoff = hstu
    p = r + qoff
    cs = tl.maximum(ctx - 1, 0)
    last = ft - cs
    id_r = tl.minimum(tl.maximum(p - cs, 0), last)
    id_c = tl.minimum(tl.maximum(c - cs, 0), last)
    dist = id_r - id_c
    vis = (p == c) | ((dist > 0) & ((dist <= max_attn) | (max_attn <= 0)))
    vis = vis | ((ctx > 0) & (id_r == 0) & (id_c < last))
    return vis & (p >= 0) & (p < n) & (c < n)


@triton.jit
def hstu_seq(NUM_TARGETS, b, lq, lk, ctx, max_attn, HSTU: tl.constexpr):
    """The hstu tuple of sequence b (lq queries, the last of its lk keys) for hstu_visible; a placeholder, never
    read, when not HSTU."""
    ft = lk
    if HSTU:
        ft = lk - tl.load(NUM_TARGETS + b).to(tl.int32)
    return lk, ft, ctx, max_attn, lk - lq


@triton.jit
def hstu_key_tiles(m0, hstu, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """The key tiles (BLOCK_N keys, aligned at 0) that query rows [m0, m0 + BLOCK_M) may see under hstu_visible, as
    runs (see hstu_tile_start). Rows see earlier ids and themselves; contextual rows every non-target key; a
    max_attn_len window counts from the row's id (the first target's for targets) and reaches back to 0 once it
    meets the contextual block. A tile of targets only sees the history before the first target and itself, so
    the other targets' tiles between are skipped. Rows at negative positions (the cached form's) see nothing."""
    n, ft, ctx, max_attn, qoff = hstu
    p_end = m0 + qoff + BLOCK_M  # positions [p0, p_end) of the rows
    p0 = tl.maximum(m0 + qoff, 0)
    hi = tl.minimum(p_end, n)
    hi = tl.minimum(tl.where(p0 < ctx, tl.maximum(hi, ft), hi), n)
    lo = tl.minimum(p0, ft) - max_attn
    lo = tl.where((max_attn > 0) & (lo >= ctx), lo, 0)
    e1 = tl.where(p0 > ft, ft, hi)  # end of the history run
    b0 = lo // BLOCK_N
    b_end = tl.maximum(tl.cdiv(e1, BLOCK_N), b0)
    c0 = tl.maximum(b_end, p0 // BLOCK_N)
    n_c = tl.where(p0 > ft, tl.maximum(tl.cdiv(hi, BLOCK_N) - c0, 0), 0)
    none = p_end <= 0
    return 0, b0, tl.where(none, 0, b_end - b0), c0, tl.where(none, 0, n_c)


@triton.jit
def _row_tile(pos, qoff, lq, BLOCK: tl.constexpr, UP: tl.constexpr):
    """The tile index (BLOCK rows, aligned at row 0) of the row at key position pos, clamped to rows [0, lq];
    UP rounds up (an exclusive end)."""
    r = tl.minimum(tl.maximum(pos - qoff, 0), lq)
    if UP:
        return tl.cdiv(r, BLOCK)
    return r // BLOCK


@triton.jit
def hstu_query_tiles(n0, hstu, BLOCK_N: tl.constexpr, BLOCK_M: tl.constexpr):
    """The query tiles (BLOCK_M rows, aligned at row 0) that may see key columns [n0, n0 + BLOCK_N) under
    hstu_visible, as runs (see hstu_tile_start): contextual rows, rows from the key tile on up to the max_attn_len
    reach (its own rows only for a tile of targets), the targets beyond that reach. The runs are found in key
    positions, then mapped to the query rows (row = position - qoff) and made disjoint."""
    n, ft, ctx, max_attn, qoff = hstu
    lq = n - qoff
    cs = tl.maximum(ctx - 1, 0)
    n_last = tl.minimum(n0 + BLOCK_N, n) - 1
    a_end = tl.where((ctx > 0) & (n0 < ft), tl.minimum(tl.minimum(ctx, n0), n), 0)
    # from row 0: where queries outnumber keys (qoff < 0) its first tiles hold rows that see nothing
    n_a = tl.where(a_end > 0, _row_tile(a_end, qoff, lq, BLOCK_M, True), 0)
    # targets see a non-target key j while the first target's id is within max_attn_len of j's
    j_hist = tl.minimum(n_last, ft - 1)
    t_see = (n0 < ft) & (ft - tl.maximum(j_hist, cs) <= max_attn)
    hi_b = tl.where(max_attn > 0, tl.minimum(tl.maximum(n_last, cs) + max_attn + 1, n), n)
    hi_b = tl.where(n0 >= ft, n_last + 1, hi_b)
    c_end = tl.where((max_attn > 0) & t_see, n, 0)
    b0 = tl.maximum(_row_tile(n0, qoff, lq, BLOCK_M, False), n_a)
    b_end = tl.maximum(_row_tile(hi_b, qoff, lq, BLOCK_M, True), b0)
    c0 = tl.maximum(b_end, _row_tile(ft, qoff, lq, BLOCK_M, False))
    n_c = tl.maximum(_row_tile(c_end, qoff, lq, BLOCK_M, True) - c0, 0)
    return n_a, b0, b_end - b0, c0, n_c


@triton.jit
def hstu_tile_count(runs):
    """The number of tiles in runs (hstu_key_tiles, hstu_query_tiles)."""
    return runs[0] + runs[2] + runs[4]


@triton.jit
def hstu_tile_start(t, runs, BLOCK: tl.constexpr):
    """First row (or key) of tile t of runs = (n_a, b0, n_b, c0, n_c): tiles [0, n_a), [b0, b0 + n_b) and
    [c0, c0 + n_c) of a grid of BLOCK aligned at 0, disjoint and in order, so a loop over them visits each once."""
    n_a, b0, n_b, c0 = runs[0], runs[1], runs[2], runs[3]
    idx = tl.where(t < n_a, t, tl.where(t < n_a + n_b, b0 + t - n_a, c0 + t - n_a - n_b))
    return idx * BLOCK


# ----------------------------------------------------------------------------------------------- host helpers


def dot_prec(dtype) -> str:
    """The DOT_PREC constexpr of dot / dot_acc for operands of `dtype`."""
    if dtype == torch.float32:
        return "ieee"
    return "upcast" if triton_interpreting() else "tf32"


def hstu_kw(offsets_q, num_targets, ctx: int, max_attn: int, max_len: int) -> dict:
    """The kernels' HSTU keyword arguments (hstu_seq); without num_targets the HSTU code is compiled out and the
    pointer is a placeholder. ctx and max_attn are cut to what can bind in key sequences of max_len, so the
    kernels' int32 row arithmetic stays far from overflow."""
    if num_targets is None:
        return {"NUM_TARGETS": offsets_q, "HSTU_CTX": 0, "HSTU_MAX_ATTN": 0, "HSTU": False}
    return {"NUM_TARGETS": num_targets, "HSTU_CTX": min(ctx, max_len + 1), "HSTU_MAX_ATTN": min(max_attn, max_len),
            "HSTU": True}


def len_bucket(n: int) -> int:
    """A length rounded up to a power of two (>= 16): tuning keys and tile widths change only at these steps."""
    return max(16, next_pow2(max(n, 1)))


def num_sms(device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 4


# ----------------------------------------------------------------------------------------------- work tables
# Every table is int32 [W, 2] of (sequence, tile), spare rows (-1, -1) last. The cost orders the items, heaviest
# first, so a skewed batch does not end on one long tail:
#   "seq_len"   (BlockAttention) none: sequence-major order, tiles in index order;
#   "seq_span"  (JFA) the sequence's rows x visible partners: heaviest sequences first, each sequence's tiles
#               adjacent in index order, so the programs in flight share their K/V (or Q/dO) in L2;
#   "tile_span" (GDPA) each tile's rows x visible partners, grouped by sequence (the costliest sequence first,
#               its costliest tiles first).


@triton.jit
def _seq_span_keys_kernel(OFF_A, OFF_B, KEYS, n, NT, block, span_cap, BLOCK: tl.constexpr):
    """Sort key per tile (b, t) of the A sequences, or -1 when the tile starts past the sequence end: the
    sequence's weight min(La, 65535) x min(partner span, 32767) << 32 | ~index. Sorted descending in one sort."""
    idx = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ok = idx < n
    b = idx // NT
    start = (idx % NT) * block
    a0 = tl.load(OFF_A + b, mask=ok, other=0).to(tl.int32)
    la = tl.load(OFF_A + b + 1, mask=ok, other=0).to(tl.int32) - a0
    b0 = tl.load(OFF_B + b, mask=ok, other=0).to(tl.int32)
    lb = tl.load(OFF_B + b + 1, mask=ok, other=0).to(tl.int32) - b0
    # span_cap: left + right + 1 for two-sided windows, from the host (no int32 wrap here)
    cost = tl.minimum(la, 65535).to(tl.int64) * tl.minimum(tl.minimum(lb, span_cap), 32767).to(tl.int64)
    key = tl.where(start < la, cost * 4294967296 + (4294967295 - idx.to(tl.int64)), -1)
    tl.store(KEYS + idx, key, mask=ok)


@triton.jit
def _seq_len_kernel(offsets, cum, work, tile, BLOCK: tl.constexpr):
    b = tl.program_id(0)
    n = tl.load(offsets + b + 1) - tl.load(offsets + b)
    nt = (n + tile - 1) // tile
    first = tl.load(cum + b) - nt
    for j0 in range(0, nt, BLOCK):
        j = j0 + tl.arange(0, BLOCK)
        m = j < nt
        dst = work + 2 * (first + j)
        tl.store(dst, tl.zeros([BLOCK], dtype=tl.int32) + b, mask=m)
        tl.store(dst + 1, j, mask=m)


def _seq_len_table(offsets_a, block: int, total: int) -> torch.Tensor:
    nb = offsets_a.numel() - 1
    bound = max(1, cdiv(total, block) + nb)  # >= the real count of tiles: a grid known from shapes alone
    work = torch.full((bound, 2), -1, dtype=torch.int32, device=offsets_a.device)
    if nb == 0:
        return work
    offsets = offsets_a.to(torch.int32)
    cum = torch.cumsum(torch.div(offsets.diff() + (block - 1), block, rounding_mode="floor"), 0, dtype=torch.int32)
    _seq_len_kernel[(nb,)](offsets, cum, work, block, BLOCK=16 if triton_interpreting() else 128)
    return work


@triton.jit
def _seq_span_rows_kernel(KEYS, WORK, n, NT, BLOCK: tl.constexpr):
    """Sorted keys (_seq_span_keys_kernel) -> (sequence, tile) rows, (-1, -1) for tiles past their sequence."""
    idx = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ok = idx < n
    key = tl.load(KEYS + idx, mask=ok, other=-1)
    item = 4294967295 - (key & 4294967295)
    tl.store(WORK + 2 * idx, tl.where(key < 0, -1, item // NT).to(tl.int32), mask=ok)
    tl.store(WORK + 2 * idx + 1, tl.where(key < 0, -1, item % NT).to(tl.int32), mask=ok)


def _seq_span_table(offsets_a, offsets_b, max_len_a: int, block: int, left: int, right: int):
    nt = max(1, cdiv(max_len_a, block))
    n = (offsets_a.numel() - 1) * nt
    keys = torch.empty(n, device=offsets_a.device, dtype=torch.int64)
    work = torch.empty((n, 2), device=offsets_a.device, dtype=torch.int32)
    kb = 16 if triton_interpreting() else 1024
    span_cap = min(left + right + 1, 2**31 - 1) if left >= 0 and right >= 0 else 2**31 - 1
    _seq_span_keys_kernel[(cdiv(n, kb),)](offsets_a, offsets_b, keys, n, nt, block, span_cap, BLOCK=kb)
    _seq_span_rows_kernel[(cdiv(n, kb),)](torch.sort(keys, descending=True).values, work, n, nt, BLOCK=kb)
    return work, nt


def _visible_span(pos, block, len_b, lo_off, hi_off):
    """Visible partner positions of tiles starting at pos (clamped window, >= 0)."""
    lo = torch.zeros_like(pos) if lo_off is None else (pos + lo_off).clamp_min(0)
    hi = len_b.expand_as(pos) if hi_off is None else torch.minimum(pos + block + hi_off, len_b.expand_as(pos))
    return (hi - lo).clamp_min(0)


def _tile_span_table(offsets_a, offsets_b, max_len_a: int, block: int, left: int, right: int, ordered: bool,
                     transpose: bool, total: int | None) -> torch.Tensor:
    len_a = offsets_a[1:] - offsets_a[:-1]
    len_b = offsets_b[1:] - offsets_b[:-1]
    nb = len_a.numel()
    nt = -(-max_len_a // block) if max_len_a > 0 else 0
    if nb == 0 or nt == 0:
        return torch.full((1, 2), -1, dtype=torch.int32, device=len_a.device)
    la = len_a.to(torch.int64)[:, None]
    lb = len_b.to(torch.int64)[:, None]
    tile = torch.arange(nt, device=len_a.device, dtype=torch.int64)[None, :].expand(nb, nt)
    seq = torch.arange(nb, device=len_a.device, dtype=torch.int64)[:, None].expand(nb, nt)
    pos = tile * block
    valid = pos < la
    if ordered:
        if transpose:  # key tile: queries i with j - doff - right <= i <= j - doff + left, doff = Lk - Lq
            doff = la - lb
            lo_off = None if right < 0 else -doff - right
            hi_off = None if left < 0 else -doff + left
        else:
            doff = lb - la
            lo_off = None if left < 0 else doff - left
            hi_off = None if right < 0 else doff + right
        cost = torch.minimum(la - pos, torch.full_like(pos, block)) * _visible_span(pos, block, lb, lo_off, hi_off)
        key = torch.where(valid, cost, -1)
    else:
        key = valid.to(torch.int64)
    perm = torch.argsort(key.flatten(), descending=True, stable=True)
    if ordered:  # then stably by sequence rank (costliest first); empty tiles last
        seq_rank = torch.empty(nb, dtype=torch.int64, device=len_a.device)
        seq_rank[torch.argsort(key.clamp_min(0).sum(1), descending=True, stable=True)] = torch.arange(
            nb, device=len_a.device)
        group = torch.where(valid, seq_rank[:, None], nb).flatten()[perm]
        perm = perm[torch.argsort(group, stable=True)]
    if total is not None:  # sum(ceil(L / block)) < total / block + B: no grid of B x max tiles
        perm = perm[: max(1, min(nb * nt, total // block + nb))]
    table = torch.stack((torch.where(valid, seq, -1), tile), -1).flatten(0, 1)[perm]
    return table.to(torch.int32).contiguous()


COSTS = ("seq_len", "seq_span", "tile_span")


def work_table(cost: str, offsets_a, offsets_b, max_len_a: int, block: int, *, left: int = -1, right: int = -1,
               transpose: bool = False, ordered: bool = True, total: int | None = None, cached: bool = True):
    """The work items of one pass: tiles of `block` rows over offsets_a's sequences, ordered by `cost` (see above);
    offsets_b holds the partner sequences (keys of a q tile, queries of a key tile: transpose) and left / right the
    window (-1 unbounded). Returns the int32 [W, 2] table; "seq_span" returns (table, tiles per sequence).
    Built once per batch pair and key when cached and the call names its batches (gem.ops._common.cached): the
    layers of a model and the backward share it."""
    if cost == "seq_len":
        def build():
            return _seq_len_table(offsets_a, block, total)
    elif cost == "seq_span":
        def build():
            return _seq_span_table(offsets_a, offsets_b, max_len_a, block, left, right)
    elif cost == "tile_span":
        def build():
            return _tile_span_table(offsets_a, offsets_b, max_len_a, block, left, right, ordered, transpose, total)
    else:
        raise ValueError(f"cost={cost!r}: expected one of {COSTS}")
    if not cached:
        return build()
    key = (max_len_a, block, left, right, transpose, ordered, total)
    return batch_cached(f"work:{cost}", offsets_a, offsets_b, key, build)
