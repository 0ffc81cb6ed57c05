"""Triton kernels for GDPA (see gem/ops/gdpa.py for the math and the masking conventions).

No softmax means no running max, no rescale and no correction stage: acc += act(S) @ V in fp32.
Every activation has act(0) == 0, so rows past a sequence's end simply load as zeros: their scores are 0,
their activations 0, and they add nothing; only tiles that cross the causal/window diagonal need a mask.
The forward has two paths: long K/V tiles over K like FlashAttention; short K/V (whole sequence fits one
tile) loads K/V once per program and walks several Q tiles. Work items (sequence, tile) are listed in an
int32 table built on device, costliest first by default (gem.ops.triton_utils), so a skewed batch does not end on
one long tail.
The backward has two forms, neither with atomics. Two-pass (split dQ, as FlashAttention): one program set per
(K tile, KV head) makes dK/dV over the Q tiles of every head of its GQA group, another per (Q tile, head) makes
dQ. One-pass, when a sequence's whole K/V and its fp32 dK/dV fit one program (short K/V, the cross-attention
case) and the batch fills a wave of programs: one program per (sequence, KV head) streams the sequence's q/dO
tiles once, stores each tile's dQ and keeps dK/dV in registers: 5 matmuls per tile pair instead of 7, and q/dO
read once instead of twice; its scores may be computed keys-major (S^T = K Q^T, a config the tuner picks), so the
dK/dV dots take them untransposed with the K/V tile on their M side. Both short-K/V kernels give each sequence the
narrowest of their K/V tile, its half and its quarter that holds its keys.
Launch configs are picked per shape by gem.ops._tune.ConfigTuner, as for the other ops.
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from gem.ops import triton_utils as tu
from gem.ops._common import cached, triton_interpreting
from gem.ops._register import KernelOp
from gem.ops._tune import ConfigTuner, LaunchConfig, attention_smem, shared_memory_limit
from gem.ops.gdpa_consts import ACTIVATIONS, LEAKY_SLOPE, POLY6

SHORT_KV_MAX = 256  # forward keeps the whole K/V sequence in one tile up to this many keys (D <= 64) ...
SHORT_KV_ELEMS = 128 * 128  # ... while BLOCK_N * D stays within this many elements, and the tiles fit (_fits)
# one-pass backward while a sequence's whole K/V fits one tile whose fp32 dK and dV stay in registers
SHORT_BWD_ELEMS = 64 * 128
# Tests set this to NaN: outputs start as NaN, so a row that no program writes fails the comparison.
_POISON: float | None = None


def _empty_like(x: torch.Tensor) -> torch.Tensor:
    out = torch.empty_like(x)
    return out.fill_(_POISON) if _POISON is not None else out


# ----------------------------------------------------------------------------------------------- activations
@triton.jit
def _act(s, ACT: tl.constexpr, POLY: tl.constexpr, C1: tl.constexpr, C2: tl.constexpr, C3: tl.constexpr,
         C4: tl.constexpr, C5: tl.constexpr, C6: tl.constexpr, CLAMP: tl.constexpr):
    if POLY:
        # relu(x) - p(min(|x|, c)), Horner: FMAs only
        t = tl.minimum(tl.abs(s), CLAMP)
        h = t * C6 + C5
        h = h * t + C4
        h = h * t + C3
        h = h * t + C2
        h = h * t + C1
        a = tl.maximum(s, 0.0) - h * t
    elif ACT == 0:  # gelu (erf)
        a = 0.5 * s * (1.0 + tl.math.erf(s * 0.7071067811865476))
    elif ACT == 1:  # gelu_tanh = x * sigmoid(2u)
        u = 1.5957691216057308 * (s + 0.044715 * s * s * s)
        a = tl.math.fdiv(s, 1.0 + tl.exp(-u))
    elif ACT == 2:  # silu
        a = tl.math.fdiv(s, 1.0 + tl.exp(-s))
    elif ACT == 3:  # relu
        a = tl.maximum(s, 0.0)
    elif ACT == 4:  # relu2
        r = tl.maximum(s, 0.0)
        a = r * r
    elif ACT == 5:  # leaky_relu
        a = tl.where(s > 0, s, s * LEAKY)
    elif ACT == 7:  # gelu_tanh in tanh form: one tanh instead of exp + divide (ACT_TANH_FORM)
        hs = 0.5 * s
        a = hs + hs * _tanh(0.7978845608028654 * (s + 0.044715 * s * s * s))
    elif ACT == 8:  # silu = x * (1 + tanh(x / 2)) / 2
        hs = 0.5 * s
        a = hs + hs * _tanh(hs)
    else:  # identity
        a = s
    return a


@triton.jit
def _tanh(x):
    """tanh: one `tanh.approx.f32` on the GPU (relative error <= 2^-10.99 of t, so an activation 0.5*s*(1 + t) is
    off by at most ~|s| * 2^-12 in absolute terms: 8x below the bf16 rounding of an activation of the same |s|);
    under the interpreter (no PTX) the same function through exp, so CPU tests check the formulas built on it."""
    if HW_TANH:
        t = tl.inline_asm_elementwise("tanh.approx.f32 $0, $1;", "=r,r", [x], dtype=tl.float32, is_pure=True,
                                      pack=1)
    else:
        t = 1.0 - 2.0 / (1.0 + tl.exp(2.0 * x))
    return t


@triton.jit
def _dact(s, ACT: tl.constexpr, POLY: tl.constexpr, C1: tl.constexpr, C2: tl.constexpr, C3: tl.constexpr,
          C4: tl.constexpr, C5: tl.constexpr, C6: tl.constexpr, CLAMP: tl.constexpr):
    if POLY:
        t = tl.abs(s)
        tc = tl.minimum(t, CLAMP)
        h = tc * (6.0 * C6) + 5.0 * C5
        h = h * tc + 4.0 * C4
        h = h * tc + 3.0 * C3
        h = h * tc + 2.0 * C2
        h = h * tc + C1
        dp = tl.where(t < CLAMP, h, 0.0)
        d = tl.where(s > 0, 1.0 - dp, dp)
    elif ACT == 0:
        cdf = 0.5 * (1.0 + tl.math.erf(s * 0.7071067811865476))
        d = cdf + s * 0.3989422804014327 * tl.exp(-0.5 * s * s)
    elif ACT == 1:
        u = 1.5957691216057308 * (s + 0.044715 * s * s * s)
        sg = tl.math.fdiv(1.0, 1.0 + tl.exp(-u))
        du = 1.5957691216057308 * (1.0 + 0.134145 * s * s)
        d = sg + s * sg * (1.0 - sg) * du
    elif ACT == 2:
        sg = tl.math.fdiv(1.0, 1.0 + tl.exp(-s))
        d = sg * (1.0 + s * (1.0 - sg))
    elif ACT == 3:
        d = tl.where(s > 0, 1.0, 0.0)
    elif ACT == 4:
        d = 2.0 * tl.maximum(s, 0.0)
    elif ACT == 5:
        d = tl.where(s > 0, 1.0, LEAKY)
    elif ACT == 7:
        t = _tanh(0.7978845608028654 * (s + 0.044715 * s * s * s))
        hs = 0.5 * s
        d = 0.5 + 0.5 * t + hs * (1.0 - t * t) * (0.7978845608028654 * (1.0 + 0.134145 * s * s))
    elif ACT == 8:
        sg = 0.5 + 0.5 * _tanh(0.5 * s)
        d = sg * (1.0 + s * (1.0 - sg))
    else:
        d = s * 0.0 + 1.0
    return d


LEAKY = tl.constexpr(LEAKY_SLOPE)
HW_TANH = tl.constexpr(not triton_interpreting())
# activation codes past ACTIVATIONS: gelu_tanh and silu written with one tanh (_tanh), see tanh_form()
ACT_TANH_FORM = {"gelu_tanh": 7, "silu": 8}


def tanh_form(activation: str, approx: str, dtype) -> bool:
    """Whether the kernels compute `activation` in its tanh form (ACT_TANH_FORM): gelu_tanh and silu on the GPU for
    bf16 inputs, one tanh.approx instruction instead of exp + divide. fp16/fp32 keep the exact form: their finer
    rounding would approach the instruction's ~|s| * 2^-12 absolute error."""
    if approx or activation not in ACT_TANH_FORM:
        return False
    return not triton_interpreting() and dtype == torch.bfloat16


