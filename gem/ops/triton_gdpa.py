"""Triton kernels for GDPA (see gem/ops/gdpa.py for the math and the masking conventions).

No softmax means no running max, no rescale and no correction stage: acc += act(S) @ V in fp32.
Every activation has act(0) == 0, so rows past a sequence's end simply load as zeros: their scores are 0,
their activations 0, and they add nothing; only tiles that cross the causal/window diagonal need a mask.
The forward has two paths: long K/V tiles over K like FlashAttention; short K/V (whole sequence fits one
tile) loads K/V once per program and walks several Q tiles. Work items (sequence, tile) are listed in an
int32 table built on device, longest first by default, so a skewed batch does not end on one long tail.
The backward has two forms, neither with atomics. Two-pass (split dQ, as FlashAttention): one program set per
(K tile, KV head) makes dK/dV over the Q tiles of every head of its GQA group, another per (Q tile, head) makes
dQ. One-pass, when a sequence's whole K/V and its fp32 dK/dV fit one program (short K/V, the cross-attention
case) and the batch fills a wave of programs: one program per (sequence, KV head) streams the sequence's q/dO
tiles once, stores each tile's dQ and keeps dK/dV in registers: 5 matmuls per tile pair instead of 7, and q/dO
read once instead of twice; its scores may be computed keys-major (S^T = K Q^T, a config the tuner picks), so the
dK/dV dots take them untransposed with the K/V tile on their M side. Both short-K/V kernels give each sequence the
narrowest of their K/V tile, its half and its quarter that holds its keys.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from gem.ops._common import eager_tables, next_pow2, offsets_cached, triton_interpreting
from gem.ops.gdpa import ACTIVATIONS, LEAKY_SLOPE, POLY6

SHORT_KV_MAX = 256  # forward keeps the whole K/V sequence in one tile up to this many keys (D <= 64) ...
SHORT_KV_ELEMS = 128 * 128  # ... and while BLOCK_N * D stays within this many elements
# one-pass backward while a sequence's whole K/V fits one tile whose fp32 dK and dV stay in registers
SHORT_BWD_ELEMS = 64 * 128
# Tests set this to NaN: outputs start as NaN, so a row that no program writes fails the comparison.
_POISON: float | None = None


def _empty_like(x: torch.Tensor) -> torch.Tensor:
    out = torch.empty_like(x)
    return out.fill_(_POISON) if _POISON is not None else out


# ----------------------------------------------------------------------------------------------- activations
@triton.jit
def _act(
    s,
    ACT: tl.constexpr,
    POLY: tl.constexpr,
    C1: tl.constexpr,
    C2: tl.constexpr,
    C3: tl.constexpr,
    C4: tl.constexpr,
    C5: tl.constexpr,
    C6: tl.constexpr,
    CLAMP: tl.constexpr,
):
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
def _dact(
    s,
    ACT: tl.constexpr,
    POLY: tl.constexpr,
    C1: tl.constexpr,
    C2: tl.constexpr,
    C3: tl.constexpr,
    C4: tl.constexpr,
    C5: tl.constexpr,
    C6: tl.constexpr,
    CLAMP: tl.constexpr,
):
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
TANH_MODES = ("auto", "approx", "exact")


def tanh_mode() -> str:
    """GEM_GDPA_TANH, read per call (forward and backward each read it: a knob for measurement, not to flip
    between them): "auto" (default) writes gelu_tanh and silu with one tanh.approx instruction on the GPU for bf16
    inputs and keeps the exp + divide form for fp16/fp32, whose finer rounding the instruction's ~|s| * 2^-12
    absolute error would approach; "approx" always takes the tanh form (on CPU its tanh goes through exp: tests of
    the formulas); "exact" never does."""
    mode = os.environ.get("GEM_GDPA_TANH", "auto")
    if mode not in TANH_MODES:
        raise ValueError(f"GEM_GDPA_TANH={mode!r}: expected one of {TANH_MODES}")
    return mode


def tanh_form(activation: str, approx: str, dtype) -> bool:
    """Whether the kernels compute `activation` in its tanh form (ACT_TANH_FORM)."""
    if approx or activation not in ACT_TANH_FORM:
        return False
    mode = tanh_mode()
    return mode == "approx" or (mode == "auto" and not triton_interpreting() and dtype == torch.bfloat16)


@triton.jit
def _mm(a, b, PREC: tl.constexpr, UPCAST: tl.constexpr):
    # the CPU interpreter (triton 3.7) mis-multiplies bf16 operands: feed it fp32 (same products, exact)
    if UPCAST:
        r = tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    else:
        r = tl.dot(a, b, input_precision=PREC)
    return r


@triton.jit
def _mma(a, b, acc, PREC: tl.constexpr, UPCAST: tl.constexpr):
    if UPCAST:
        r = tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision="ieee")
    else:
        r = tl.dot(a, b, acc, input_precision=PREC)
    return r


@triton.jit
def _visible(offs_m, offs_n, doff, LEFT, RIGHT):
    """[M, N] mask of key j visible to query i: diag-left <= j <= diag+right, diag = i + (Lk - Lq)."""
    diag = offs_m[:, None] + doff
    vis = (offs_m[:, None] >= 0) & (offs_n[None, :] >= 0)  # full [M, N] shape from the start
    if LEFT >= 0:
        vis = vis & (offs_n[None, :] >= diag - LEFT)
    if RIGHT >= 0:
        vis = vis & (offs_n[None, :] <= diag + RIGHT)
    return vis


@triton.jit
def _visible_t(offs_n, offs_m, doff, LEFT, RIGHT):
    """_visible transposed, [N, M], built directly (no layout change of a mask)."""
    diag = offs_m[None, :] + doff
    vis = (offs_n[:, None] >= 0) & (offs_m[None, :] >= 0)
    if LEFT >= 0:
        vis = vis & (offs_n[:, None] >= diag - LEFT)
    if RIGHT >= 0:
        vis = vis & (offs_n[:, None] <= diag + RIGHT)
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
def _runs(p0, p_last, lo, nt, off, BELOW, ABOVE, BLOCK_R: tl.constexpr):
    """Of the nt partner tiles (BLOCK_R wide, from lo) of rows [p0, p_last], row p seeing p+off-BELOW ..
    p+off+ABOVE: [t_a, t_b) are inside every row's window (no mask); tiles before t_a cross the lower edge, tiles
    from t_b on the upper one. Split loops let the unmasked run be software-pipelined, with no per-tile branch."""
    t_a = 0
    t_b = nt
    if BELOW >= 0:
        t_a = tl.cdiv(tl.maximum(p_last + off - BELOW - lo, 0), BLOCK_R)
    if ABOVE >= 0:
        t_b = tl.maximum(p0 + off + ABOVE + 1 - lo, 0) // BLOCK_R
    t_a = tl.minimum(t_a, nt)
    t_b = tl.minimum(tl.maximum(t_b, t_a), nt)
    return t_a, t_b


@triton.jit
def _key_runs(m0, lq, lk, doff, LEFT, RIGHT, MASKED: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """Key tiles of q rows [m0, m0 + BLOCK_M): first key, tile count, and the unmasked run [t_a, t_b)."""
    lo, hi = _partner_range(m0, lk, doff, LEFT, RIGHT, MASKED, BLOCK_M, BLOCK_N)
    nt = tl.cdiv(tl.maximum(hi - lo, 0), BLOCK_N)
    t_a = 0
    t_b = nt
    if MASKED:
        t_a, t_b = _runs(m0, tl.minimum(m0 + BLOCK_M, lq) - 1, lo, nt, doff, LEFT, RIGHT, BLOCK_N)
    return lo, nt, t_a, t_b


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
def _fwd_kv_tile(acc, q, Kb, Vb, n0, offs_m, offs_n0, lk, offs_d, d_ok, stride_kt, stride_vt, doff, LEFT, RIGHT,
                 MASK: tl.constexpr, ACT: tl.constexpr, POLY: tl.constexpr, C1: tl.constexpr, C2: tl.constexpr,
                 C3: tl.constexpr, C4: tl.constexpr, C5: tl.constexpr, C6: tl.constexpr, CLAMP: tl.constexpr,
                 DOT_PREC: tl.constexpr, UPCAST: tl.constexpr):
    """acc += act(q k^T) v over one key tile (q comes scaled); MASK: the tile crosses the window edge."""
    offs_n = n0 + offs_n0
    k, v, _ = _load_kv(Kb, Vb, offs_n, lk, offs_d, d_ok, stride_kt, stride_vt)
    a = _act(_mm(q, tl.trans(k), DOT_PREC, UPCAST), ACT, POLY, C1, C2, C3, C4, C5, C6, CLAMP)
    if MASK:
        a = tl.where(_visible(offs_m, offs_n, doff, LEFT, RIGHT), a, 0.0)
    return _mma(a.to(v.dtype), v, acc, DOT_PREC, UPCAST)


@triton.jit
def _fwd_short_item(Qb, Ob, Kb, Vb, first, n_tiles, lq, lk, doff, offs_d, d_ok, stride_qt, stride_kt, stride_vt,
                    stride_ot, scale, out_scale, LEFT, RIGHT, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr,
                    BLOCK_N: tl.constexpr, MASKED: tl.constexpr, ACT: tl.constexpr, POLY: tl.constexpr,
                    C1: tl.constexpr, C2: tl.constexpr, C3: tl.constexpr, C4: tl.constexpr, C5: tl.constexpr,
                    C6: tl.constexpr, CLAMP: tl.constexpr, DOT_PREC: tl.constexpr, UPCAST: tl.constexpr,
                    SCALE_Q: tl.constexpr):
    """The short-K/V forward of one work item: its K/V in one BLOCK_N tile, loaded once, then its q tiles.
    Without SCALE_Q the scale multiplies S, so each loaded q tile feeds the dot as loaded (the pipelined load can
    go straight to shared memory)."""
    offs_n = tl.arange(0, BLOCK_N)
    k, v, _ = _load_kv(Kb, Vb, offs_n, lk, offs_d, d_ok, stride_kt, stride_vt)
    for t in range(n_tiles):
        m0 = (first + t) * BLOCK_M
        q, offs_m, qmask = _q_tile(Qb, m0, lq, offs_d, d_ok, stride_qt, scale, BLOCK_M, SCALE_Q)
        s = _mm(q, tl.trans(k), DOT_PREC, UPCAST)
        if not SCALE_Q:
            s = s * scale
        a = _act(s, ACT, POLY, C1, C2, C3, C4, C5, C6, CLAMP)
        if MASKED:
            a = tl.where(_visible(offs_m, offs_n, doff, LEFT, RIGHT), a, 0.0)
        acc = _mm(a.to(v.dtype), v, DOT_PREC, UPCAST)
        tl.store(_rows(Ob, offs_m, stride_ot, offs_d), (acc * out_scale).to(Ob.dtype.element_ty), mask=qmask)


@triton.jit
def _fwd_kernel(
    Q,
    K,
    V,
    O,
    OFF_Q,
    OFF_K,
    WORK,
    stride_qt,
    stride_qh,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_ot,
    stride_oh,
    scale,
    out_scale,
    LEFT,
    RIGHT,
    max_len_bucket,
    NUM_HEADS,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    TILES: tl.constexpr,
    SHORT_KV: tl.constexpr,
    FLAT: tl.constexpr,
    MASKED: tl.constexpr,
    ACT: tl.constexpr,
    POLY: tl.constexpr,
    C1: tl.constexpr,
    C2: tl.constexpr,
    C3: tl.constexpr,
    C4: tl.constexpr,
    C5: tl.constexpr,
    C6: tl.constexpr,
    CLAMP: tl.constexpr,
    DOT_PREC: tl.constexpr,
    UPCAST: tl.constexpr,
    NARROW: tl.constexpr,
    FWD_SCALE_Q: tl.constexpr,
):
    b, group_id, head = _work_item(WORK, NUM_HEADS)
    if b < 0:
        return
    q_start, lq, k_start, lk = _seq_bounds(OFF_Q, OFF_K, b)
    doff = lk - lq
    kvh = head // GROUP
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < HEAD_DIM
    offs_n0 = tl.arange(0, BLOCK_N)
    Qb = Q + q_start * stride_qt + head * stride_qh
    Ob = O + q_start * stride_ot + head * stride_oh
    Kb = K + k_start * stride_kt + kvh * stride_kh
    Vb = V + k_start * stride_vt + kvh * stride_vh
    # this item's q tiles that hold rows: a trip count, not a per-tile branch, so the loop can be pipelined
    first = group_id * TILES
    n_tiles = tl.minimum(tl.cdiv(tl.maximum(lq - first * BLOCK_M, 0), BLOCK_M), TILES)
    tl.static_assert(not (FLAT and (MASKED or SHORT_KV)))
    if SHORT_KV:
        # the whole K/V sequence in one tile, loaded once for all TILES q tiles of this item; its keys take the
        # narrowest of BLOCK_N, BLOCK_N / 2, BLOCK_N / 4 (>= 16) that holds them, so the dots and activations
        # shrink with the sequence (K/V lengths vary within a batch)
        if NARROW and BLOCK_N >= 64:
            if lk <= BLOCK_N // 4:
                _fwd_short_item(Qb, Ob, Kb, Vb, first, n_tiles, lq, lk, doff, offs_d, d_ok, stride_qt, stride_kt,
                                stride_vt, stride_ot, scale, out_scale, LEFT, RIGHT, BLOCK_D, BLOCK_M, BLOCK_N // 4,
                                MASKED, ACT, POLY, C1, C2, C3, C4, C5, C6, CLAMP, DOT_PREC, UPCAST,
                                FWD_SCALE_Q)
            elif lk <= BLOCK_N // 2:
                _fwd_short_item(Qb, Ob, Kb, Vb, first, n_tiles, lq, lk, doff, offs_d, d_ok, stride_qt, stride_kt,
                                stride_vt, stride_ot, scale, out_scale, LEFT, RIGHT, BLOCK_D, BLOCK_M, BLOCK_N // 2,
                                MASKED, ACT, POLY, C1, C2, C3, C4, C5, C6, CLAMP, DOT_PREC, UPCAST,
                                FWD_SCALE_Q)
            else:
                _fwd_short_item(Qb, Ob, Kb, Vb, first, n_tiles, lq, lk, doff, offs_d, d_ok, stride_qt, stride_kt,
                                stride_vt, stride_ot, scale, out_scale, LEFT, RIGHT, BLOCK_D, BLOCK_M, BLOCK_N,
                                MASKED, ACT, POLY, C1, C2, C3, C4, C5, C6, CLAMP, DOT_PREC, UPCAST,
                                FWD_SCALE_Q)
        else:
            _fwd_short_item(Qb, Ob, Kb, Vb, first, n_tiles, lq, lk, doff, offs_d, d_ok, stride_qt, stride_kt,
                            stride_vt, stride_ot, scale, out_scale, LEFT, RIGHT, BLOCK_D, BLOCK_M, BLOCK_N, MASKED,
                            ACT, POLY, C1, C2, C3, C4, C5, C6, CLAMP, DOT_PREC, UPCAST, FWD_SCALE_Q)
    elif FLAT:
        # unmasked K/V tiles: every q tile has the same key trip count, so the compiler can fuse the two loops
        # into one pipelined stream (the next q tile's first K/V tiles load during this one's last)
        nt = tl.cdiv(lk, BLOCK_N)
        for t in tl.range(n_tiles, flatten=True):
            q, offs_m, qmask = _q_tile(Qb, (first + t) * BLOCK_M, lq, offs_d, d_ok, stride_qt, scale, BLOCK_M,
                                       True)
            acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
            for j in range(nt):
                acc = _fwd_kv_tile(acc, q, Kb, Vb, j * BLOCK_N, offs_m, offs_n0, lk, offs_d, d_ok, stride_kt,
                                   stride_vt, doff, LEFT, RIGHT, False, ACT, POLY, C1, C2, C3, C4, C5, C6, CLAMP,
                                   DOT_PREC, UPCAST)
            tl.store(_rows(Ob, offs_m, stride_ot, offs_d), (acc * out_scale).to(O.dtype.element_ty), mask=qmask)
    else:
        for t in range(n_tiles):
            m0 = (first + t) * BLOCK_M
            q, offs_m, qmask = _q_tile(Qb, m0, lq, offs_d, d_ok, stride_qt, scale, BLOCK_M, True)
            acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
            lo, nt, t_a, t_b = _key_runs(m0, lq, lk, doff, LEFT, RIGHT, MASKED, BLOCK_M, BLOCK_N)
            for j in range(t_a):  # j: t is the q-tile loop's
                acc = _fwd_kv_tile(acc, q, Kb, Vb, lo + j * BLOCK_N, offs_m, offs_n0, lk, offs_d, d_ok, stride_kt,
                                   stride_vt, doff, LEFT, RIGHT, True, ACT, POLY, C1, C2, C3, C4, C5, C6, CLAMP,
                                   DOT_PREC, UPCAST)
            for j in range(t_a, t_b):
                acc = _fwd_kv_tile(acc, q, Kb, Vb, lo + j * BLOCK_N, offs_m, offs_n0, lk, offs_d, d_ok, stride_kt,
                                   stride_vt, doff, LEFT, RIGHT, False, ACT, POLY, C1, C2, C3, C4, C5, C6, CLAMP,
                                   DOT_PREC, UPCAST)
            for j in range(t_b, nt):
                acc = _fwd_kv_tile(acc, q, Kb, Vb, lo + j * BLOCK_N, offs_m, offs_n0, lk, offs_d, d_ok, stride_kt,
                                   stride_vt, doff, LEFT, RIGHT, True, ACT, POLY, C1, C2, C3, C4, C5, C6, CLAMP,
                                   DOT_PREC, UPCAST)
            tl.store(_rows(Ob, offs_m, stride_ot, offs_d), (acc * out_scale).to(O.dtype.element_ty), mask=qmask)


# ------------------------------------------------------------------------------------------------ backward
@triton.jit
def _dkdv_q_tile(dk, dv, k, v, Qb, DOb, m0, offs_n, lq, offs_d, d_ok, stride_qt, stride_dot, scale, doff, LEFT,
                 RIGHT, BLOCK_M: tl.constexpr, MASK: tl.constexpr, ACT: tl.constexpr, POLY: tl.constexpr,
                 C1: tl.constexpr, C2: tl.constexpr, C3: tl.constexpr, C4: tl.constexpr, C5: tl.constexpr,
                 C6: tl.constexpr, CLAMP: tl.constexpr, DOT_PREC: tl.constexpr, UPCAST: tl.constexpr,
                 SCALE_Q: tl.constexpr):
    """dK, dV of one key tile += one query tile's share; MASK: the tile pair crosses the window edge."""
    offs_m = m0 + tl.arange(0, BLOCK_M)
    qmask = (offs_m[:, None] < lq) & d_ok[None, :]
    q = tl.load(_rows(Qb, offs_m, stride_qt, offs_d), mask=qmask, other=0.0)
    do = tl.load(_rows(DOb, offs_m, stride_dot, offs_d), mask=qmask, other=0.0)
    if SCALE_Q:  # scaled q serves both S^T and dK
        q = _scaled(q, scale)
        st = _mm(k, tl.trans(q), DOT_PREC, UPCAST)  # [BN, BM] = S^T
    else:  # the loaded q feeds both dots as is; dK takes the scale at the end
        st = _mm(k, tl.trans(q), DOT_PREC, UPCAST) * scale
    at = _act(st, ACT, POLY, C1, C2, C3, C4, C5, C6, CLAMP)
    dpt = _mm(v, tl.trans(do), DOT_PREC, UPCAST)
    dst = dpt * _dact(st, ACT, POLY, C1, C2, C3, C4, C5, C6, CLAMP)
    if MASK:
        vis = tl.trans(_visible(offs_m, offs_n, doff, LEFT, RIGHT))
        at = tl.where(vis, at, 0.0)
        dst = tl.where(vis, dst, 0.0)  # act'(0) != 0: drop masked entries explicitly
    dv = _mma(at.to(do.dtype), do, dv, DOT_PREC, UPCAST)
    dk = _mma(dst.to(q.dtype), q, dk, DOT_PREC, UPCAST)
    return dk, dv


@triton.jit
def _dq_kv_tile(dq, q, do, Kb, Vb, n0, offs_m, offs_n0, lk, offs_d, d_ok, stride_kt, stride_vt, doff, LEFT, RIGHT,
                MASK: tl.constexpr, ACT: tl.constexpr, POLY: tl.constexpr, C1: tl.constexpr, C2: tl.constexpr,
                C3: tl.constexpr, C4: tl.constexpr, C5: tl.constexpr, C6: tl.constexpr, CLAMP: tl.constexpr,
                DOT_PREC: tl.constexpr, UPCAST: tl.constexpr):
    """dQ of one query tile += one key tile's share; MASK: the tile crosses the window edge."""
    offs_n = n0 + offs_n0
    k, v, _ = _load_kv(Kb, Vb, offs_n, lk, offs_d, d_ok, stride_kt, stride_vt)
    s = _mm(q, tl.trans(k), DOT_PREC, UPCAST)
    dp = _mm(do, tl.trans(v), DOT_PREC, UPCAST)
    ds = dp * _dact(s, ACT, POLY, C1, C2, C3, C4, C5, C6, CLAMP)
    if MASK:
        ds = tl.where(_visible(offs_m, offs_n, doff, LEFT, RIGHT), ds, 0.0)
    return _mma(ds.to(k.dtype), k, dq, DOT_PREC, UPCAST)