@triton.jit
def _visible(offs_m, offs_n, doff, LEFT, RIGHT, hstu, HSTU: tl.constexpr):
    """[M, N] mask of key j visible to query i: diag-left <= j <= diag+right, diag = i + (Lk - Lq); HSTU: the
    HSTU mask (gem.ops.triton_utils.hstu_visible) instead."""
    if HSTU:
        vis = tu.hstu_visible(offs_m[:, None], offs_n[None, :], hstu)
    else:
        diag = offs_m[:, None] + doff
        vis = (offs_m[:, None] >= 0) & (offs_n[None, :] >= 0)  # full [M, N] shape from the start
        vis = tu.window_mask(vis, diag, offs_n[None, :], LEFT, RIGHT, LEFT >= 0, RIGHT >= 0)
    return vis


@triton.jit
def _visible_t(offs_n, offs_m, doff, LEFT, RIGHT, hstu, HSTU: tl.constexpr):
    """_visible transposed, [N, M], built directly (no layout change of a mask)."""
    if HSTU:
        vis = tu.hstu_visible(offs_m[None, :], offs_n[:, None], hstu)
    else:
        diag = offs_m[None, :] + doff
        vis = (offs_n[:, None] >= 0) & (offs_m[None, :] >= 0)
        vis = tu.window_mask(vis, diag, offs_n[:, None], LEFT, RIGHT, LEFT >= 0, RIGHT >= 0)
    return vis


@triton.jit
def _work_item(WORK, NUM_HEADS):
    """(sequence, tile, head) of this program; one flat grid, head fastest, so the work order holds across heads."""
    pid = tl.program_id(0) // NUM_HEADS
    return tl.load(WORK + 2 * pid), tl.load(WORK + 2 * pid + 1), tl.program_id(0) % NUM_HEADS


@triton.jit
def _seq_bounds(OFF_Q, OFF_K, b):
    """(q_start, lq, k_start, lk) of sequence b; starts in int64 so large token counts do not overflow."""
    q_start = tl.load(OFF_Q + b).to(tl.int64)
    lq = (tl.load(OFF_Q + b + 1) - q_start).to(tl.int32)
    k_start = tl.load(OFF_K + b).to(tl.int64)
    lk = (tl.load(OFF_K + b + 1) - k_start).to(tl.int32)
    return q_start, lq, k_start, lk


@triton.jit
def _q_item(Q, X, K, V, OFF_Q, OFF_K, b, head, stride_qt, stride_qh, stride_xt, stride_xh, stride_kt, stride_kh,
            stride_vt, stride_vh, NUM_TARGETS, HSTU_CTX, HSTU_MAX_ATTN, HSTU: tl.constexpr, GROUP: tl.constexpr,
            HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr):
    """A q-tiled program's sequence: bounds, diagonal offset, kv head, head-dim and key offsets, the rows of its
    head in q, in X (the output of the forward, dO in the dQ pass) and of its kv head in K and V, and its hstu
    tuple."""
    q_start, lq, k_start, lk = _seq_bounds(OFF_Q, OFF_K, b)
    doff = lk - lq
    kvh = head // GROUP
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < HEAD_DIM
    offs_n0 = tl.arange(0, BLOCK_N)
    Qb = Q + q_start * stride_qt + head * stride_qh
    Xb = X + q_start * stride_xt + head * stride_xh
    Kb = K + k_start * stride_kt + kvh * stride_kh
    Vb = V + k_start * stride_vt + kvh * stride_vh
    hstu = tu.hstu_seq(NUM_TARGETS, b, lq, lk, HSTU_CTX, HSTU_MAX_ATTN, HSTU)
    return q_start, lq, lk, doff, offs_d, d_ok, offs_n0, Qb, Xb, Kb, Vb, hstu


@triton.jit
def _rows(P, offs, stride, offs_d):
    """Pointers [R, BLOCK_D] to rows offs of a [T, D] slice with row stride `stride`."""
    return P + offs[:, None] * stride + offs_d[None, :]


@triton.jit
def _load_kv(Kb, Vb, offs_n, lk, offs_d, d_ok, stride_kt, stride_vt):
    """K and V rows offs_n (zeros past lk or D), and their mask."""
    kmask = (offs_n[:, None] < lk) & d_ok[None, :]
    k = tl.load(_rows(Kb, offs_n, stride_kt, offs_d), mask=kmask, other=0.0)
    v = tl.load(_rows(Vb, offs_n, stride_vt, offs_d), mask=kmask, other=0.0)
    return k, v, kmask


@triton.jit
def _scaled(q, scale):
    # the scale folded into q once (the tiled forward, the dQ pass); the short-K/V kernels scale S instead
    return (q.to(tl.float32) * scale).to(q.dtype)