@triton.jit
def _bwd_dkdv_kernel(
    Q,
    K,
    V,
    DO,
    DK,
    DV,
    OFF_Q,
    OFF_K,
    WORK,
    stride_qt,
    stride_qh,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_dot,
    stride_doh,
    stride_dkt,
    stride_dkh,
    stride_dvt,
    stride_dvh,
    scale,
    out_scale,
    LEFT,
    RIGHT,
    max_len_bucket,
    NUM_HEADS,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    MASKED: tl.constexpr,
    ACT: tl.constexpr,
    POLY: tl.constexpr,
    C1: tl.constexpr,
    C2: tl.constexpr,
    C3: tl.constexpr,
    C4: tl.constexpr,
    C5: tl.constexpr,
    C6: tl.constexpr,
    CLAMP: tl.constexpr,
    DOT_PREC: tl.constexpr,
    UPCAST: tl.constexpr,
    SCALE_Q: tl.constexpr,
):
    b, tile, kvh = _work_item(WORK, NUM_HEADS)
    if b < 0:
        return
    n0 = tile * BLOCK_N
    q_start, lq, k_start, lk = _seq_bounds(OFF_Q, OFF_K, b)
    doff = lk - lq
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
    if MASKED:  # the mirror of the q tiles' runs: query i sees key j for j-doff-RIGHT <= i <= j-doff+LEFT
        t_a, t_b = _runs(n0, tl.minimum(n0 + BLOCK_N, lk) - 1, lo, nt, -doff, RIGHT, LEFT, BLOCK_M)
    for g in range(GROUP):
        head = kvh * GROUP + g
        Qb = Q + q_start * stride_qt + head * stride_qh
        DOb = DO + q_start * stride_dot + head * stride_doh
        for t in range(t_a):
            dk, dv = _dkdv_q_tile(dk, dv, k, v, Qb, DOb, lo + t * BLOCK_M, offs_n, lq, offs_d, d_ok, stride_qt,
                                  stride_dot, scale, doff, LEFT, RIGHT, BLOCK_M, True, ACT, POLY, C1, C2, C3, C4,
                                  C5, C6, CLAMP, DOT_PREC, UPCAST, SCALE_Q)
        for t in range(t_a, t_b):
            dk, dv = _dkdv_q_tile(dk, dv, k, v, Qb, DOb, lo + t * BLOCK_M, offs_n, lq, offs_d, d_ok, stride_qt,
                                  stride_dot, scale, doff, LEFT, RIGHT, BLOCK_M, False, ACT, POLY, C1, C2, C3, C4,
                                  C5, C6, CLAMP, DOT_PREC, UPCAST, SCALE_Q)
        for t in range(t_b, nt):
            dk, dv = _dkdv_q_tile(dk, dv, k, v, Qb, DOb, lo + t * BLOCK_M, offs_n, lq, offs_d, d_ok, stride_qt,
                                  stride_dot, scale, doff, LEFT, RIGHT, BLOCK_M, True, ACT, POLY, C1, C2, C3, C4,
                                  C5, C6, CLAMP, DOT_PREC, UPCAST, SCALE_Q)
    DKb = DK + k_start * stride_dkt + kvh * stride_dkh
    DVb = DV + k_start * stride_dvt + kvh * stride_dvh
    dk_scale = out_scale if SCALE_Q else out_scale * scale
    tl.store(_rows(DKb, offs_n, stride_dkt, offs_d), (dk * dk_scale).to(DK.dtype.element_ty), mask=kmask)
    tl.store(_rows(DVb, offs_n, stride_dvt, offs_d), (dv * out_scale).to(DV.dtype.element_ty), mask=kmask)


@triton.jit
def _bwd_dq_kernel(
    Q,
    K,
    V,
    DO,
    DQ,
    OFF_Q,
    OFF_K,
    WORK,
    stride_qt,
    stride_qh,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_dot,
    stride_doh,
    stride_dqt,
    stride_dqh,
    scale,
    out_scale,
    LEFT,
    RIGHT,
    max_len_bucket,
    NUM_HEADS,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    TILES: tl.constexpr,
    FLAT: tl.constexpr,
    MASKED: tl.constexpr,
    ACT: tl.constexpr,
    POLY: tl.constexpr,
    C1: tl.constexpr,
    C2: tl.constexpr,
    C3: tl.constexpr,
    C4: tl.constexpr,
    C5: tl.constexpr,
    C6: tl.constexpr,
    CLAMP: tl.constexpr,
    DOT_PREC: tl.constexpr,
    UPCAST: tl.constexpr,
):
    b, group_id, head = _work_item(WORK, NUM_HEADS)
    if b < 0:
        return
    q_start, lq, k_start, lk = _seq_bounds(OFF_Q, OFF_K, b)
    doff = lk - lq
    kvh = head // GROUP
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < HEAD_DIM
    offs_n0 = tl.arange(0, BLOCK_N)
    Qb = Q + q_start * stride_qt + head * stride_qh
    DOb = DO + q_start * stride_dot + head * stride_doh
    DQb = DQ + q_start * stride_dqt + head * stride_dqh
    Kb = K + k_start * stride_kt + kvh * stride_kh
    Vb = V + k_start * stride_vt + kvh * stride_vh
    tl.static_assert(FLAT or TILES == 1)  # the per-tile path below handles one q tile
    tl.static_assert(not (FLAT and MASKED))
    if FLAT:  # as the forward's fused loop: unmasked, the same K/V trip count for every q tile
        first = group_id * TILES
        n_tiles = tl.minimum(tl.cdiv(tl.maximum(lq - first * BLOCK_M, 0), BLOCK_M), TILES)
        nt = tl.cdiv(lk, BLOCK_N)
        for t in tl.range(n_tiles, flatten=True):
            q, offs_m, qmask = _q_tile(Qb, (first + t) * BLOCK_M, lq, offs_d, d_ok, stride_qt, scale, BLOCK_M, True)
            do = tl.load(_rows(DOb, offs_m, stride_dot, offs_d), mask=qmask, other=0.0)
            dq = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
            for j in range(nt):
                dq = _dq_kv_tile(dq, q, do, Kb, Vb, j * BLOCK_N, offs_m, offs_n0, lk, offs_d, d_ok, stride_kt,
                                 stride_vt, doff, LEFT, RIGHT, False, ACT, POLY, C1, C2, C3, C4, C5, C6, CLAMP,
                                 DOT_PREC, UPCAST)
            tl.store(_rows(DQb, offs_m, stride_dqt, offs_d), (dq * (scale * out_scale)).to(DQ.dtype.element_ty),
                     mask=qmask)
        return
    m0 = group_id * BLOCK_M
    q, offs_m, qmask = _q_tile(Qb, m0, lq, offs_d, d_ok, stride_qt, scale, BLOCK_M, True)
    do = tl.load(_rows(DOb, offs_m, stride_dot, offs_d), mask=qmask, other=0.0)
    dq = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    lo, nt, t_a, t_b = _key_runs(m0, lq, lk, doff, LEFT, RIGHT, MASKED, BLOCK_M, BLOCK_N)
    for t in range(t_a):
        dq = _dq_kv_tile(dq, q, do, Kb, Vb, lo + t * BLOCK_N, offs_m, offs_n0, lk, offs_d, d_ok, stride_kt,
                         stride_vt, doff, LEFT, RIGHT, True, ACT, POLY, C1, C2, C3, C4, C5, C6, CLAMP, DOT_PREC,
                         UPCAST)
    for t in range(t_a, t_b):
        dq = _dq_kv_tile(dq, q, do, Kb, Vb, lo + t * BLOCK_N, offs_m, offs_n0, lk, offs_d, d_ok, stride_kt,
                         stride_vt, doff, LEFT, RIGHT, False, ACT, POLY, C1, C2, C3, C4, C5, C6, CLAMP, DOT_PREC,
                         UPCAST)
    for t in range(t_b, nt):
        dq = _dq_kv_tile(dq, q, do, Kb, Vb, lo + t * BLOCK_N, offs_m, offs_n0, lk, offs_d, d_ok, stride_kt,
                         stride_vt, doff, LEFT, RIGHT, True, ACT, POLY, C1, C2, C3, C4, C5, C6, CLAMP, DOT_PREC,
                         UPCAST)
    tl.store(_rows(DQb, offs_m, stride_dqt, offs_d), (dq * (scale * out_scale)).to(DQ.dtype.element_ty), mask=qmask)