@triton.jit
def _partner_range(p0, n, off, BELOW, ABOVE, MASKED: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_R: tl.constexpr):
    """[lo, hi) of the partners (of n) that rows [p0, p0+BLOCK_P) see, row p seeing p+off-BELOW .. p+off+ABOVE.

    lo is aligned to BLOCK_R. Keys of a q tile: (m0, lk, doff, LEFT, RIGHT); queries of a key tile: the mirror,
    (n0, lq, -doff, RIGHT, LEFT).
    """
    lo = 0
    hi = n
    if MASKED:
        if BELOW >= 0:
            lo = tl.maximum(p0 + off - BELOW, 0)
            lo = (lo // BLOCK_R) * BLOCK_R
        if ABOVE >= 0:
            hi = tl.minimum(p0 + BLOCK_P + off + ABOVE, n)
    return lo, hi


@triton.jit
def _key_runs(m0, lq, lk, doff, LEFT, RIGHT, hstu, HSTU: tl.constexpr, MASKED: tl.constexpr,
              BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """Key tiles of q rows [m0, m0 + BLOCK_M): first key, tile count, the unmasked run [t_a, t_b), and the HSTU
    mask's runs of tiles (gem.ops.triton_utils.hstu_key_tiles): every one masked, tile t from hstu_tile_start."""
    lo, hi = _partner_range(m0, lk, doff, LEFT, RIGHT, MASKED, BLOCK_M, BLOCK_N)
    nt = tl.cdiv(tl.maximum(hi - lo, 0), BLOCK_N)
    t_a = 0
    t_b = nt
    runs = (0, 0, 0, 0, 0)
    if HSTU:
        runs = tu.hstu_key_tiles(m0, hstu, BLOCK_M, BLOCK_N)
        nt = tu.hstu_tile_count(runs)
        t_a = nt
        t_b = nt
    elif MASKED:
        t_a, t_b = tu.edge_runs(m0, tl.minimum(m0 + BLOCK_M, lq) - 1, lo, nt, doff, LEFT, RIGHT, LEFT >= 0, RIGHT >= 0,
                             BLOCK_N)
    return lo, nt, t_a, t_b, runs


# ------------------------------------------------------------------------------------------------- forward
@triton.jit
def _q_tile(Qb, m0, lq, offs_d, d_ok, stride_qt, scale, BLOCK_M: tl.constexpr, SCALE: tl.constexpr):
    """q rows [m0, m0 + BLOCK_M) (zeros past lq or D), scaled if SCALE, their row indices and their mask."""
    offs_m = m0 + tl.arange(0, BLOCK_M)
    qmask = (offs_m[:, None] < lq) & d_ok[None, :]
    q = tl.load(_rows(Qb, offs_m, stride_qt, offs_d), mask=qmask, other=0.0)
    if SCALE:
        q = _scaled(q, scale)
    return q, offs_m, qmask


@triton.jit
def _fwd_kv_tile(acc, q, Kb, Vb, n0, offs_m, offs_n0, lk, offs_d, d_ok, stride_kt, stride_vt, doff, LEFT, RIGHT, hstu,
                 HSTU: tl.constexpr, MASK: tl.constexpr, ACT: tl.constexpr, POLY: tl.constexpr, C1: tl.constexpr,
                 C2: tl.constexpr, C3: tl.constexpr, C4: tl.constexpr, C5: tl.constexpr, C6: tl.constexpr,
                 CLAMP: tl.constexpr, DOT_PREC: tl.constexpr):
    """acc += act(q k^T) v over one key tile (q comes scaled); MASK: the tile crosses the window edge."""
    offs_n = n0 + offs_n0
    k, v, _ = _load_kv(Kb, Vb, offs_n, lk, offs_d, d_ok, stride_kt, stride_vt)
    a = _act(tu.dot(q, tl.trans(k), DOT_PREC), ACT, POLY, C1, C2, C3, C4, C5, C6, CLAMP)
    if MASK:
        a = tl.where(_visible(offs_m, offs_n, doff, LEFT, RIGHT, hstu, HSTU), a, 0.0)
    return tu.dot_acc(a.to(v.dtype), v, acc, DOT_PREC)


@triton.jit
def _fwd_short_item(Qb, Ob, Kb, Vb, first, n_tiles, lq, lk, doff, offs_d, d_ok, stride_qt, stride_kt, stride_vt,
                    stride_ot, scale, out_scale, LEFT, RIGHT, hstu, HSTU: tl.constexpr, BLOCK_D: tl.constexpr,
                    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, MASKED: tl.constexpr, ACT: tl.constexpr,
                    POLY: tl.constexpr, C1: tl.constexpr, C2: tl.constexpr, C3: tl.constexpr, C4: tl.constexpr,
                    C5: tl.constexpr, C6: tl.constexpr, CLAMP: tl.constexpr, DOT_PREC: tl.constexpr):
    """The short-K/V forward of one work item: its K/V in one BLOCK_N tile, loaded once, then its q tiles. The scale
    multiplies S, so each loaded q tile feeds the dot as loaded (the pipelined load can go straight to shared
    memory)."""
    offs_n = tl.arange(0, BLOCK_N)
    k, v, _ = _load_kv(Kb, Vb, offs_n, lk, offs_d, d_ok, stride_kt, stride_vt)
    for t in range(n_tiles):
        m0 = (first + t) * BLOCK_M
        q, offs_m, qmask = _q_tile(Qb, m0, lq, offs_d, d_ok, stride_qt, scale, BLOCK_M, False)
        s = tu.dot(q, tl.trans(k), DOT_PREC)
        s = s * scale
        a = _act(s, ACT, POLY, C1, C2, C3, C4, C5, C6, CLAMP)
        if MASKED:
            a = tl.where(_visible(offs_m, offs_n, doff, LEFT, RIGHT, hstu, HSTU), a, 0.0)
        acc = tu.dot(a.to(v.dtype), v, DOT_PREC)
        tl.store(_rows(Ob, offs_m, stride_ot, offs_d), (acc * out_scale).to(Ob.dtype.element_ty), mask=qmask)


@triton.jit
def _fwd_kernel(Q, K, V, O, OFF_Q, OFF_K, WORK, stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh,
                stride_ot, stride_oh, scale, out_scale, LEFT, RIGHT, max_len_bucket, NUM_HEADS, GROUP: tl.constexpr,
                HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                TILES: tl.constexpr, SHORT_KV: tl.constexpr, FLAT: tl.constexpr, MASKED: tl.constexpr,
                ACT: tl.constexpr, POLY: tl.constexpr, C1: tl.constexpr, C2: tl.constexpr, C3: tl.constexpr,
                C4: tl.constexpr, C5: tl.constexpr, C6: tl.constexpr, CLAMP: tl.constexpr,
                DOT_PREC: tl.constexpr, NUM_TARGETS, HSTU_CTX, HSTU_MAX_ATTN, HSTU: tl.constexpr):
    """O of one work item: TILES q tiles of one head (SHORT_KV: over the sequence's whole K/V in one tile; FLAT:
    one fused loop over (q tile, K/V tile) pairs)."""
    b, group_id, head = _work_item(WORK, NUM_HEADS)
    if b < 0:
        return
    _q_start, lq, lk, doff, offs_d, d_ok, offs_n0, Qb, Ob, Kb, Vb, hstu = _q_item(
        Q, O, K, V, OFF_Q, OFF_K, b, head, stride_qt, stride_qh, stride_ot, stride_oh, stride_kt, stride_kh, stride_vt,
        stride_vh, NUM_TARGETS, HSTU_CTX, HSTU_MAX_ATTN, HSTU, GROUP, HEAD_DIM, BLOCK_D, BLOCK_N)
    # this item's q tiles that hold rows: a trip count, not a per-tile branch, so the loop can be pipelined
    first = group_id * TILES
    n_tiles = tl.minimum(tl.cdiv(tl.maximum(lq - first * BLOCK_M, 0), BLOCK_M), TILES)
    tl.static_assert(not (FLAT and (MASKED or SHORT_KV or HSTU)))
    if SHORT_KV:
        # the whole K/V sequence in one tile, loaded once for all TILES q tiles of this item; its keys take the
        # narrowest of BLOCK_N, BLOCK_N / 2, BLOCK_N / 4 (>= 16) that holds them, so the dots and activations
        # shrink with the sequence (K/V lengths vary within a batch)
        if BLOCK_N >= 64:
            if lk <= BLOCK_N // 4:
                _fwd_short_item(Qb, Ob, Kb, Vb, first, n_tiles, lq, lk, doff, offs_d, d_ok, stride_qt, stride_kt,
                                stride_vt, stride_ot, scale, out_scale, LEFT, RIGHT, hstu, HSTU, BLOCK_D, BLOCK_M,
                                BLOCK_N // 4, MASKED, ACT, POLY, C1, C2, C3, C4, C5, C6, CLAMP, DOT_PREC)
            elif lk <= BLOCK_N // 2:
                _fwd_short_item(Qb, Ob, Kb, Vb, first, n_tiles, lq, lk, doff, offs_d, d_ok, stride_qt, stride_kt,
                                stride_vt, stride_ot, scale, out_scale, LEFT, RIGHT, hstu, HSTU, BLOCK_D, BLOCK_M,
                                BLOCK_N // 2, MASKED, ACT, POLY, C1, C2, C3, C4, C5, C6, CLAMP, DOT_PREC)
            else:
                _fwd_short_item(Qb, Ob, Kb, Vb, first, n_tiles, lq, lk, doff, offs_d, d_ok, stride_qt, stride_kt,
                                stride_vt, stride_ot, scale, out_scale, LEFT, RIGHT, hstu, HSTU, BLOCK_D, BLOCK_M,
                                BLOCK_N, MASKED, ACT, POLY, C1, C2, C3, C4, C5, C6, CLAMP, DOT_PREC)
        else:
            _fwd_short_item(Qb, Ob, Kb, Vb, first, n_tiles, lq, lk, doff, offs_d, d_ok, stride_qt, stride_kt, stride_vt,
                            stride_ot, scale, out_scale, LEFT, RIGHT, hstu, HSTU, BLOCK_D, BLOCK_M, BLOCK_N, MASKED,
                            ACT, POLY, C1, C2, C3, C4, C5, C6, CLAMP, DOT_PREC)
    elif FLAT:
        # unmasked K/V tiles: every q tile has the same key trip count, so the compiler can fuse the two loops
        # into one pipelined stream (the next q tile's first K/V tiles load during this one's last)
        nt = tl.cdiv(lk, BLOCK_N)
        for t in tl.range(n_tiles, flatten=True):
            q, offs_m, qmask = _q_tile(Qb, (first + t) * BLOCK_M, lq, offs_d, d_ok, stride_qt, scale, BLOCK_M,
                                       True)
            acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
            for j in range(nt):
                acc = _fwd_kv_tile(acc, q, Kb, Vb, j * BLOCK_N, offs_m, offs_n0, lk, offs_d, d_ok, stride_kt, stride_vt,
                                   doff, LEFT, RIGHT, hstu, HSTU, False, ACT, POLY, C1, C2, C3, C4, C5, C6, CLAMP,
                                   DOT_PREC)
            tl.store(_rows(Ob, offs_m, stride_ot, offs_d), (acc * out_scale).to(O.dtype.element_ty), mask=qmask)
    else:
        for t in range(n_tiles):
            m0 = (first + t) * BLOCK_M
            q, offs_m, qmask = _q_tile(Qb, m0, lq, offs_d, d_ok, stride_qt, scale, BLOCK_M, True)
            acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
            lo, nt, t_a, t_b, runs = _key_runs(m0, lq, lk, doff, LEFT, RIGHT, hstu, HSTU, MASKED, BLOCK_M, BLOCK_N)
            for j in range(t_a):  # j: t is the q-tile loop's
                n0 = lo + j * BLOCK_N
                if HSTU:
                    n0 = tu.hstu_tile_start(j, runs, BLOCK_N)
                acc = _fwd_kv_tile(acc, q, Kb, Vb, n0, offs_m, offs_n0, lk, offs_d, d_ok, stride_kt, stride_vt, doff,
                                   LEFT, RIGHT, hstu, HSTU, True, ACT, POLY, C1, C2, C3, C4, C5, C6, CLAMP, DOT_PREC)
            for j in range(t_a, t_b):
                acc = _fwd_kv_tile(acc, q, Kb, Vb, lo + j * BLOCK_N, offs_m, offs_n0, lk, offs_d, d_ok, stride_kt,
                                   stride_vt, doff, LEFT, RIGHT, hstu, HSTU, False, ACT, POLY, C1, C2, C3, C4, C5, C6,
                                   CLAMP, DOT_PREC)
            for j in range(t_b, nt):
                acc = _fwd_kv_tile(acc, q, Kb, Vb, lo + j * BLOCK_N, offs_m, offs_n0, lk, offs_d, d_ok, stride_kt,
                                   stride_vt, doff, LEFT, RIGHT, hstu, HSTU, True, ACT, POLY, C1, C2, C3, C4, C5, C6,
                                   CLAMP, DOT_PREC)
            tl.store(_rows(Ob, offs_m, stride_ot, offs_d), (acc * out_scale).to(O.dtype.element_ty), mask=qmask)


# ------------------------------------------------------------------------------------------------ backward
@triton.jit
def _dkdv_q_tile(dk, dv, k, v, Qb, DOb, m0, offs_n, lq, offs_d, d_ok, stride_qt, stride_dot, scale, doff, LEFT, RIGHT,
                 hstu, HSTU: tl.constexpr, BLOCK_M: tl.constexpr, MASK: tl.constexpr, ACT: tl.constexpr,
                 POLY: tl.constexpr, C1: tl.constexpr, C2: tl.constexpr, C3: tl.constexpr, C4: tl.constexpr,
                 C5: tl.constexpr, C6: tl.constexpr, CLAMP: tl.constexpr, DOT_PREC: tl.constexpr):
    """dK, dV of one key tile += one query tile's share; MASK: the tile pair crosses the window edge. The loaded q
    feeds both dots as is; dK takes the scale at the end."""
    offs_m = m0 + tl.arange(0, BLOCK_M)
    qmask = (offs_m[:, None] < lq) & d_ok[None, :]
    q = tl.load(_rows(Qb, offs_m, stride_qt, offs_d), mask=qmask, other=0.0)
    do = tl.load(_rows(DOb, offs_m, stride_dot, offs_d), mask=qmask, other=0.0)
    st = tu.dot(k, tl.trans(q), DOT_PREC) * scale  # [BN, BM] = S^T
    at = _act(st, ACT, POLY, C1, C2, C3, C4, C5, C6, CLAMP)
    dpt = tu.dot(v, tl.trans(do), DOT_PREC)
    dst = dpt * _dact(st, ACT, POLY, C1, C2, C3, C4, C5, C6, CLAMP)
    if MASK:
        vis = tl.trans(_visible(offs_m, offs_n, doff, LEFT, RIGHT, hstu, HSTU))
        at = tl.where(vis, at, 0.0)
        dst = tl.where(vis, dst, 0.0)  # act'(0) != 0: drop masked entries explicitly
    dv = tu.dot_acc(at.to(do.dtype), do, dv, DOT_PREC)
    dk = tu.dot_acc(dst.to(q.dtype), q, dk, DOT_PREC)
    return dk, dv


@triton.jit
def _dq_kv_tile(dq, q, do, Kb, Vb, n0, offs_m, offs_n0, lk, offs_d, d_ok, stride_kt, stride_vt, doff, LEFT, RIGHT, hstu,
                HSTU: tl.constexpr, MASK: tl.constexpr, ACT: tl.constexpr, POLY: tl.constexpr, C1: tl.constexpr,
                C2: tl.constexpr, C3: tl.constexpr, C4: tl.constexpr, C5: tl.constexpr, C6: tl.constexpr,
                CLAMP: tl.constexpr, DOT_PREC: tl.constexpr):
    """dQ of one query tile += one key tile's share; MASK: the tile crosses the window edge."""
    offs_n = n0 + offs_n0
    k, v, _ = _load_kv(Kb, Vb, offs_n, lk, offs_d, d_ok, stride_kt, stride_vt)
    s = tu.dot(q, tl.trans(k), DOT_PREC)
    dp = tu.dot(do, tl.trans(v), DOT_PREC)
    ds = dp * _dact(s, ACT, POLY, C1, C2, C3, C4, C5, C6, CLAMP)
    if MASK:
        ds = tl.where(_visible(offs_m, offs_n, doff, LEFT, RIGHT, hstu, HSTU), ds, 0.0)
    return tu.dot_acc(ds.to(k.dtype), k, dq, DOT_PREC)


@triton.jit
def _bwd_dkdv_kernel(Q, K, V, DO, DK, DV, OFF_Q, OFF_K, WORK, stride_qt, stride_qh, stride_kt, stride_kh, stride_vt,
                     stride_vh, stride_dot, stride_doh, stride_dkt, stride_dkh, stride_dvt, stride_dvh, scale,
                     out_scale, LEFT, RIGHT, max_len_bucket, NUM_HEADS, GROUP: tl.constexpr, HEAD_DIM: tl.constexpr,
                     BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, MASKED: tl.constexpr,
                     ACT: tl.constexpr, POLY: tl.constexpr, C1: tl.constexpr, C2: tl.constexpr, C3: tl.constexpr,
                     C4: tl.constexpr, C5: tl.constexpr, C6: tl.constexpr, CLAMP: tl.constexpr,
                     DOT_PREC: tl.constexpr, NUM_TARGETS, HSTU_CTX, HSTU_MAX_ATTN, HSTU: tl.constexpr):
    """dK, dV of one key tile of one kv head, over the q tiles of every head of its GQA group."""
    b, tile, kvh = _work_item(WORK, NUM_HEADS)
    if b < 0:
        return
    n0 = tile * BLOCK_N
    q_start, lq, k_start, lk = _seq_bounds(OFF_Q, OFF_K, b)
    doff = lk - lq
    hstu = tu.hstu_seq(NUM_TARGETS, b, lq, lk, HSTU_CTX, HSTU_MAX_ATTN, HSTU)
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < HEAD_DIM
    offs_n = n0 + tl.arange(0, BLOCK_N)
    Kb = K + k_start * stride_kt + kvh * stride_kh
    Vb = V + k_start * stride_vt + kvh * stride_vh
    k, v, kmask = _load_kv(Kb, Vb, offs_n, lk, offs_d, d_ok, stride_kt, stride_vt)
    dk = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)
    dv = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)
    # q rows whose window meets this key tile: n0 - doff - right <= i <= n0 + BN - 1 - doff + left
    lo, hi = _partner_range(n0, lq, -doff, RIGHT, LEFT, MASKED, BLOCK_N, BLOCK_M)
    nt = tl.cdiv(tl.maximum(hi - lo, 0), BLOCK_M)
    t_a = 0
    t_b = nt
    if HSTU:  # masked q tiles only, in up to three runs (gem.ops.triton_utils.hstu_query_tiles)
        runs = tu.hstu_query_tiles(n0, hstu, BLOCK_N, BLOCK_M)
        t_a = tu.hstu_tile_count(runs)
        t_b = t_a
        nt = t_a
    elif MASKED:  # the mirror of the q tiles' runs: query i sees key j for j-doff-RIGHT <= i <= j-doff+LEFT
        t_a, t_b = tu.edge_runs(n0, tl.minimum(n0 + BLOCK_N, lk) - 1, lo, nt, -doff, RIGHT, LEFT, RIGHT >= 0, LEFT >= 0,
                             BLOCK_M)
    for g in range(GROUP):
        head = kvh * GROUP + g
        Qb = Q + q_start * stride_qt + head * stride_qh
        DOb = DO + q_start * stride_dot + head * stride_doh
        for t in range(t_a):
            m0 = lo + t * BLOCK_M
            if HSTU:
                m0 = tu.hstu_tile_start(t, runs, BLOCK_M)
            dk, dv = _dkdv_q_tile(dk, dv, k, v, Qb, DOb, m0, offs_n, lq, offs_d, d_ok, stride_qt, stride_dot, scale,
                                  doff, LEFT, RIGHT, hstu, HSTU, BLOCK_M, True, ACT, POLY, C1, C2, C3, C4, C5, C6,
                                  CLAMP, DOT_PREC)
        for t in range(t_a, t_b):
            dk, dv = _dkdv_q_tile(dk, dv, k, v, Qb, DOb, lo + t * BLOCK_M, offs_n, lq, offs_d, d_ok, stride_qt,
                                  stride_dot, scale, doff, LEFT, RIGHT, hstu, HSTU, BLOCK_M, False, ACT, POLY, C1, C2,
                                  C3, C4, C5, C6, CLAMP, DOT_PREC)
        for t in range(t_b, nt):
            dk, dv = _dkdv_q_tile(dk, dv, k, v, Qb, DOb, lo + t * BLOCK_M, offs_n, lq, offs_d, d_ok, stride_qt,
                                  stride_dot, scale, doff, LEFT, RIGHT, hstu, HSTU, BLOCK_M, True, ACT, POLY, C1, C2,
                                  C3, C4, C5, C6, CLAMP, DOT_PREC)
    DKb = DK + k_start * stride_dkt + kvh * stride_dkh
    DVb = DV + k_start * stride_dvt + kvh * stride_dvh
    dk_scale = out_scale * scale
    tl.store(_rows(DKb, offs_n, stride_dkt, offs_d), (dk * dk_scale).to(DK.dtype.element_ty), mask=kmask)
    tl.store(_rows(DVb, offs_n, stride_dvt, offs_d), (dv * out_scale).to(DV.dtype.element_ty), mask=kmask)


@triton.jit
def _bwd_dq_kernel(Q, K, V, DO, DQ, OFF_Q, OFF_K, WORK, stride_qt, stride_qh, stride_kt, stride_kh, stride_vt,
                   stride_vh, stride_dot, stride_doh, stride_dqt, stride_dqh, scale, out_scale, LEFT, RIGHT,
                   max_len_bucket, NUM_HEADS, GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, MASKED: tl.constexpr, ACT: tl.constexpr,
                   POLY: tl.constexpr, C1: tl.constexpr, C2: tl.constexpr, C3: tl.constexpr, C4: tl.constexpr,
                   C5: tl.constexpr, C6: tl.constexpr, CLAMP: tl.constexpr, DOT_PREC: tl.constexpr, NUM_TARGETS,
                   HSTU_CTX, HSTU_MAX_ATTN, HSTU: tl.constexpr):
    """dQ of one q tile of one head."""
    b, group_id, head = _work_item(WORK, NUM_HEADS)
    if b < 0:
        return
    q_start, lq, lk, doff, offs_d, d_ok, offs_n0, Qb, DOb, Kb, Vb, hstu = _q_item(
        Q, DO, K, V, OFF_Q, OFF_K, b, head, stride_qt, stride_qh, stride_dot, stride_doh, stride_kt, stride_kh,
        stride_vt, stride_vh, NUM_TARGETS, HSTU_CTX, HSTU_MAX_ATTN, HSTU, GROUP, HEAD_DIM, BLOCK_D, BLOCK_N)
    DQb = DQ + q_start * stride_dqt + head * stride_dqh
    m0 = group_id * BLOCK_M
    q, offs_m, qmask = _q_tile(Qb, m0, lq, offs_d, d_ok, stride_qt, scale, BLOCK_M, True)
    do = tl.load(_rows(DOb, offs_m, stride_dot, offs_d), mask=qmask, other=0.0)
    dq = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    lo, nt, t_a, t_b, runs = _key_runs(m0, lq, lk, doff, LEFT, RIGHT, hstu, HSTU, MASKED, BLOCK_M, BLOCK_N)
    for t in range(t_a):
        n0 = lo + t * BLOCK_N
        if HSTU:
            n0 = tu.hstu_tile_start(t, runs, BLOCK_N)
        dq = _dq_kv_tile(dq, q, do, Kb, Vb, n0, offs_m, offs_n0, lk, offs_d, d_ok, stride_kt, stride_vt, doff, LEFT,
                         RIGHT, hstu, HSTU, True, ACT, POLY, C1, C2, C3, C4, C5, C6, CLAMP, DOT_PREC)
    for t in range(t_a, t_b):
        dq = _dq_kv_tile(dq, q, do, Kb, Vb, lo + t * BLOCK_N, offs_m, offs_n0, lk, offs_d, d_ok, stride_kt, stride_vt,
                         doff, LEFT, RIGHT, hstu, HSTU, False, ACT, POLY, C1, C2, C3, C4, C5, C6, CLAMP, DOT_PREC)
    for t in range(t_b, nt):
        dq = _dq_kv_tile(dq, q, do, Kb, Vb, lo + t * BLOCK_N, offs_m, offs_n0, lk, offs_d, d_ok, stride_kt, stride_vt,
                         doff, LEFT, RIGHT, hstu, HSTU, True, ACT, POLY, C1, C2, C3, C4, C5, C6, CLAMP, DOT_PREC)
    tl.store(_rows(DQb, offs_m, stride_dqt, offs_d), (dq * (scale * out_scale)).to(DQ.dtype.element_ty), mask=qmask)


@triton.jit
def _bwd_short_kernel(Q, K, V, DO, DQ, DK, DV, OFF_Q, OFF_K, ORDER, stride_qt, stride_qh, stride_kt, stride_kh,
                      stride_vt, stride_vh, stride_dot, stride_doh, stride_dqt, stride_dqh, stride_dkt, stride_dkh,
                      stride_dvt, stride_dvh, scale, out_scale, LEFT, RIGHT, max_len_bucket, NUM_KV_HEADS,
                      GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr,
                      BLOCK_N: tl.constexpr, MASKED: tl.constexpr, ACT: tl.constexpr, POLY: tl.constexpr,
                      C1: tl.constexpr, C2: tl.constexpr, C3: tl.constexpr, C4: tl.constexpr, C5: tl.constexpr,
                      C6: tl.constexpr, CLAMP: tl.constexpr, DOT_PREC: tl.constexpr, KT: tl.constexpr, NUM_TARGETS,
                      HSTU_CTX, HSTU_MAX_ATTN, HSTU: tl.constexpr):
    """Short K/V, one pass: a program owns one sequence's whole K/V (one tile) for one kv head, streams the
    sequence's q and dO tiles of every head in its group once, and writes dQ per tile and dK/dV at the end.
    5 matmuls per tile pair instead of the two-pass 7, and q/dO are read once. No atomics."""
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < HEAD_DIM
    b = tl.load(ORDER + tl.program_id(0) // NUM_KV_HEADS)
    kvh = tl.program_id(0) % NUM_KV_HEADS
    q_start, lq, k_start, lk = _seq_bounds(OFF_Q, OFF_K, b)
    doff = lk - lq
    hstu = tu.hstu_seq(NUM_TARGETS, b, lq, lk, HSTU_CTX, HSTU_MAX_ATTN, HSTU)
    Kb = K + k_start * stride_kt + kvh * stride_kh
    Vb = V + k_start * stride_vt + kvh * stride_vh
    DKb = DK + k_start * stride_dkt + kvh * stride_dkh
    DVb = DV + k_start * stride_dvt + kvh * stride_dvh
    # a sequence's keys take the narrowest of BLOCK_N, BLOCK_N / 2, BLOCK_N / 4 (>= 16) that holds them: the
    # dots, activations and dK/dV tiles shrink with it (K/V lengths vary within a batch)
    if BLOCK_N >= 64:
        if lk <= BLOCK_N // 4:
            _bwd_short_item(Q, DO, DQ, Kb, Vb, DKb, DVb, q_start, lq, lk, doff, kvh, offs_d, d_ok, stride_qt, stride_qh,
                            stride_kt, stride_vt, stride_dot, stride_doh, stride_dqt, stride_dqh, stride_dkt,
                            stride_dvt, scale, out_scale, LEFT, RIGHT, hstu, HSTU, GROUP, BLOCK_D, BLOCK_M,
                            BLOCK_N // 4, MASKED, ACT, POLY, C1, C2, C3, C4, C5, C6, CLAMP, DOT_PREC, KT)
        elif lk <= BLOCK_N // 2:
            _bwd_short_item(Q, DO, DQ, Kb, Vb, DKb, DVb, q_start, lq, lk, doff, kvh, offs_d, d_ok, stride_qt, stride_qh,
                            stride_kt, stride_vt, stride_dot, stride_doh, stride_dqt, stride_dqh, stride_dkt,
                            stride_dvt, scale, out_scale, LEFT, RIGHT, hstu, HSTU, GROUP, BLOCK_D, BLOCK_M,
                            BLOCK_N // 2, MASKED, ACT, POLY, C1, C2, C3, C4, C5, C6, CLAMP, DOT_PREC, KT)
        else:
            _bwd_short_item(Q, DO, DQ, Kb, Vb, DKb, DVb, q_start, lq, lk, doff, kvh, offs_d, d_ok, stride_qt, stride_qh,
                            stride_kt, stride_vt, stride_dot, stride_doh, stride_dqt, stride_dqh, stride_dkt,
                            stride_dvt, scale, out_scale, LEFT, RIGHT, hstu, HSTU, GROUP, BLOCK_D, BLOCK_M, BLOCK_N,
                            MASKED, ACT, POLY, C1, C2, C3, C4, C5, C6, CLAMP, DOT_PREC, KT)
    else:
        _bwd_short_item(Q, DO, DQ, Kb, Vb, DKb, DVb, q_start, lq, lk, doff, kvh, offs_d, d_ok, stride_qt, stride_qh,
                        stride_kt, stride_vt, stride_dot, stride_doh, stride_dqt, stride_dqh, stride_dkt, stride_dvt,
                        scale, out_scale, LEFT, RIGHT, hstu, HSTU, GROUP, BLOCK_D, BLOCK_M, BLOCK_N, MASKED, ACT, POLY,
                        C1, C2, C3, C4, C5, C6, CLAMP, DOT_PREC, KT)


@triton.jit
def _bwd_short_item(Q, DO, DQ, Kb, Vb, DKb, DVb, q_start, lq, lk, doff, kvh, offs_d, d_ok, stride_qt, stride_qh,
                    stride_kt, stride_vt, stride_dot, stride_doh, stride_dqt, stride_dqh, stride_dkt, stride_dvt,
                    scale, out_scale, LEFT, RIGHT, hstu, HSTU: tl.constexpr, GROUP: tl.constexpr, BLOCK_D: tl.constexpr,
                    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, MASKED: tl.constexpr, ACT: tl.constexpr,
                    POLY: tl.constexpr, C1: tl.constexpr, C2: tl.constexpr, C3: tl.constexpr, C4: tl.constexpr,
                    C5: tl.constexpr, C6: tl.constexpr, CLAMP: tl.constexpr, DOT_PREC: tl.constexpr,
                    KT: tl.constexpr):
    """The one-pass backward of one (sequence, kv head) with its keys in one BLOCK_N tile.

    KT: scores are computed keys-major, S^T = K Q^T [BLOCK_N, BLOCK_M], so the dV and dK dots take act(S)^T and
    dS^T as they come (one transpose per tile, for dQ, instead of two) and the keys are the dots' M side: a 64-key
    tile fills a warpgroup's 64-row MMA whatever the q tile height."""
    offs_n = tl.arange(0, BLOCK_N)
    k, v, kmask = _load_kv(Kb, Vb, offs_n, lk, offs_d, d_ok, stride_kt, stride_vt)
    dk = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)
    dv = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)
    n_tiles = tl.cdiv(lq, BLOCK_M)
    for g in range(GROUP):
        head = kvh * GROUP + g
        Qb = Q + q_start * stride_qt + head * stride_qh
        DOb = DO + q_start * stride_dot + head * stride_doh
        DQb = DQ + q_start * stride_dqt + head * stride_dqh
        for t in range(n_tiles):
            offs_m = t * BLOCK_M + tl.arange(0, BLOCK_M)
            qmask = (offs_m[:, None] < lq) & d_ok[None, :]
            q = tl.load(_rows(Qb, offs_m, stride_qt, offs_d), mask=qmask, other=0.0)
            do = tl.load(_rows(DOb, offs_m, stride_dot, offs_d), mask=qmask, other=0.0)
            # padded rows / keys give 0 and act(0) = 0; the loaded q feeds both dots as is and dK takes the scale
            # at the end
            if KT:
                s = tu.dot(k, tl.trans(q), DOT_PREC)  # S^T [BN, BM]
            else:
                s = tu.dot(q, tl.trans(k), DOT_PREC)  # [BM, BN]
            s = s * scale
            a = _act(s, ACT, POLY, C1, C2, C3, C4, C5, C6, CLAMP)
            if KT:
                ds = tu.dot(v, tl.trans(do), DOT_PREC)
            else:
                ds = tu.dot(do, tl.trans(v), DOT_PREC)
            ds = ds * _dact(s, ACT, POLY, C1, C2, C3, C4, C5, C6, CLAMP)
            if MASKED:  # act'(0) != 0: drop masked entries explicitly
                if KT:
                    vis = _visible_t(offs_n, offs_m, doff, LEFT, RIGHT, hstu, HSTU)
                else:
                    vis = _visible(offs_m, offs_n, doff, LEFT, RIGHT, hstu, HSTU)
                a = tl.where(vis, a, 0.0)
                ds = tl.where(vis, ds, 0.0)
            if KT:
                dv = tu.dot_acc(a.to(do.dtype), do, dv, DOT_PREC)
                dk = tu.dot_acc(ds.to(q.dtype), q, dk, DOT_PREC)
                dq = tu.dot(tl.trans(ds.to(k.dtype)), k, DOT_PREC)
            else:
                dv = tu.dot_acc(tl.trans(a.to(do.dtype)), do, dv, DOT_PREC)
                dk = tu.dot_acc(tl.trans(ds.to(q.dtype)), q, dk, DOT_PREC)
                dq = tu.dot(ds.to(k.dtype), k, DOT_PREC)
            tl.store(_rows(DQb, offs_m, stride_dqt, offs_d), (dq * (scale * out_scale)).to(DQ.dtype.element_ty),
                     mask=qmask)
    dk_scale = out_scale * scale
    tl.store(_rows(DKb, offs_n, stride_dkt, offs_d), (dk * dk_scale).to(DKb.dtype.element_ty), mask=kmask)
    tl.store(_rows(DVb, offs_n, stride_dvt, offs_d), (dv * out_scale).to(DVb.dtype.element_ty), mask=kmask)


# --------------------------------------------------------------------------------------------- launch configs
# Candidates per kernel; the first is the default (GEM_AUTOTUNE=0). A small space: each config costs a compile per
# key.
def _configs(names: tuple[str, ...], values: list[tuple]) -> list[LaunchConfig]:
    """LaunchConfigs of (*tiles named by names, num_warps, num_stages) entries."""
    return [LaunchConfig.of(v[-2], v[-1], **dict(zip(names, v[:-2]))) for v in values]


if triton_interpreting():
    CONFIGS = {"fwd_short": _configs((), [(1, 1)]), "fwd_long": _configs(("BLOCK_N",), [(16, 1, 1)]),
               "fwd_long_small": _configs(("BLOCK_N",), [(16, 1, 1)]), "bwd_dkdv": _configs(("BLOCK_M",), [(16, 1, 1)]),
               "bwd_dq": _configs(("BLOCK_N",), [(16, 1, 1)]), "bwd_dq_small": _configs(("BLOCK_N",), [(16, 1, 1)]),
               "bwd_short": _configs(("BLOCK_M", "KT"), [(16, False, 1, 1)])}
else:
    CONFIGS = {
        # one stage first: without a double-buffered q tile a program needs 48 KB of shared memory instead of 72
        # (64-row tiles, 64 keys), so four programs share an SM and hide each other's loads
        "fwd_short": _configs((), [(4, 1), (4, 2), (8, 1), (8, 2)]),
        "fwd_long": _configs(("BLOCK_N",), [(n, 8, s) for n in (64, 128) for s in (2, 3)]),
        # q tiles of at most 64 rows: one warpgroup (an 8-warp program would split a 64-row wgmma tile), so two or
        # three programs share an SM and hide each other's load and activation latency
        "fwd_long_small": _configs(("BLOCK_N",), [(64, 4, 2), (64, 4, 3), (128, 4, 2)]),
        # spill-free first (ptxas: 32-row tiles on 8 warps; some 4-warp ones spill at some shapes)
        "bwd_dkdv": _configs(("BLOCK_M",), [(32, 8, 2), (32, 8, 3), (64, 8, 2), (32, 4, 2), (64, 4, 2), (32, 4, 3),
                                            (16, 4, 3)]),
        "bwd_dq": _configs(("BLOCK_N",), [(n, 8, 2) for n in (32, 64)]),
        "bwd_dq_small": _configs(("BLOCK_N",), [(32, 4, 2), (64, 4, 2), (64, 4, 3)]),  # q tiles of <= 64 rows
        # 3-stage 4-warp tiles first, keys-major scores (KT) first: two programs per SM, each with the next tiles'
        # q/dO loads in flight
        "bwd_short": _configs(("BLOCK_M", "KT"), [(32, True, 4, 3), (32, False, 4, 3), (64, True, 4, 2),
                                                  (16, False, 4, 3), (16, True, 4, 3), (32, False, 4, 2),
                                                  (16, False, 4, 2), (32, False, 8, 3), (64, False, 8, 2),
                                                  (32, False, 8, 2)]),
    }
# Smaller tiles per kind for where no candidate fits the device's shared memory (fp32 at wide heads), largest
# first; the short-K/V kinds cannot shrink their K/V tile, so their paths are taken only where they fit (_fits).
FALLBACK = {
    "fwd_short": _configs((), [(4, 1)]),
    "fwd_long": _configs(("BLOCK_N",), [(32, 4, 1), (16, 4, 1)]),
    "fwd_long_small": _configs(("BLOCK_N",), [(32, 4, 1), (16, 4, 1)]),
    "bwd_dkdv": _configs(("BLOCK_M",), [(16, 4, 1)]),
    "bwd_dq": _configs(("BLOCK_N",), [(32, 4, 1), (16, 4, 1)]),
    "bwd_dq_small": _configs(("BLOCK_N",), [(32, 4, 1), (16, 4, 1)]),
    "bwd_short": _configs(("BLOCK_M", "KT"), [(16, False, 4, 1)]),
}


def _smem(kind: str, kwargs: dict, elt: int):
    """The shared-memory estimate (gem.ops._tune.attention_smem) of a config of one kernel kind, its fixed tile
    sizes taken from kwargs: the forward holds q and streams K/V (the short-K/V one the reverse), dK/dV and the
    one-pass backward hold K/V and stream q/dO, dQ holds q/dO and streams K/V."""
    def estimate(cfg: LaunchConfig) -> int:
        kw = {**kwargs, **cfg.launch_kwargs()}
        bm, bn, bd, stages = kw["BLOCK_M"], kw.get("BLOCK_N", 0), kw["BLOCK_D"], kw["num_stages"]
        if kind == "fwd_short":
            return attention_smem(2 * bn * bd, bm * bd, stages, elt, bm * bn)
        if kind.startswith("fwd"):
            return attention_smem(bm * bd, 2 * bn * bd, stages, elt, bm * bn)
        if kind == "bwd_dkdv":
            return attention_smem(2 * bn * bd, 2 * bm * bd, stages, elt, bm * bn)
        if kind == "bwd_short":
            return attention_smem(2 * bn * bd, 2 * bm * bd, stages, elt, 2 * bm * bn)
        return attention_smem(2 * bm * bd, 2 * bn * bd, stages, elt, bm * bn)
    return estimate


def _fits(kind: str, kwargs: dict, elt: int, device) -> bool:
    """Whether the smallest fallback of a short-K/V kind fits this device's shared memory."""
    return _smem(kind, kwargs, elt)(FALLBACK[kind][-1]) <= shared_memory_limit(device)


# each kernel kind: the kernel, and the constexprs its tuning key holds besides _KEY, max_len_bucket and dtypes
_KEY = ("HEAD_DIM", "ACT", "POLY", "MASKED")
_KINDS = {"fwd_short": (_fwd_kernel, ("SHORT_KV", "BLOCK_N", "TILES", "BLOCK_M")),
          "fwd_long": (_fwd_kernel, ("SHORT_KV", "TILES", "BLOCK_M", "FLAT")),
          "fwd_long_small": (_fwd_kernel, ("SHORT_KV", "TILES", "BLOCK_M", "FLAT")),
          "bwd_dkdv": (_bwd_dkdv_kernel, ("GROUP",)), "bwd_dq": (_bwd_dq_kernel, ("BLOCK_M",)),
          "bwd_dq_small": (_bwd_dq_kernel, ("BLOCK_M",)), "bwd_short": (_bwd_short_kernel, ("GROUP", "BLOCK_N"))}
_TUNER = ConfigTuner("gem.ops.gdpa")


def _launch(kind: str, grid: tuple, args: tuple, kwargs: dict, outputs: tuple) -> None:
    """kernel[grid](*args, **kwargs) on the config the tuner picked for this key (every kernel only stores, so a
    timed config leaves nothing another one reads); outputs: the tensors it writes whole, checked while tuning."""
    kernel, names = _KINDS[kind]
    key = tuple(kwargs[n] for n in _KEY + names) + (args[-2],) + tuple(
        a.dtype for a in args if isinstance(a, torch.Tensor))
    if kwargs["HSTU"]:  # keys without the HSTU mask stay as they were
        key += ("hstu",)

    def launch(cfg):
        kernel[grid](*args, **kwargs, **cfg.launch_kwargs())

    launch(_TUNER.pick(kind, key, CONFIGS[kind], launch, args[0].device, outputs=outputs,
                       estimate=lambda cfg: _smem(kind, kwargs, args[0].element_size())(cfg),
                       fallback=FALLBACK[kind]))


# ------------------------------------------------------------------------------------------------- host side
def _blocks(d: int) -> tuple[int, int]:
    """(base q tile height, BLOCK_N of the k-tiled dK/dV pass); fixed since the work tables use them.

    The dK/dV program holds two fp32 [BLOCK_N, D] accumulators plus K and V in registers: 64 keys at D > 64.
    """
    if triton_interpreting():
        return 16, 16
    return 128, (64 if d > 64 else 128)


def _dq_block_m(d: int) -> int:
    """The dQ pass's q tile height: 64 rows on one warpgroup at D > 64 (several programs per SM)."""
    rows = _blocks(d)[0]
    return min(rows, 64) if d > 64 else rows


def _fwd_block_m(d: int, kv_tile: int = 0) -> int:
    """The forward's q tile height. A 128-row tile at D 128 holds a 64 KB fp32 accumulator: one program per SM.
    The short-K/V path with up to 64 keys (kv_tile) and the tiled path (kv_tile 0) at D > 64 take 64-row tiles on
    one warpgroup, two or three programs per SM."""
    rows = _blocks(d)[0]
    return min(rows, 64) if 0 < kv_tile <= 64 or (kv_tile == 0 and d > 64) else rows


def _tiles_per_program(t: int, block_m: int, h: int, n_seq: int, max_len_q: int, device) -> int:
    """q tiles per program (1..8, a power of two): enough to amortise each program's setup while keeping >= ~4
    waves of programs, and no more than the longest sequence has (the extra ones would only be skipped)."""
    est_tiles = (t // block_m + n_seq) * h
    tiles = 1
    while tiles < 8 and tiles * block_m < max_len_q and est_tiles // (2 * tiles) >= 4 * tu.num_sms(device):
        tiles *= 2
    return tiles


# the forward's fused (q tile, K/V tile) loop only pays where each q tile's key loop is short
FUSED_MAX_LEN_K = 256


def _fused_tiles(t: int, block_m: int, h: int, n_seq: int, max_len_q: int, max_len_k: int, device) -> int:
    """q tiles per program of the unmasked long-K/V forward run as one fused (q tile, K/V tile) loop; 0: one q tile
    per program, no fused loop. The next tile's first K/V loads overlap this tile's last, where one tile per
    program exposes them: a key loop of 1-4 tiles never reaches a steady state."""
    if max_len_k > FUSED_MAX_LEN_K:
        return 0
    tiles = _tiles_per_program(t, block_m, h, n_seq, max_len_q, device)
    return tiles if tiles > 1 else 0


def _consts(activation: str, approx: str, tanh: bool = False) -> dict:
    if approx:
        p = POLY6[activation]
        c = dict(zip(("C1", "C2", "C3", "C4", "C5", "C6"), p.coef))
        return dict(ACT=ACTIVATIONS.index(activation), POLY=True, CLAMP=p.clamp, **c)
    return {"ACT": ACT_TANH_FORM[activation] if tanh else ACTIVATIONS.index(activation), "POLY": False,
            "CLAMP": 0.0, "C1": 0.0, "C2": 0.0, "C3": 0.0, "C4": 0.0, "C5": 0.0, "C6": 0.0}


def _table(offsets_a, offsets_b, max_len_a, rows, left, right, ordered, transpose, total):
    """The work table of one pass (gem.ops.triton_utils.work_table, cost "tile_span")."""
    return tu.work_table("tile_span", offsets_a, offsets_b, max_len_a, rows, left=left, right=right,
                      transpose=transpose, ordered=ordered, total=total)


def _common(q, k, left, right, activation, approx, hstu: bool = False) -> dict:
    """Constexprs shared by the forward and both backward kernels."""
    return dict(GROUP=q.shape[1] // k.shape[1], HEAD_DIM=q.shape[2], BLOCK_D=tu.len_bucket(q.shape[2]),
                MASKED=left >= 0 or right >= 0 or hstu, DOT_PREC=tu.dot_prec(q.dtype),
                **_consts(activation, approx, tanh_form(activation, approx, q.dtype)))


def hstu_launch_args(hstu, offsets_q) -> tuple:
    """(num_targets, contextual_len, max_attn_len) of the custom ops from a gem.ops.hstu_mask.HstuMask or None."""
    if hstu is None:
        return None, 0, 0
    return hstu.num_targets, hstu.contextual_len, hstu.max_attn


def _launch_args(tensors, offsets_q, offsets_k, table, scale, out_scale, left, right, max_len, heads) -> tuple:
    """The kernels' runtime arguments: tensors, offsets, work table, (token, head) strides of each tensor, scalars."""
    strides = [s for x in tensors for s in (x.stride(0), x.stride(1))]
    return (*tensors, offsets_q, offsets_k, table, *strides, scale, out_scale, left, right, tu.len_bucket(max_len), heads)


# ------------------------------------------------------------------------------------ custom ops + autograd
# _gdpa_fwd / _gdpa_bwd do the work; gdpa_op (gem.ops._register.KernelOp) makes them one differentiable op.
def _gdpa_fwd(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, offsets_q: torch.Tensor, offsets_k: torch.Tensor,
              max_len_q: int, max_len_k: int, activation: str, approx: str, left: int, right: int, scale: float,
              out_scale: float, ordered: bool, short_kv: int,
              num_targets: Optional[torch.Tensor] = None,  # noqa: UP045 (custom-op schemas)
              hstu_ctx: int = 0, hstu_max_attn: int = 0) -> torch.Tensor:
    q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
    t, h, d = q.shape
    if t == 0 or max_len_q == 0 or h == 0:
        return torch.zeros_like(q)
    out = _empty_like(q)  # every row lies in some work item's tiles, so the kernel writes it
    kv_tile = tu.len_bucket(max_len_k)
    use_short = (kv_tile <= SHORT_KV_MAX and kv_tile * tu.len_bucket(d) <= SHORT_KV_ELEMS) if short_kv < 0 else bool(
        short_kv)
    bd = tu.len_bucket(d)
    if use_short and not _fits("fwd_short", {"BLOCK_M": _fwd_block_m(d, kv_tile), "BLOCK_N": kv_tile, "BLOCK_D": bd},
                               q.element_size(), q.device):
        use_short = False  # its K/V tile does not fit (fp32 at wide heads): the tiled path
    block_m = _fwd_block_m(d, kv_tile if use_short else 0)
    tiles = 1
    flat = False
    if use_short:  # the K/V load is amortised over the program's q tiles
        tiles = _tiles_per_program(t, block_m, h, offsets_q.numel() - 1, max_len_q, q.device)
    elif left < 0 and right < 0 and num_targets is None:
        fused = _fused_tiles(t, block_m, h, offsets_q.numel() - 1, max_len_q, max_len_k, q.device)
        tiles, flat = max(fused, 1), fused > 0
    table = _table(offsets_q, offsets_k, max_len_q, block_m * tiles, left, right, ordered, False, t)
    common = dict(BLOCK_M=block_m, TILES=tiles,
                  **_common(q, k, left, right, activation, approx, num_targets is not None),
                  **tu.hstu_kw(offsets_q, num_targets, hstu_ctx, hstu_max_attn, max(max_len_q, max_len_k)))
    args = _launch_args((q, k, v, out), offsets_q, offsets_k, table, scale, out_scale, left, right, max_len_k, h)
    grid = (table.shape[0] * h,)
    if use_short:
        _launch("fwd_short", grid, args, dict(BLOCK_N=kv_tile, SHORT_KV=True, FLAT=False, **common), (out,))
    else:
        _launch("fwd_long_small" if block_m <= 64 else "fwd_long", grid, args,
                dict(SHORT_KV=False, FLAT=flat, **common), (out,))
    return out


def _gdpa_bwd(do: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, offsets_q: torch.Tensor,
              offsets_k: torch.Tensor, max_len_q: int, max_len_k: int, activation: str, approx: str, left: int,
              right: int, scale: float, out_scale: float, ordered: bool, short_kv: int,
              num_targets: Optional[torch.Tensor] = None,  # noqa: UP045 (custom-op schemas)
              hstu_ctx: int = 0, hstu_max_attn: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    q, k, v, do = q.contiguous(), k.contiguous(), v.contiguous(), do.contiguous()
    t, h, d = q.shape
    if h == 0 or (max_len_q == 0 and max_len_k == 0):
        return torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
    hstu = tu.hstu_kw(offsets_q, num_targets, hstu_ctx, hstu_max_attn, max(max_len_q, max_len_k))
    kv_tile = tu.len_bucket(max_len_k)
    fits = kv_tile <= 128 and kv_tile * tu.len_bucket(d) <= SHORT_BWD_ELEMS
    # by default only with a wave of programs at least: one program walks a whole sequence's q tiles
    wide = (offsets_q.numel() - 1) * k.shape[1] >= tu.num_sms(q.device)
    fits = fits and _fits("bwd_short", {"BLOCK_M": 16, "BLOCK_N": kv_tile, "BLOCK_D": tu.len_bucket(d)},
                          q.element_size(), q.device)
    if (fits and wide if short_kv < 0 else bool(short_kv) and fits) and offsets_q.numel() > 1:
        return _gdpa_bwd_short(do, q, k, v, offsets_q, offsets_k, max_len_k, activation, approx, left, right,
                               scale, out_scale, ordered, hstu)
    # every row lies in some work item's tiles (a sequence with no partners stores zeros), so no memset
    dq = _empty_like(q) if t and max_len_q > 0 else torch.zeros_like(q)
    dk = _empty_like(k) if k.shape[0] and max_len_k > 0 else torch.zeros_like(k)
    dv = _empty_like(v) if k.shape[0] and max_len_k > 0 else torch.zeros_like(v)
    block_n = _blocks(d)[1]
    common = {**_common(q, k, left, right, activation, approx, num_targets is not None), **hstu}
    if k.shape[0] and max_len_k > 0:
        ktab = _table(offsets_k, offsets_q, max_len_k, block_n, left, right, ordered, True, k.shape[0])
        args = _launch_args(
            (q, k, v, do, dk, dv), offsets_q, offsets_k, ktab, scale, out_scale, left, right, max_len_q, k.shape[1]
        )
        _launch("bwd_dkdv", (ktab.shape[0] * k.shape[1],), args, dict(BLOCK_N=block_n, **common), (dk, dv))
    if t and max_len_q > 0:
        block_m = _dq_block_m(d)  # one q tile per program: a fused loop lost here on 64-row tiles
        qtab = _table(offsets_q, offsets_k, max_len_q, block_m, left, right, ordered, False, t)
        args = _launch_args((q, k, v, do, dq), offsets_q, offsets_k, qtab, scale, out_scale, left, right, max_len_k, h)
        _launch("bwd_dq_small" if block_m <= 64 else "bwd_dq", (qtab.shape[0] * h,), args,
                dict(BLOCK_M=block_m, **common), (dq,))
    return dq, dk, dv


def _gdpa_bwd_short(do, q, k, v, offsets_q, offsets_k, max_len_k, activation, approx, left, right, scale, out_scale,
                    ordered, hstu):
    """The one-pass backward (_bwd_short_kernel): one program per (sequence, kv head), longest q first."""
    dq, dk, dv = _empty_like(q), _empty_like(k), _empty_like(v)  # every row is written
    nb = offsets_q.numel() - 1

    def order():
        if not ordered:
            return torch.arange(nb, dtype=torch.int32, device=q.device)
        lq = offsets_q[1:] - offsets_q[:-1]
        return torch.argsort(lq, descending=True, stable=True).to(torch.int32)

    table = cached("gdpa_seq_order", offsets_q, offsets_k, (ordered,), order)
    common = {**_common(q, k, left, right, activation, approx, hstu["HSTU"]), **hstu}
    args = _launch_args((q, k, v, do, dq, dk, dv), offsets_q, offsets_k, table, scale, out_scale, left, right,
                        max_len_k, k.shape[1])
    _launch("bwd_short", (nb * k.shape[1],), args, dict(BLOCK_N=tu.len_bucket(max_len_k), **common),
            (dq, dk, dv))
    return dq, dk, dv


def _fwd_fake(q, *rest):
    return torch.empty_like(q)


def _bwd_fake(do, q, k, v, *rest):
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


# gdpa() calls gdpa_op(q, k, v, offsets_q, offsets_k, *constants) -> out; the backward recomputes the scores
gdpa_op = KernelOp("gdpa", _gdpa_fwd, _gdpa_bwd, fake=_fwd_fake, backward_fake=_bwd_fake, n_tensors=5,
                   save=lambda i, o: i[:5])