@triton.jit
def _bwd_short_kernel(
    Q,
    K,
    V,
    DO,
    DQ,
    DK,
    DV,
    OFF_Q,
    OFF_K,
    ORDER,
    stride_qt,
    stride_qh,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_dot,
    stride_doh,
    stride_dqt,
    stride_dqh,
    stride_dkt,
    stride_dkh,
    stride_dvt,
    stride_dvh,
    scale,
    out_scale,
    LEFT,
    RIGHT,
    max_len_bucket,
    NUM_KV_HEADS,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    MASKED: tl.constexpr,
    ACT: tl.constexpr,
    POLY: tl.constexpr,
    C1: tl.constexpr,
    C2: tl.constexpr,
    C3: tl.constexpr,
    C4: tl.constexpr,
    C5: tl.constexpr,
    C6: tl.constexpr,
    CLAMP: tl.constexpr,
    DOT_PREC: tl.constexpr,
    UPCAST: tl.constexpr,
    SCALE_Q: tl.constexpr,
    NARROW: tl.constexpr,
    KT: tl.constexpr,
):
    """Short K/V, one pass: a program owns one sequence's whole K/V (one tile) for one kv head, streams the
    sequence's q and dO tiles of every head in its group once, and writes dQ per tile and dK/dV at the end.
    5 matmuls per tile pair instead of the two-pass 7, and q/dO are read once. No atomics."""
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < HEAD_DIM
    b = tl.load(ORDER + tl.program_id(0) // NUM_KV_HEADS)
    kvh = tl.program_id(0) % NUM_KV_HEADS
    q_start, lq, k_start, lk = _seq_bounds(OFF_Q, OFF_K, b)
    doff = lk - lq
    Kb = K + k_start * stride_kt + kvh * stride_kh
    Vb = V + k_start * stride_vt + kvh * stride_vh
    DKb = DK + k_start * stride_dkt + kvh * stride_dkh
    DVb = DV + k_start * stride_dvt + kvh * stride_dvh
    # a sequence's keys take the narrowest of BLOCK_N, BLOCK_N / 2, BLOCK_N / 4 (>= 16) that holds them: the
    # dots, activations and dK/dV tiles shrink with it (K/V lengths vary within a batch)
    if NARROW and BLOCK_N >= 64:
        if lk <= BLOCK_N // 4:
            _bwd_short_item(Q, DO, DQ, Kb, Vb, DKb, DVb, q_start, lq, lk, doff, kvh, offs_d, d_ok, stride_qt, stride_qh,
                            stride_kt, stride_vt, stride_dot, stride_doh, stride_dqt, stride_dqh, stride_dkt,
                            stride_dvt, scale, out_scale, LEFT, RIGHT, GROUP, BLOCK_D, BLOCK_M, BLOCK_N // 4, MASKED,
                            ACT, POLY, C1, C2, C3, C4, C5, C6, CLAMP, DOT_PREC, UPCAST, SCALE_Q, KT)
        elif lk <= BLOCK_N // 2:
            _bwd_short_item(Q, DO, DQ, Kb, Vb, DKb, DVb, q_start, lq, lk, doff, kvh, offs_d, d_ok, stride_qt, stride_qh,
                            stride_kt, stride_vt, stride_dot, stride_doh, stride_dqt, stride_dqh, stride_dkt,
                            stride_dvt, scale, out_scale, LEFT, RIGHT, GROUP, BLOCK_D, BLOCK_M, BLOCK_N // 2, MASKED,
                            ACT, POLY, C1, C2, C3, C4, C5, C6, CLAMP, DOT_PREC, UPCAST, SCALE_Q, KT)
        else:
            _bwd_short_item(Q, DO, DQ, Kb, Vb, DKb, DVb, q_start, lq, lk, doff, kvh, offs_d, d_ok, stride_qt, stride_qh,
                            stride_kt, stride_vt, stride_dot, stride_doh, stride_dqt, stride_dqh, stride_dkt,
                            stride_dvt, scale, out_scale, LEFT, RIGHT, GROUP, BLOCK_D, BLOCK_M, BLOCK_N, MASKED, ACT,
                            POLY, C1, C2, C3, C4, C5, C6, CLAMP, DOT_PREC, UPCAST, SCALE_Q, KT)
    else:
        _bwd_short_item(Q, DO, DQ, Kb, Vb, DKb, DVb, q_start, lq, lk, doff, kvh, offs_d, d_ok, stride_qt, stride_qh,
                        stride_kt, stride_vt, stride_dot, stride_doh, stride_dqt, stride_dqh, stride_dkt, stride_dvt,
                        scale, out_scale, LEFT, RIGHT, GROUP, BLOCK_D, BLOCK_M, BLOCK_N, MASKED, ACT, POLY, C1, C2, C3,
                        C4, C5, C6, CLAMP, DOT_PREC, UPCAST, SCALE_Q, KT)


@triton.jit
def _bwd_short_item(Q, DO, DQ, Kb, Vb, DKb, DVb, q_start, lq, lk, doff, kvh, offs_d, d_ok, stride_qt, stride_qh,
                    stride_kt, stride_vt, stride_dot, stride_doh, stride_dqt, stride_dqh, stride_dkt, stride_dvt,
                    scale, out_scale, LEFT, RIGHT, GROUP: tl.constexpr, BLOCK_D: tl.constexpr,
                    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, MASKED: tl.constexpr, ACT: tl.constexpr,
                    POLY: tl.constexpr, C1: tl.constexpr, C2: tl.constexpr, C3: tl.constexpr, C4: tl.constexpr,
                    C5: tl.constexpr, C6: tl.constexpr, CLAMP: tl.constexpr, DOT_PREC: tl.constexpr,
                    UPCAST: tl.constexpr, SCALE_Q: tl.constexpr, KT: tl.constexpr):
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
            if SCALE_Q:
                q = _scaled(q, scale)
            # padded rows / keys give 0 and act(0) = 0; without SCALE_Q the loaded q feeds both dots as is and
            # dK takes the scale at the end
            if KT:
                s = _mm(k, tl.trans(q), DOT_PREC, UPCAST)  # S^T [BN, BM]
            else:
                s = _mm(q, tl.trans(k), DOT_PREC, UPCAST)  # [BM, BN]
            if not SCALE_Q:
                s = s * scale
            a = _act(s, ACT, POLY, C1, C2, C3, C4, C5, C6, CLAMP)
            if KT:
                ds = _mm(v, tl.trans(do), DOT_PREC, UPCAST)
            else:
                ds = _mm(do, tl.trans(v), DOT_PREC, UPCAST)
            ds = ds * _dact(s, ACT, POLY, C1, C2, C3, C4, C5, C6, CLAMP)
            if MASKED:  # act'(0) != 0: drop masked entries explicitly
                if KT:
                    vis = _visible_t(offs_n, offs_m, doff, LEFT, RIGHT)
                else:
                    vis = _visible(offs_m, offs_n, doff, LEFT, RIGHT)
                a = tl.where(vis, a, 0.0)
                ds = tl.where(vis, ds, 0.0)
            if KT:
                dv = _mma(a.to(do.dtype), do, dv, DOT_PREC, UPCAST)
                dk = _mma(ds.to(q.dtype), q, dk, DOT_PREC, UPCAST)
                dq = _mm(tl.trans(ds.to(k.dtype)), k, DOT_PREC, UPCAST)
            else:
                dv = _mma(tl.trans(a.to(do.dtype)), do, dv, DOT_PREC, UPCAST)
                dk = _mma(tl.trans(ds.to(q.dtype)), q, dk, DOT_PREC, UPCAST)
                dq = _mm(ds.to(k.dtype), k, DOT_PREC, UPCAST)
            tl.store(_rows(DQb, offs_m, stride_dqt, offs_d), (dq * (scale * out_scale)).to(DQ.dtype.element_ty),
                     mask=qmask)
    dk_scale = out_scale if SCALE_Q else out_scale * scale
    tl.store(_rows(DKb, offs_n, stride_dkt, offs_d), (dk * dk_scale).to(DKb.dtype.element_ty), mask=kmask)
    tl.store(_rows(DVb, offs_n, stride_dvt, offs_d), (dv * out_scale).to(DVb.dtype.element_ty), mask=kmask)


# --------------------------------------------------------------------------------------------- autotuning
def _configs(names: tuple[str, ...], values: list[tuple]) -> list[triton.Config]:
    return [triton.Config(dict(zip(names, v[:-2])), num_warps=v[-2], num_stages=v[-1]) for v in values]


_KEY = ["HEAD_DIM", "max_len_bucket", "ACT", "POLY", "MASKED"]
if triton_interpreting():
    _FWD_CFG = [triton.Config({}, num_warps=1, num_stages=1)]
    _LONG_CFG = _LONG_CFG_SMALL = _configs(("BLOCK_N",), [(16, 1, 1)])
    _DKDV_CFG = _configs(("BLOCK_M",), [(16, 1, 1)])
    _DQ_CFG = _DQ_CFG_SMALL = _configs(("BLOCK_N",), [(16, 1, 1)])
    _SHORT_BWD_CFG = _configs(("BLOCK_M", "KT"), [(16, False, 1, 1)])
else:  # a small space: each config costs a compile per key
    # (3- and 4-stage forms of the short-K/V q-tile loop were tried in session 16: cross M64 0.436 -> 0.435 ms; in
    # session 17, register caps (maxnreg 128 / 168 on the 4-warp candidates, 128 on an 8-warp dK/dV one): none won,
    # e.g. cross M64 forward 0.436 / 0.438 ms, one-pass backward 1.277 vs 0.990 ms; TMA loads and stores in the
    # forward: slower)
    # (a 3-stage 4-warp form again in session 19: cross M64 0.429 vs 0.402 ms)
    # one stage first: without a double-buffered q tile the program needs 48 KB of shared memory instead of 72
    # (64-row tiles, 64 keys), so four programs share an SM and hide each other's loads (cross M64 0.407 -> 0.363
    # ms; docs/PERF.md, session 20)
    _FWD_CFG = [triton.Config({}, num_warps=w, num_stages=s) for w, s in ((4, 1), (4, 2), (8, 1), (8, 2))]
    _LONG_CFG = _configs(("BLOCK_N",), [(n, 8, s) for n in (64, 128) for s in (2, 3)])
    # q tiles of at most 64 rows: one warpgroup (an 8-warp program would split a 64-row wgmma tile), so two or
    # three programs share an SM and hide each other's load and activation latency
    _LONG_CFG_SMALL = _configs(("BLOCK_N",), [(64, 4, 2), (64, 4, 3), (128, 4, 2)])
    # spill-free first (ptxas: 32-row tiles on 8 warps; the 4-warp ones spill 24-272 bytes per thread at some
    # shapes). The 3-stage 4-warp tiles, after the one-pass backward's: H200 cross M128 tuner ms (session 19):
    # (32, 4, 3) 0.575, (16, 4, 3) 0.684, (64, 4, 2) 0.700, (32, 4, 2) 0.770, (32, 8, 3) 1.192; in the dQ pass a
    # 3-stage (32, 4, 3) lost, 0.838 vs (32, 4, 2) 0.745, and was dropped
    _DKDV_CFG = _configs(("BLOCK_M",), [(32, 8, 2), (32, 8, 3), (64, 8, 2), (32, 4, 2), (64, 4, 2), (32, 4, 3),
                                        (16, 4, 3)])
    _DQ_CFG = _configs(("BLOCK_N",), [(n, 8, 2) for n in (32, 64)])
    _DQ_CFG_SMALL = _configs(("BLOCK_N",), [(32, 4, 2), (64, 4, 2), (64, 4, 3)])  # q tiles of <= 64 rows
    # 3-stage 4-warp tiles first: two programs per SM, each with the next tiles' q/dO loads in flight (H200, cross
    # M64, tuner ms: (32, 4, 3) 0.773, (32, 4, 4) 0.776 (dropped: a tie that spills), (32, 4, 2) 0.891, (32, 8, 2)
    # 1.561; session 18)
    # keys-major scores (KT) on the 3-stage 4-warp tile first (H200, cross M64, tuner ms: (32, KT, 4, 3) 0.724,
    # (32, 4, 3) 0.774, (64, KT, 4, 2) 0.827, (16, 4, 3) 0.837, (16, KT, 4, 3) 0.860; (64, KT, 4, 3) 1.190 and
    # (32, KT, 8, 3) 1.313 were dropped; session 19). At D 128, 128-key tiles stay two-pass: one pass on 8-warp
    # keys-major tiles took 1.330-1.649 ms at cross M128 against 0.575 + 0.740 for the two passes (session 19)
    _SHORT_BWD_CFG = _configs(("BLOCK_M", "KT"), [(32, True, 4, 3), (32, False, 4, 3), (64, True, 4, 2),
                                                   (16, False, 4, 3), (16, True, 4, 3), (32, False, 4, 2),
                                                   (16, False, 4, 2), (32, False, 8, 3), (64, False, 8, 2),
                                                   (32, False, 8, 2)])
# every autotuned kernel's full config list (a GPU test runs each config, as autotuning may pick any of them)
ALL_CONFIGS = {"_fwd_short": _FWD_CFG, "_fwd_long": _LONG_CFG, "_fwd_long_small": _LONG_CFG_SMALL,
               "_bwd_dkdv": _DKDV_CFG, "_bwd_dq": _DQ_CFG, "_bwd_dq_small": _DQ_CFG_SMALL, "_bwd_short": _SHORT_BWD_CFG}
if not triton_interpreting() and os.environ.get("GEM_GDPA_AUTOTUNE", "1") == "0":
    # first config only: fast compiles (GPU tests)
    _FWD_CFG, _LONG_CFG, _LONG_CFG_SMALL, _DKDV_CFG, _DQ_CFG, _DQ_CFG_SMALL, _SHORT_BWD_CFG = (
        c[:1] for c in (_FWD_CFG, _LONG_CFG, _LONG_CFG_SMALL, _DKDV_CFG, _DQ_CFG, _DQ_CFG_SMALL, _SHORT_BWD_CFG))

_fwd_short = triton.autotune(_FWD_CFG, key=_KEY + ["SHORT_KV", "BLOCK_N", "TILES", "BLOCK_M", "NARROW", "FWD_SCALE_Q"])(
    _fwd_kernel)
_fwd_long = triton.autotune(_LONG_CFG, key=_KEY + ["SHORT_KV", "TILES", "BLOCK_M", "FLAT"])(_fwd_kernel)
_fwd_long_small = triton.autotune(_LONG_CFG_SMALL, key=_KEY + ["SHORT_KV", "TILES", "BLOCK_M", "FLAT"])(_fwd_kernel)
_bwd_dkdv = triton.autotune(_DKDV_CFG, key=_KEY + ["GROUP", "SCALE_Q"])(_bwd_dkdv_kernel)
_bwd_dq = triton.autotune(_DQ_CFG, key=_KEY + ["TILES", "FLAT", "BLOCK_M"])(_bwd_dq_kernel)
_bwd_dq_small = triton.autotune(_DQ_CFG_SMALL, key=_KEY + ["TILES", "FLAT", "BLOCK_M"])(_bwd_dq_kernel)
# the kernel writes DQ, DK, DV fully: a timed config cannot corrupt anything the next one reads
_bwd_short = triton.autotune(_SHORT_BWD_CFG, key=_KEY + ["GROUP", "BLOCK_N", "SCALE_Q", "NARROW"])(_bwd_short_kernel)


# ------------------------------------------------------------------------------------------------- host side
def _blocks(d: int) -> tuple[int, int]:
    """(base q tile height, BLOCK_N of the k-tiled dK/dV pass); fixed since the work tables use them. The
    q-tiled passes take their heights from _fwd_block_m / _dq_block_m (64 rows at D > 64).

    The dK/dV program holds two fp32 [BLOCK_N, D] accumulators plus K and V in registers: 64 keys at D > 64.
    """
    if triton_interpreting():
        return 16, 16
    return 128, (64 if d > 64 else 128)


def _dq_block_m(d: int) -> int:
    """The dQ pass's q tile height, or GEM_GDPA_DQ_BLOCK_M (16..128, a power of two) to time others.

    At D > 64, 64 rows on one warpgroup (_DQ_CFG_SMALL): cross M256 1.526 -> 1.278 ms, self N2048 0.918 -> 0.857
    (H200, session 13)."""
    env = os.environ.get("GEM_GDPA_DQ_BLOCK_M")
    if not env:
        rows = _blocks(d)[0]
        return min(rows, 64) if d > 64 else rows
    if env not in ("16", "32", "64", "128"):
        raise ValueError(f"GEM_GDPA_DQ_BLOCK_M={env!r}: expected 16, 32, 64 or 128")
    return int(env)


def _fwd_block_m(d: int, kv_tile: int = 0) -> int:
    """The forward's q tile height, or GEM_GDPA_FWD_BLOCK_M (16..128, a power of two) to time others.

    A 128-row tile at D 128 holds a 64 KB fp32 accumulator: one program per SM. On the short-K/V path with up to
    64 keys (kv_tile), 64-row tiles were faster on the H200 (cross N256 M64: 0.49 vs 0.58 ms, and 0.61 vs 0.68 in
    the session before; docs/PERF.md). The tiled path (kv_tile 0) at D > 64 takes 64-row tiles on one warpgroup
    (_LONG_CFG_SMALL), two or three programs per SM: cross M256 1.128 -> 1.009 ms, self N2048 0.695 -> 0.625
    (session 13; on 8 warps, session 10, the same tile had been slower: 1.77 vs 1.23).
    """
    env = os.environ.get("GEM_GDPA_FWD_BLOCK_M")
    if not env:
        rows = _blocks(d)[0]
        return min(rows, 64) if 0 < kv_tile <= 64 or (kv_tile == 0 and d > 64) else rows
    if env not in ("16", "32", "64", "128"):
        raise ValueError(f"GEM_GDPA_FWD_BLOCK_M={env!r}: expected 16, 32, 64 or 128")
    return int(env)


def _tiles_per_program(t: int, block_m: int, h: int, n_seq: int, max_len_q: int, device) -> int:
    """q tiles per program (1..8, a power of two): enough to amortise each program's setup while keeping >= ~4
    waves of programs, and no more than the longest sequence has (the extra ones would only be skipped)."""
    est_tiles = (t // block_m + n_seq) * h
    tiles = 1
    while tiles < 8 and tiles * block_m < max_len_q and est_tiles // (2 * tiles) >= 4 * _num_sms(device):
        tiles *= 2
    return tiles


# the fused loops only pay where each q tile's key loop is short (H200, session 13, 128-row tiles: cross M256
# forward 1.235 -> 1.128 ms and dQ 1.542 -> 1.452 with 8 tiles; self N2048, keys up to 2048: forward even, dQ
# 0.915 -> 1.043; 64-row tiles: forward 1.035 -> 1.009, dQ 1.278 -> 1.307, so the dQ pass fuses only on request)
FUSED_MAX_LEN_K = 256


def _flat_knob() -> int | None:
    """GEM_GDPA_FLAT: None when unset or empty, else the q tiles per program of the fused loops (0 = off)."""
    env = os.environ.get("GEM_GDPA_FLAT", "")
    if not env:
        return None
    if env not in ("0", "1", "2", "4", "8", "16"):
        raise ValueError(f"GEM_GDPA_FLAT={env!r}: expected 0, 1, 2, 4, 8 or 16")
    return int(env)


def _fused_tiles(t: int, block_m: int, h: int, n_seq: int, max_len_q: int, max_len_k: int, device,
                 default_on: bool) -> int:
    """q tiles per program of an unmasked long-K/V q-tiled pass run as one fused (q tile, K/V tile) loop; 0: one q
    tile per program, no fused loop. GEM_GDPA_FLAT (0, 1, 2, 4, 8, 16) sets it for the forward and the dQ pass;
    unset, the forward (default_on) fuses up to FUSED_MAX_LEN_K keys and the dQ pass does not fuse.

    The next tile's first K/V loads overlap this tile's last, where one tile per program exposes them: a key loop
    of 1-4 tiles never reaches a steady state.
    """
    knob = _flat_knob()
    if knob is not None:
        return knob
    if not default_on or max_len_k > FUSED_MAX_LEN_K:
        return 0
    tiles = _tiles_per_program(t, block_m, h, n_seq, max_len_q, device)
    return tiles if tiles > 1 else 0


def _narrow() -> bool:
    """GEM_GDPA_NARROW=0 keeps every sequence of the short-K/V kernels (forward and one-pass backward) on the full
    K/V tile of BLOCK_N keys; by default, where BLOCK_N >= 64, a sequence with at most BLOCK_N / 2 or BLOCK_N / 4
    keys takes that narrower tile."""
    env = os.environ.get("GEM_GDPA_NARROW", "")
    if env not in ("", "0", "1"):
        raise ValueError(f"GEM_GDPA_NARROW={env!r}: expected 0 or 1")
    return env != "0"


def _fwd_scale_q() -> bool:
    """GEM_GDPA_FWD_SCALE_Q=1: the short-K/V forward scales each loaded q tile before its dot (the older form, kept
    to time against); by default it scales S, so the loaded tile feeds the dot unchanged (H200: cross M64 0.421 ->
    0.400 ms, M128 0.698 -> 0.637). The tiled forward always scales q: scaling S there was mixed (M256 3% slower,
    self N512 and N2048 3-4% faster) and one of its fused-loop configs computed wrong outputs on the H200 (session
    17)."""
    env = os.environ.get("GEM_GDPA_FWD_SCALE_Q", "")
    if env not in ("", "0", "1"):
        raise ValueError(f"GEM_GDPA_FWD_SCALE_Q={env!r}: expected 0 or 1")
    return env == "1"


def _bwd_scale_q() -> bool:
    """GEM_GDPA_BWD_SCALE_Q=1: the dK/dV passes scale each loaded q tile before its dots (the old form, kept to time
    against); by default they scale S and dK instead, so the loaded q feeds both dots unchanged."""
    env = os.environ.get("GEM_GDPA_BWD_SCALE_Q", "")
    if env not in ("", "0", "1"):
        raise ValueError(f"GEM_GDPA_BWD_SCALE_Q={env!r}: expected 0 or 1")
    return env == "1"


def _consts(activation: str, approx: str, tanh: bool = False) -> dict:
    if approx:
        p = POLY6[activation]
        c = dict(zip(("C1", "C2", "C3", "C4", "C5", "C6"), p.coef))
        return dict(ACT=ACTIVATIONS.index(activation), POLY=True, CLAMP=p.clamp, **c)
    return {
        "ACT": ACT_TANH_FORM[activation] if tanh else ACTIVATIONS.index(activation),
        "POLY": False,
        "CLAMP": 0.0,
        "C1": 0.0,
        "C2": 0.0,
        "C3": 0.0,
        "C4": 0.0,
        "C5": 0.0,
        "C6": 0.0,
    }


def _span(pos, block, len_a, len_b, lo_off, hi_off):
    """Number of visible partner positions for tiles starting at pos (clamped window, >= 0)."""
    lo = torch.zeros_like(pos) if lo_off is None else (pos + lo_off).clamp_min(0)
    hi = len_b.expand_as(pos) if hi_off is None else torch.minimum(pos + block + hi_off, len_b.expand_as(pos))
    return (hi - lo).clamp_min(0)


def work_table(
    len_a: torch.Tensor,
    len_b: torch.Tensor,
    max_len_a: int,
    rows: int,
    left: int,
    right: int,
    ordered: bool,
    transpose: bool = False,
    total: int | None = None,
    order: str = "seq",
) -> torch.Tensor:
    """int32 [n, 2] (sequence, tile) over tiles of `rows` rows of side a; no host sync.

    Tiles past a sequence's end are marked -1 and moved last (they exit at once). ordered, with cost = rows x
    visible partners: order "seq" runs the costliest sequences first, each sequence's tiles adjacent (costliest
    first), so the programs in flight share their sequences' K/V (or Q/dO) in L2; order "tile" runs the costliest
    tiles of all sequences first. Not ordered: sequence-major order.
    transpose: side a is the keys (the dK/dV pass), so the window is mirrored.
    total: side a's token count (a host int); since sum(ceil(L / rows)) < total / rows + B, the table is cut
    there, so a batch of many short sequences and one long one launches no grid of B x max tiles.
    """
    nb = len_a.numel()
    nt = -(-max_len_a // rows) if max_len_a > 0 else 0
    if nb == 0 or nt == 0:
        return torch.full((1, 2), -1, dtype=torch.int32, device=len_a.device)
    la = len_a.to(torch.int64)[:, None]
    lb = len_b.to(torch.int64)[:, None]
    tile = torch.arange(nt, device=len_a.device, dtype=torch.int64)[None, :].expand(nb, nt)
    seq = torch.arange(nb, device=len_a.device, dtype=torch.int64)[:, None].expand(nb, nt)
    pos = tile * rows
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
        cost = torch.minimum(la - pos, torch.full_like(pos, rows)) * _span(pos, rows, la, lb, lo_off, hi_off)
        key = torch.where(valid, cost, -1)
    else:
        key = valid.to(torch.int64)
    perm = torch.argsort(key.flatten(), descending=True, stable=True)
    if ordered and order == "seq":  # then stably by sequence rank (costliest first); empty tiles last
        seq_rank = torch.empty(nb, dtype=torch.int64, device=len_a.device)
        seq_rank[torch.argsort(key.clamp_min(0).sum(1), descending=True, stable=True)] = torch.arange(
            nb, device=len_a.device)
        group = torch.where(valid, seq_rank[:, None], nb).flatten()[perm]
        perm = perm[torch.argsort(group, stable=True)]
    if total is not None:
        perm = perm[: max(1, min(nb * nt, total // rows + nb))]
    table = torch.stack((torch.where(valid, seq, -1), tile), -1).flatten(0, 1)[perm]
    return table.to(torch.int32).contiguous()


def _table(offsets_a, offsets_b, max_len_a, rows, left, right, ordered, transpose, total):
    """work_table of one pass, built once per offsets pair (gem.ops._common.offsets_cached): the layers of a
    model and the backward reuse it, so a call launches its kernel alone (GEM_GDPA_WORK_CACHE=0: rebuild)."""
    order = work_order()

    def build():
        la = offsets_a[1:] - offsets_a[:-1]
        lb = offsets_b[1:] - offsets_b[:-1]
        return work_table(la, lb, max_len_a, rows, left, right, ordered, transpose=transpose, total=total,
                          order=order)

    return offsets_cached("_gem_gdpa_work", "GEM_GDPA_WORK_CACHE", offsets_a, offsets_b,
                          (max_len_a, rows, left, right, ordered, transpose, total, order), build)


def work_order() -> str:
    """GEM_GDPA_ORDER: "seq" (default) or "tile", the order of ordered work tables (see work_table)."""
    order = os.environ.get("GEM_GDPA_ORDER", "seq")
    if order not in ("seq", "tile"):
        raise ValueError(f"GEM_GDPA_ORDER={order!r}: expected 'seq' or 'tile'")
    return order


def _num_sms(device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 4


def _bucket(n: int) -> int:
    return max(16, next_pow2(max(n, 1)))


def _prec(dtype) -> str:
    return "ieee" if dtype == torch.float32 else "tf32"


def _common(q, k, left, right, activation, approx) -> dict:
    """Constexprs shared by the forward and both backward kernels."""
    return dict(
        GROUP=q.shape[1] // k.shape[1],
        HEAD_DIM=q.shape[2],
        BLOCK_D=_bucket(q.shape[2]),
        MASKED=left >= 0 or right >= 0,
        DOT_PREC=_prec(q.dtype),
        UPCAST=triton_interpreting() and q.dtype == torch.bfloat16,
        **_consts(activation, approx, tanh_form(activation, approx, q.dtype)),
    )


def _launch_args(tensors, offsets_q, offsets_k, table, scale, out_scale, left, right, max_len, heads) -> tuple:
    """The kernels' runtime arguments: tensors, offsets, work table, (token, head) strides of each tensor, scalars."""
    strides = [s for x in tensors for s in (x.stride(0), x.stride(1))]
    return (*tensors, offsets_q, offsets_k, table, *strides, scale, out_scale, left, right, _bucket(max_len), heads)


# Triton's Autotuner.run rebuilds its key on every call from every argument, scanning the list of argument names
# once per argument: ~50 us a launch at GDPA's ~60 arguments (timed on a CPU host; a whole GDPA launch took ~150 us
# on an H200 host, session 18). After a key's first call, the config the tuner chose is launched here directly.
_PICKED: dict = {}


def _launch(tuned, grid: tuple, args: tuple, kwargs: dict) -> None:
    """tuned[grid](*args, **kwargs) for a triton.autotune kernel whose runtime arguments come from _launch_args.

    Our key holds what the tuner's key reads (the constexprs, max_len_bucket = args[-2], every tensor's dtype) and
    more (every constexpr). A hit also needs the tuner's configs list to be the one the pick came from (the
    every-config test and compile_check swap it) and, with several configs, the tuner's cache to still map the
    tuner's own key (computed once, on the miss) to that pick: a cleared cache tunes again."""
    configs = tuned.configs
    # the tuner itself, not its id: the entry keeps it alive, so no later object can take its id
    key = (tuned, args[-2], tuple(kwargs.items()), tuple(a.dtype for a in args if isinstance(a, torch.Tensor)))
    hit = _PICKED.get(key)
    if hit is not None and hit[0] is configs and (len(configs) == 1 or tuned.cache.get(hit[1]) is hit[2]):
        tuned.fn[grid](*args, **kwargs, **hit[3])
        return
    tuned[grid](*args, **kwargs)
    best = getattr(tuned, "best_config", None)
    if best is not None and best.pre_hook is None:  # a pre_hook would have to run before every launch
        _PICKED[key] = (configs, _tuner_key(tuned, args, kwargs), best, best.all_kwargs())


def _tuner_key(tuned, args: tuple, kwargs: dict) -> tuple:
    """The key triton's Autotuner.run files its pick under: the key arguments' values, then every tensor argument's
    dtype as a string, in argument order."""
    names = tuned.arg_names
    given = {**dict(zip(names, args)), **{k: v for k, v in kwargs.items() if k in names}}
    key = [given[k] for k in tuned.keys if k in given]
    key += [str(v.dtype) for v in given.values() if hasattr(v, "dtype")]
    return tuple(key)


# ------------------------------------------------------------------------------------ custom ops + autograd
# _gdpa_fwd / _gdpa_bwd do the work; the custom ops wrap them for torch.compile, _GdpaFn for eager calls.
def _gdpa_fwd(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    offsets_q: torch.Tensor,
    offsets_k: torch.Tensor,
    max_len_q: int,
    max_len_k: int,
    activation: str,
    approx: str,
    left: int,
    right: int,
    scale: float,
    out_scale: float,
    ordered: bool,
    short_kv: int,
) -> torch.Tensor:
    _flat_knob()  # a bad value fails every call, not only those that would fuse
    narrow, scale_q = _narrow(), _fwd_scale_q()
    q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
    t, h, d = q.shape
    if t == 0 or max_len_q == 0 or h == 0:
        return torch.zeros_like(q)
    out = _empty_like(q)  # every row lies in some work item's tiles, so the kernel writes it
    kv_tile = _bucket(max_len_k)
    use_short = (kv_tile <= SHORT_KV_MAX and kv_tile * _bucket(d) <= SHORT_KV_ELEMS) if short_kv < 0 else bool(short_kv)
    block_m = _fwd_block_m(d, kv_tile if use_short else 0)
    tiles = 1
    flat = False
    if use_short:  # the K/V load is amortised over the program's q tiles
        tiles = _tiles_per_program(t, block_m, h, offsets_q.numel() - 1, max_len_q, q.device)
    elif left < 0 and right < 0:
        fused = _fused_tiles(t, block_m, h, offsets_q.numel() - 1, max_len_q, max_len_k, q.device, True)
        tiles, flat = max(fused, 1), fused > 0
    table = _table(offsets_q, offsets_k, max_len_q, block_m * tiles, left, right, ordered, False, t)
    common = dict(BLOCK_M=block_m, TILES=tiles, **_common(q, k, left, right, activation, approx))
    args = _launch_args((q, k, v, out), offsets_q, offsets_k, table, scale, out_scale, left, right, max_len_k, h)
    grid = (table.shape[0] * h,)
    if use_short:
        _launch(_fwd_short, grid, args, dict(BLOCK_N=kv_tile, SHORT_KV=True, FLAT=False, NARROW=narrow,
                                             FWD_SCALE_Q=scale_q, **common))
    else:
        _launch(_fwd_long_small if block_m <= 64 else _fwd_long, grid, args,
                dict(SHORT_KV=False, FLAT=flat, NARROW=False, FWD_SCALE_Q=True, **common))
    return out


# the custom op wraps the annotated function itself (its schema comes from the annotations)
gdpa_fwd_op = torch.library.custom_op("gem::gdpa_fwd", _gdpa_fwd, mutates_args=())


@gdpa_fwd_op.register_fake
def _(q, *args):
    return torch.empty_like(q)


def _gdpa_bwd(
    do: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    offsets_q: torch.Tensor,
    offsets_k: torch.Tensor,
    max_len_q: int,
    max_len_k: int,
    activation: str,
    approx: str,
    left: int,
    right: int,
    scale: float,
    out_scale: float,
    ordered: bool,
    short_kv: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    _flat_knob()
    _bwd_scale_q()  # knobs are checked on every call, also where no kernel reads them
    _narrow()
    q, k, v, do = q.contiguous(), k.contiguous(), v.contiguous(), do.contiguous()
    t, h, d = q.shape
    if h == 0 or (max_len_q == 0 and max_len_k == 0):
        return torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
    kv_tile = _bucket(max_len_k)
    fits = kv_tile <= 128 and kv_tile * _bucket(d) <= SHORT_BWD_ELEMS
    # by default only with a wave of programs at least: one program walks a whole sequence's q tiles
    wide = (offsets_q.numel() - 1) * k.shape[1] >= _num_sms(q.device)
    if (fits and wide if short_kv < 0 else bool(short_kv) and fits) and offsets_q.numel() > 1:
        return _gdpa_bwd_short(do, q, k, v, offsets_q, offsets_k, max_len_k, activation, approx, left, right,
                               scale, out_scale, ordered)
    # every row lies in some work item's tiles (a sequence with no partners stores zeros), so no memset
    dq = _empty_like(q) if t and max_len_q > 0 else torch.zeros_like(q)
    dk = _empty_like(k) if k.shape[0] and max_len_k > 0 else torch.zeros_like(k)
    dv = _empty_like(v) if k.shape[0] and max_len_k > 0 else torch.zeros_like(v)
    block_n = _blocks(d)[1]
    common = _common(q, k, left, right, activation, approx)
    if k.shape[0] and max_len_k > 0:
        ktab = _table(offsets_k, offsets_q, max_len_k, block_n, left, right, ordered, True, k.shape[0])
        args = _launch_args(
            (q, k, v, do, dk, dv), offsets_q, offsets_k, ktab, scale, out_scale, left, right, max_len_q, k.shape[1]
        )
        _launch(_bwd_dkdv, (ktab.shape[0] * k.shape[1],), args,
                dict(BLOCK_N=block_n, SCALE_Q=_bwd_scale_q(), **common))
    if t and max_len_q > 0:
        block_m = _dq_block_m(d)
        # no fused loop unless GEM_GDPA_FLAT asks: with 64-row tiles it was slower (cross M256: 1.307 vs 1.278 ms)
        tiles = 0 if common["MASKED"] else _fused_tiles(t, block_m, h, offsets_q.numel() - 1, max_len_q,
                                                         max_len_k, q.device, False)
        qtab = _table(offsets_q, offsets_k, max_len_q, block_m * max(tiles, 1), left, right, ordered, False, t)
        args = _launch_args((q, k, v, do, dq), offsets_q, offsets_k, qtab, scale, out_scale, left, right, max_len_k, h)
        _launch(_bwd_dq_small if block_m <= 64 else _bwd_dq, (qtab.shape[0] * h,), args,
                dict(BLOCK_M=block_m, TILES=max(tiles, 1), FLAT=tiles > 0, **common))
    return dq, dk, dv


def _gdpa_bwd_short(do, q, k, v, offsets_q, offsets_k, max_len_k, activation, approx, left, right, scale, out_scale,
                    ordered):
    """The one-pass backward (_bwd_short_kernel): one program per (sequence, kv head), longest q first."""
    dq, dk, dv = _empty_like(q), _empty_like(k), _empty_like(v)  # every row is written
    nb = offsets_q.numel() - 1

    def order():
        if not ordered:
            return torch.arange(nb, dtype=torch.int32, device=q.device)
        lq = offsets_q[1:] - offsets_q[:-1]
        return torch.argsort(lq, descending=True, stable=True).to(torch.int32)

    table = offsets_cached("_gem_gdpa_work", "GEM_GDPA_WORK_CACHE", offsets_q, offsets_k, ("short bwd", ordered),
                           order)
    common = _common(q, k, left, right, activation, approx)
    args = _launch_args((q, k, v, do, dq, dk, dv), offsets_q, offsets_k, table, scale, out_scale, left, right,
                        max_len_k, k.shape[1])
    _launch(_bwd_short, (nb * k.shape[1],), args,
            dict(BLOCK_N=_bucket(max_len_k), SCALE_Q=_bwd_scale_q(), NARROW=_narrow(), **common))
    return dq, dk, dv


gdpa_bwd_op = torch.library.custom_op("gem::gdpa_bwd", _gdpa_bwd, mutates_args=())


@gdpa_bwd_op.register_fake
def _(do, q, k, v, *args):
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


def _setup(ctx, inputs, output):
    q, k, v, offsets_q, offsets_k, *rest = inputs
    ctx.save_for_backward(q, k, v, offsets_q, offsets_k)
    ctx.rest = rest


def _backward(ctx, do):
    dq, dk, dv = gdpa_bwd_op(do, *ctx.saved_tensors, *ctx.rest)
    return (dq, dk, dv) + (None,) * 12  # nothing for offsets, lengths and the constants


gdpa_fwd_op.register_autograd(_backward, setup_context=_setup)

class _GdpaFn(torch.autograd.Function):
    """Eager path: the custom op's kernels without its per-call dispatch overhead (see triton_jfa._JfaFn)."""

    @staticmethod
    def forward(ctx, q, k, v, offsets_q, offsets_k, *rest):
        with eager_tables():
            out = _gdpa_fwd(q, k, v, offsets_q, offsets_k, *rest)
        ctx.save_for_backward(q, k, v, offsets_q, offsets_k)
        ctx.rest = rest
        return out

    @staticmethod
    def backward(ctx, do):
        with eager_tables():
            dq, dk, dv = _gdpa_bwd(do, *ctx.saved_tensors, *ctx.rest)
        return (dq, dk, dv) + (None,) * 12


def gdpa_op(q, k, v, offsets_q, offsets_k, *rest):
    """The differentiable entry point gdpa() calls: the custom op while torch.compile traces, else _GdpaFn."""
    if torch.compiler.is_compiling():
        return gdpa_fwd_op(q, k, v, offsets_q, offsets_k, *rest)
    return _GdpaFn.apply(q, k, v, offsets_q, offsets_k, *rest)
