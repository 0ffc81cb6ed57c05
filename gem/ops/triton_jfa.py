"""Triton kernels for jagged softmax attention (forward, backward preprocess, dK/dV, dQ).

Scheme (see gem/ops/jfa.py for the mask semantics):
- Work items: one program per (q tile, head) in the forward and dQ pass, per (k tile, kv head) in the dK/dV
  pass. A work table of (sequence, tile) rows maps program -> item, the heaviest sequences first, each sequence's
  tiles adjacent in index order, so the programs in flight share K/V in L2 (gem.ops.triton_utils).
- Each program visits only the tiles that intersect its window, split in three runs: a masked run on the left
  window edge, a run of fully visible tiles with no per-element select, and a masked run on the right edge
  (the causal diagonal).
- Subtraction masking ("sub"): out-of-sequence rows load as zeros, so their scores are exactly 0; the forward
  subtracts n_masked * 2^(0 - m) from the row sum at the end instead of writing -inf. When that would cancel
  (real scores far below 0, so the masked zeros dominate the sum) the program recomputes with -inf masking.
  In the backward, out-of-sequence queries load lse = +inf so their probabilities are exactly 0.
- Softmax in base 2 with log2(e) folded into the scale; lse is stored in natural log, [H, Tq] fp32.
- Backward is deterministic: dK/dV accumulate in registers over the q tiles and the q heads of the GQA group;
  dQ is a separate pass. No atomics.
- The forward loads K/V tiles through per-sequence TMA descriptors where the tensors allow it (_tma_ok), else
  through pointers. The backward has two forms (_bwd_form): "delta_pre" for long rows with no left window (delta
  from a preprocessing kernel, dK/dV pass first, K/V loaded transposed) and "fused_delta" elsewhere (the forward's
  loads, delta fused into the dQ pass, which runs first, lean masks on edge tiles, TMA loads at D 128).
"""

from __future__ import annotations

import functools
from typing import Optional

import torch
import triton
import triton.language as tl

from gem.ops import triton_utils as tu
from gem.ops._common import cdiv, triton_interpreting
from gem.ops._register import KernelOp
from gem.ops._tune import ConfigTuner, LaunchConfig, attention_pass_smem, tile_config

LOG2E = 1.4426950408889634

# ----------------------------------------------------------------------------------------------- helpers


@triton.jit
def _vis(rows, cols, shift, Lq, Lk, win_left, win_right, HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr):
    """[len(rows), len(cols)] visibility: in-sequence and inside the (bottom-right aligned) window."""
    m = (rows[:, None] < Lq) & (cols[None, :] < Lk)
    return tu.window_mask(m, rows[:, None] + shift, cols[None, :], win_left, win_right, HAS_LEFT, HAS_RIGHT)


@triton.jit
def _vis_t(rows, cols, shift, Lq, Lk, win_left, win_right, HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr):
    """Transposed _vis: [len(cols), len(rows)]."""
    m = (rows[None, :] < Lq) & (cols[:, None] < Lk)
    return tu.window_mask(m, rows[None, :] + shift, cols[:, None], win_left, win_right, HAS_LEFT, HAS_RIGHT)


@triton.jit
def _work_item(WORK, w, NT):
    """Row w of a work table ((sequence, tile) int32 pairs, gem.ops.triton_utils) as b * NT + tile, or -1."""
    b = tl.load(WORK + 2 * w)
    return tl.where(b < 0, -1, b * NT + tl.load(WORK + 2 * w + 1))


@triton.jit
def _program_item(WORK, NT, H_GRID: tl.constexpr, FLAT: tl.constexpr):
    """(work item, head) of this program: a flat item-major grid (every head of a work item adjacent, in the work
    table's order) or a (item, head) grid."""
    if FLAT:
        return _work_item(WORK, tl.program_id(0) // H_GRID, NT), tl.program_id(0) % H_GRID
    return _work_item(WORK, tl.program_id(0), NT), tl.program_id(1)


@triton.jit
def _seq_bounds(OFF_Q, OFF_K, b):
    """(q_start, Lq, k_start, Lk) of sequence b."""
    q_start = tl.load(OFF_Q + b).to(tl.int32)
    k_start = tl.load(OFF_K + b).to(tl.int32)
    q_len = tl.load(OFF_Q + b + 1).to(tl.int32) - q_start
    return q_start, q_len, k_start, tl.load(OFF_K + b + 1).to(tl.int32) - k_start


@triton.jit
def _q_item(OFF_Q, OFF_K, item, h, NT, GROUP: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
            HEAD_D: tl.constexpr):
    """A (q tile, head) work item: its first row, its sequence's bounds, kv head and tile offsets."""
    b = item // NT
    m0 = (item % NT) * BLOCK_M
    q_start, Lq, k_start, Lk = _seq_bounds(OFF_Q, OFF_K, b)
    shift = Lk - Lq
    kvh = h // GROUP
    offs_m = m0 + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, HEAD_D)
    in_q = offs_m < Lq
    return m0, q_start, Lq, k_start, Lk, shift, kvh, offs_m, offs_n, offs_d, in_q


@triton.jit
def _kv_bases(K, V, k_start, kvh, stride_kt, stride_kh, stride_vt, stride_vh):
    """Pointers to one sequence's K and V rows of kv head kvh."""
    return (K + k_start.to(tl.int64) * stride_kt + kvh * stride_kh,
            V + k_start.to(tl.int64) * stride_vt + kvh * stride_vh)


@triton.jit
def _kv_descs(k_base, v_base, Lk, stride_kt, stride_vt, BLOCK_N: tl.constexpr, HEAD_D: tl.constexpr):
    """TMA descriptors of one sequence's K and V rows: rows >= Lk come back as zeros (the subtraction scheme's
    masked rows). Lk = 0 never loads (no tiles); the shape only has to be valid."""
    desc_k = tl.make_tensor_descriptor(k_base, shape=[tl.maximum(Lk, 1), HEAD_D], strides=[stride_kt, 1],
                                       block_shape=[BLOCK_N, HEAD_D])
    desc_v = tl.make_tensor_descriptor(v_base, shape=[tl.maximum(Lk, 1), HEAD_D], strides=[stride_vt, 1],
                                       block_shape=[BLOCK_N, HEAD_D])
    return desc_k, desc_v


@triton.jit
def _vis2(rows, cols, shift, Lk, win_left, win_right, HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr,
          RIGHT_CLOSED: tl.constexpr):
    """_vis for the fused_delta form's kernels, without the checks they do not need: rows past Lq are never stored
    and rows do not mix, and a closed right edge (right = 0) keeps every in-sequence row's window inside [0, Lk)."""
    m = cols[None, :] >= 0
    if not RIGHT_CLOSED:
        m = cols[None, :] < Lk
    return tu.window_mask(m, rows[:, None] + shift, cols[None, :], win_left, win_right, HAS_LEFT, HAS_RIGHT)


@triton.jit
def _vis2_t(rows, cols, shift, win_left, win_right, HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr):
    """Transposed _vis2 for dK/dV: no in-sequence checks at all (queries past Lq have lse = +inf, so p = 0, and
    keys past Lk are never stored)."""
    m = cols[:, None] >= 0
    return tu.window_mask(m, rows[None, :] + shift, cols[:, None], win_left, win_right, HAS_LEFT, HAS_RIGHT)


@triton.jit
def _col_runs(m0, Lq, shift, Lk, win_left, win_right, hstu, HSTU: tl.constexpr, BLOCK_M: tl.constexpr,
              BLOCK_N: tl.constexpr, HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr):
    """Key tiles seen by the query rows of the tile at m0: start column, tile count, fully visible tiles
    [k_lo, k_hi), and the HSTU mask's runs of tiles (gem.ops.triton_utils.hstu_key_tiles): every one masked, tile t
    from hstu_tile_start."""
    rows_last = tl.minimum(m0 + BLOCK_M, Lq) - 1
    lo = 0
    hi = Lk
    runs = (0, 0, 0, 0, 0)
    if HSTU:
        runs = tu.hstu_key_tiles(m0, hstu, BLOCK_M, BLOCK_N)
    if HAS_LEFT:
        lo = tl.maximum(m0 + shift - win_left, 0)
    if HAS_RIGHT:
        hi = tl.minimum(rows_last + shift + win_right + 1, Lk)
    n_t = tl.cdiv(tl.maximum(hi - lo, 0), BLOCK_N)
    if HSTU:
        n_t = tu.hstu_tile_count(runs)
        k_lo = 0
        k_hi = 0
    else:
        k_lo, k_hi = tu.edge_runs(m0, rows_last, lo, n_t, shift, win_left, win_right, HAS_LEFT, HAS_RIGHT, BLOCK_N)
    return lo, n_t, k_lo, k_hi, runs


@triton.jit
def _row_runs(n0, cols_last, shift, Lq, win_left, win_right, BLOCK_M: tl.constexpr,
              HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr):
    """Query tiles that see key columns [n0, cols_last]: start row, tile count, fully visible tiles."""
    lo = 0
    hi = Lq
    if HAS_RIGHT:
        lo = tl.maximum(n0 - shift - win_right, 0)
    if HAS_LEFT:
        hi = tl.minimum(cols_last - shift + win_left + 1, Lq)
    n_t = tl.cdiv(tl.maximum(hi - lo, 0), BLOCK_M)
    # the mirror of _col_runs: query i sees key j for j - shift - right <= i <= j - shift + left
    k_lo, k_hi = tu.edge_runs(n0 - shift, cols_last - shift, lo, n_t, 0, win_right, win_left, HAS_RIGHT, HAS_LEFT,
                           BLOCK_M)
    return lo, n_t, k_lo, k_hi


# ----------------------------------------------------------------------------------------------- forward
# Scores are scaled by scale*log2(e) in fp32 (pre-scaling q in bf16 would round it: an error proportional to |score|,
# 4% of the output at scores near -900 on the H200). K is loaded as [BLOCK_N, D] rows (contiguous) and fed to the dot
# transposed, P @ V accumulates straight into acc. TMA: per-sequence tensor descriptors of shape [Lk, D], so rows
# past Lk come back as zeros from the copy engine (the subtraction scheme's masked rows) with no address math or
# predicates.


@triton.jit
def _fwd_tile(acc, l_i, m_i, q, k_base, v_base, desc_k, desc_v, stride_kt, stride_vt, n, offs_m, offs_n, offs_d,
               shift, Lq, Lk, win_left, win_right, hstu, HSTU: tl.constexpr, qk_scale,
               MASKED: tl.constexpr, HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr, DOT_PREC: tl.constexpr,
               TMA: tl.constexpr, RIGHT_CLOSED: tl.constexpr):
    cols = n + offs_n
    if TMA:
        k = desc_k.load([n, 0])
        v = desc_v.load([n, 0])
    else:
        in_k = cols < Lk
        k = tl.load(k_base + cols[:, None] * stride_kt + offs_d[None, :], mask=in_k[:, None], other=0.0)
        v = tl.load(v_base + cols[:, None] * stride_vt + offs_d[None, :], mask=in_k[:, None], other=0.0)
    s = tu.dot(q, tl.trans(k), DOT_PREC)  # raw scores; scale*log2(e) applies in fp32 below (qk_scale > 0)
    if MASKED:
        if HSTU:
            vis = tu.hstu_visible(offs_m[:, None], cols[None, :], hstu)
        else:
            vis = _vis2(offs_m, cols, shift, Lk, win_left, win_right, HAS_LEFT, HAS_RIGHT, RIGHT_CLOSED)
        s = tl.where(vis, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1) * qk_scale)
    m_use = m_new
    if MASKED:
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
    p = tl.math.exp2(s * qk_scale - m_use[:, None])  # one FMA per score
    alpha = tl.math.exp2(m_i - m_use)
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = tu.dot_acc(p.to(v.dtype), v, acc * alpha[:, None], DOT_PREC)
    return acc, l_i, m_new


@triton.jit
def _fwd_loop(q, k_base, v_base, desc_k, desc_v, stride_kt, stride_vt, offs_m, offs_n, offs_d, shift, Lq, Lk,
               win_left, win_right, hstu, HSTU: tl.constexpr, qk_scale, lo, n_t, k_lo, k_hi, runs,
               SUB: tl.constexpr, HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr, RIGHT_CLOSED: tl.constexpr,
               DOT_PREC: tl.constexpr, TMA: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
               HEAD_D: tl.constexpr):
    acc = tl.zeros([BLOCK_M, HEAD_D], dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    for t in range(k_lo):  # left window edge
        acc, l_i, m_i = _fwd_tile(acc, l_i, m_i, q, k_base, v_base, desc_k, desc_v, stride_kt, stride_vt,
                                  lo + t * BLOCK_N, offs_m, offs_n, offs_d, shift, Lq, Lk, win_left, win_right, hstu,
                                  HSTU, qk_scale, True, HAS_LEFT, HAS_RIGHT, DOT_PREC, TMA, RIGHT_CLOSED)
    k_full = k_hi
    if not SUB:
        k_full = tl.maximum(tl.minimum(k_hi, (Lk - lo) // BLOCK_N), k_lo)
    for t in range(k_lo, k_full):  # no mask at all
        acc, l_i, m_i = _fwd_tile(acc, l_i, m_i, q, k_base, v_base, desc_k, desc_v, stride_kt, stride_vt,
                                  lo + t * BLOCK_N, offs_m, offs_n, offs_d, shift, Lq, Lk, win_left, win_right, hstu,
                                  HSTU, qk_scale, False, HAS_LEFT, HAS_RIGHT, DOT_PREC, TMA, RIGHT_CLOSED)
    for t in range(k_full, n_t):  # right edge / causal diagonal
        n = lo + t * BLOCK_N
        if HSTU:
            n = tu.hstu_tile_start(t, runs, BLOCK_N)
        acc, l_i, m_i = _fwd_tile(acc, l_i, m_i, q, k_base, v_base, desc_k, desc_v, stride_kt, stride_vt, n, offs_m,
                                  offs_n, offs_d, shift, Lq, Lk, win_left, win_right, hstu, HSTU, qk_scale, True,
                                  HAS_LEFT, HAS_RIGHT, DOT_PREC, TMA, RIGHT_CLOSED)
    n_masked = 0
    if SUB:
        n_masked = tl.maximum(tl.minimum(lo + k_hi * BLOCK_N, lo + n_t * BLOCK_N) - Lk, 0)
        n_masked = tl.where(k_hi > k_lo, n_masked, 0)
    return acc, l_i, m_i, n_masked


@triton.jit
def _q_kv_item(K, V, OFF_Q, OFF_K, item, h, NT, stride_kt, stride_kh, stride_vt, stride_vh, win_left, win_right,
               NUM_TARGETS, HSTU_CTX, HSTU_MAX_ATTN, HSTU: tl.constexpr, GROUP: tl.constexpr, HAS_LEFT: tl.constexpr,
               HAS_RIGHT: tl.constexpr, TMA: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
               HEAD_D: tl.constexpr):
    """What the forward and dQ passes need of a (q tile, head) item: _q_item's values, the hstu tuple, the K/V rows
    (and their TMA descriptors; without TMA the row pointers stand in, never read as descriptors) and _col_runs'
    key tiles."""
    m0, q_start, Lq, k_start, Lk, shift, kvh, offs_m, offs_n, offs_d, in_q = _q_item(OFF_Q, OFF_K, item, h, NT, GROUP,
                                                                                  BLOCK_M, BLOCK_N, HEAD_D)
    hstu = tu.hstu_seq(NUM_TARGETS, item // NT, Lq, Lk, HSTU_CTX, HSTU_MAX_ATTN, HSTU)
    k_base, v_base = _kv_bases(K, V, k_start, kvh, stride_kt, stride_kh, stride_vt, stride_vh)
    desc_k, desc_v = k_base, v_base
    if TMA:
        desc_k, desc_v = _kv_descs(k_base, v_base, Lk, stride_kt, stride_vt, BLOCK_N, HEAD_D)
    lo, n_t, k_lo, k_hi, runs = _col_runs(m0, Lq, shift, Lk, win_left, win_right, hstu, HSTU, BLOCK_M, BLOCK_N,
                                          HAS_LEFT, HAS_RIGHT)
    return (q_start, Lq, Lk, shift, offs_m, offs_n, offs_d, in_q, hstu, k_base, v_base, desc_k, desc_v, lo, n_t, k_lo,
            k_hi, runs)


@triton.jit
def _fwd_item(Q, K, V, O, LSE, OFF_Q, OFF_K, item, h,
              stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_ot, stride_oh,
              stride_lh, qk_scale, win_left, win_right, NUM_TARGETS, HSTU_CTX, HSTU_MAX_ATTN, HSTU: tl.constexpr, NT,
              GROUP: tl.constexpr, SUB: tl.constexpr, HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr,
              RIGHT_CLOSED: tl.constexpr, DOT_PREC: tl.constexpr, TMA: tl.constexpr, BLOCK_M: tl.constexpr,
              BLOCK_N: tl.constexpr, HEAD_D: tl.constexpr):
    (q_start, Lq, Lk, shift, offs_m, offs_n, offs_d, in_q, hstu, k_base, v_base, desc_k, desc_v, lo, n_t, k_lo, k_hi,
     runs) = _q_kv_item(K, V, OFF_Q, OFF_K, item, h, NT, stride_kt, stride_kh, stride_vt, stride_vh, win_left,
                              win_right, NUM_TARGETS, HSTU_CTX, HSTU_MAX_ATTN, HSTU, GROUP, HAS_LEFT, HAS_RIGHT, TMA,
                              BLOCK_M, BLOCK_N, HEAD_D)
    q = tl.load(Q + (q_start + offs_m[:, None]).to(tl.int64) * stride_qt + h * stride_qh + offs_d[None, :],
                mask=in_q[:, None], other=0.0)

    acc, l_i, m_i, n_masked = _fwd_loop(q, k_base, v_base, desc_k, desc_v, stride_kt, stride_vt, offs_m, offs_n, offs_d,
                                        shift, Lq, Lk, win_left, win_right, hstu, HSTU, qk_scale, lo, n_t, k_lo, k_hi,
                                        runs, SUB, HAS_LEFT, HAS_RIGHT, RIGHT_CLOSED, DOT_PREC, TMA, BLOCK_M, BLOCK_N,
                                        HEAD_D)
    if SUB:
        l_raw = l_i
        l_i = tl.where(n_masked > 0, l_raw - n_masked * tl.math.exp2(-tl.maximum(m_i, 0.0)), l_raw)
        bad = in_q & (n_masked > 0) & (l_i * 64.0 < l_raw)
        if tl.max(bad.to(tl.int32), 0) > 0:  # cancellation: redo this tile with -inf masking
            acc, l_i, m_i, _unused = _fwd_loop(q, k_base, v_base, desc_k, desc_v, stride_kt, stride_vt, offs_m, offs_n,
                                               offs_d, shift, Lq, Lk, win_left, win_right, hstu, HSTU, qk_scale, lo,
                                               n_t, k_lo, k_hi, runs, False, HAS_LEFT, HAS_RIGHT, RIGHT_CLOSED,
                                               DOT_PREC, TMA, BLOCK_M, BLOCK_N, HEAD_D)
    empty = l_i <= 0.0
    out = acc / tl.where(empty, 1.0, l_i)[:, None]
    tl.store(O + (q_start + offs_m[:, None]).to(tl.int64) * stride_ot + h * stride_oh + offs_d[None, :],
             out.to(O.dtype.element_ty), mask=in_q[:, None])
    lse = tl.where(empty, float("inf"), (m_i + tl.math.log2(tl.where(empty, 1.0, l_i))) / 1.4426950408889634)
    tl.store(LSE + h * stride_lh + q_start + offs_m, lse, mask=in_q)


@triton.jit
def _jfa_fwd_kernel(Q, K, V, O, LSE, OFF_Q, OFF_K, WORK,
                    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_ot, stride_oh,
                    stride_lh, qk_scale, win_left, win_right, NT,
                    H: tl.constexpr, GROUP: tl.constexpr, SUB: tl.constexpr, HAS_LEFT: tl.constexpr,
                    HAS_RIGHT: tl.constexpr, RIGHT_CLOSED: tl.constexpr, DOT_PREC: tl.constexpr,
                    TMA: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, HEAD_D: tl.constexpr,
                    NUM_TARGETS, HSTU_CTX, HSTU_MAX_ATTN, HSTU: tl.constexpr):
    item, h = _program_item(WORK, NT, H, True)
    if item >= 0:
        _fwd_item(Q, K, V, O, LSE, OFF_Q, OFF_K, item, h, stride_qt, stride_qh, stride_kt, stride_kh, stride_vt,
                  stride_vh, stride_ot, stride_oh, stride_lh, qk_scale, win_left, win_right, NUM_TARGETS, HSTU_CTX,
                  HSTU_MAX_ATTN, HSTU, NT, GROUP, SUB, HAS_LEFT, HAS_RIGHT, RIGHT_CLOSED, DOT_PREC, TMA, BLOCK_M,
                  BLOCK_N, HEAD_D)


# ----------------------------------------------------------------------------------------------- backward


@triton.jit
def _jfa_bwd_pre_kernel(O, DO, DELTA, T, stride_ot, stride_oh, stride_dt, stride_dh, stride_lh,
                        BLOCK: tl.constexpr, HEAD_D: tl.constexpr):
    h = tl.program_id(1)
    rows = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    offs_d = tl.arange(0, HEAD_D)
    ok = rows < T
    o = tl.load(O + rows[:, None].to(tl.int64) * stride_ot + h * stride_oh + offs_d[None, :], mask=ok[:, None],
                other=0.0)
    do = tl.load(DO + rows[:, None].to(tl.int64) * stride_dt + h * stride_dh + offs_d[None, :], mask=ok[:, None],
                 other=0.0)
    tl.store(DELTA + h * stride_lh + rows, tl.sum(o.to(tl.float32) * do.to(tl.float32), 1), mask=ok)


@triton.jit
def _dkdv_tile(dk, dv, k, v, q_base, do_base, lse_base, delta_base, desc_q, desc_do, col, stride_qt, stride_dot, m,
               offs_m, offs_n, offs_d, shift, Lq, Lk, win_left, win_right, hstu, HSTU: tl.constexpr, qk_scale,
               MASKED: tl.constexpr, HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr, DOT_PREC: tl.constexpr,
               FUSED_FORM: tl.constexpr, TMA: tl.constexpr):
    rows = m + offs_m
    in_q = rows < Lq
    if TMA:  # rows >= Lq come back as zeros
        do = desc_do.load([m, col])
    else:
        do = tl.load(do_base + rows[:, None] * stride_dot + offs_d[None, :], mask=in_q[:, None], other=0.0)
    lse2 = tl.load(lse_base + rows, mask=in_q, other=float("inf")) * 1.4426950408889634  # log2; +inf -> p = 0
    delta = tl.load(delta_base + rows, mask=in_q, other=0.0)
    if FUSED_FORM:  # q as contiguous [BLOCK_M, D] rows
        if TMA:
            q = desc_q.load([m, col])
        else:
            q = tl.load(q_base + rows[:, None] * stride_qt + offs_d[None, :], mask=in_q[:, None], other=0.0)
        sT = tu.dot(k, tl.trans(q), DOT_PREC) * qk_scale  # [BLOCK_N, BLOCK_M]
    else:
        qT = tl.load(q_base + rows[None, :] * stride_qt + offs_d[:, None], mask=in_q[None, :], other=0.0)
        sT = tu.dot(k, qT, DOT_PREC) * qk_scale
    pT = tl.math.exp2(sT - lse2[None, :])
    if MASKED:
        if HSTU:
            vis = tu.hstu_visible(rows[None, :], offs_n[:, None], hstu)
        elif FUSED_FORM:
            vis = _vis2_t(rows, offs_n, shift, win_left, win_right, HAS_LEFT, HAS_RIGHT)
        else:
            vis = _vis_t(rows, offs_n, shift, Lq, Lk, win_left, win_right, HAS_LEFT, HAS_RIGHT)
        pT = tl.where(vis, pT, 0.0)
    dpT = tu.dot(v, tl.trans(do), DOT_PREC)
    if FUSED_FORM:
        dv = tu.dot_acc(pT.to(do.dtype), do, dv, DOT_PREC)
        dsT = pT * (dpT - delta[None, :])
        dk = tu.dot_acc(dsT.to(q.dtype), q, dk, DOT_PREC)
    else:
        dv += tu.dot(pT.to(do.dtype), do, DOT_PREC)
        dsT = pT * (dpT - delta[None, :])
        dk += tu.dot(dsT.to(qT.dtype), tl.trans(qT), DOT_PREC)
    return dk, dv


@triton.jit
def _jfa_bwd_dkdv_kernel(Q, K, V, DO, LSE, DELTA, DK, DV, OFF_Q, OFF_K, WORK,
                         stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_dot, stride_doh,
                         stride_dkt, stride_dkh, stride_dvt, stride_dvh, stride_lh,
                         qk_scale, sm_scale, win_left, win_right, NT,
                         H_GRID: tl.constexpr, GROUP: tl.constexpr, HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr,
                         DOT_PREC: tl.constexpr, FUSED_FORM: tl.constexpr, TMA: tl.constexpr, BLOCK_M: tl.constexpr,
                         BLOCK_N: tl.constexpr, HEAD_D: tl.constexpr, NUM_TARGETS, HSTU_CTX, HSTU_MAX_ATTN,
                         HSTU: tl.constexpr):
    item, kvh = _program_item(WORK, NT, H_GRID, FUSED_FORM)  # fused_delta: the flat grid
    if item < 0:
        return
    b = item // NT
    n0 = (item % NT) * BLOCK_N
    q_start, Lq, k_start, Lk = _seq_bounds(OFF_Q, OFF_K, b)
    shift = Lk - Lq
    hstu = tu.hstu_seq(NUM_TARGETS, b, Lq, Lk, HSTU_CTX, HSTU_MAX_ATTN, HSTU)

    offs_m = tl.arange(0, BLOCK_M)
    offs_n = n0 + tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, HEAD_D)
    in_k = offs_n < Lk
    k = tl.load(K + (k_start + offs_n[:, None]).to(tl.int64) * stride_kt + kvh * stride_kh + offs_d[None, :],
                mask=in_k[:, None], other=0.0)
    v = tl.load(V + (k_start + offs_n[:, None]).to(tl.int64) * stride_vt + kvh * stride_vh + offs_d[None, :],
                mask=in_k[:, None], other=0.0)
    dk = tl.zeros([BLOCK_N, HEAD_D], dtype=tl.float32)
    dv = tl.zeros([BLOCK_N, HEAD_D], dtype=tl.float32)
    cols_last = tl.minimum(n0 + BLOCK_N, Lk) - 1
    lo, n_t, k_lo, k_hi = _row_runs(n0, cols_last, shift, Lq, win_left, win_right, BLOCK_M, HAS_LEFT, HAS_RIGHT)
    if HSTU:  # masked q tiles only, in up to three runs (gem.ops.triton_utils.hstu_query_tiles)
        runs = tu.hstu_query_tiles(n0, hstu, BLOCK_N, BLOCK_M)
        n_t = tu.hstu_tile_count(runs)
        k_lo = n_t
        k_hi = n_t
    desc_q = None
    desc_do = None
    if TMA:
        # One descriptor per tensor over the GROUP heads that share this kv head (adjacent columns: the host
        # checks stride_qh = HEAD_D), made once, outside the loop: a descriptor rewritten per head while the
        # previous head's copies may still be in flight is not safe. Rows >= Lq come back as zeros; Lq = 0 never
        # loads (no tiles), the shape only has to be valid.
        desc_q = tl.make_tensor_descriptor(Q + q_start.to(tl.int64) * stride_qt + kvh * GROUP * stride_qh,
                                           shape=[tl.maximum(Lq, 1), GROUP * HEAD_D], strides=[stride_qt, 1],
                                           block_shape=[BLOCK_M, HEAD_D])
        desc_do = tl.make_tensor_descriptor(DO + q_start.to(tl.int64) * stride_dot + kvh * GROUP * stride_doh,
                                            shape=[tl.maximum(Lq, 1), GROUP * HEAD_D], strides=[stride_dot, 1],
                                            block_shape=[BLOCK_M, HEAD_D])
    for g in range(GROUP):
        h = kvh * GROUP + g
        q_base = Q + q_start.to(tl.int64) * stride_qt + h * stride_qh
        do_base = DO + q_start.to(tl.int64) * stride_dot + h * stride_doh
        lse_base = LSE + h * stride_lh + q_start
        delta_base = DELTA + h * stride_lh + q_start
        for t in range(k_lo):  # rows still left of the causal / right-window edge
            m = lo + t * BLOCK_M
            if HSTU:
                m = tu.hstu_tile_start(t, runs, BLOCK_M)
            dk, dv = _dkdv_tile(dk, dv, k, v, q_base, do_base, lse_base, delta_base, desc_q, desc_do, g * HEAD_D,
                                stride_qt, stride_dot, m, offs_m, offs_n, offs_d, shift, Lq, Lk, win_left, win_right,
                                hstu, HSTU, qk_scale, True, HAS_LEFT, HAS_RIGHT, DOT_PREC, FUSED_FORM, TMA)
        for t in range(k_lo, k_hi):
            dk, dv = _dkdv_tile(dk, dv, k, v, q_base, do_base, lse_base, delta_base, desc_q, desc_do, g * HEAD_D,
                                stride_qt, stride_dot, lo + t * BLOCK_M, offs_m, offs_n, offs_d, shift, Lq, Lk,
                                win_left, win_right, hstu, HSTU, qk_scale, False, HAS_LEFT, HAS_RIGHT, DOT_PREC,
                                FUSED_FORM, TMA)
        for t in range(k_hi, n_t):
            dk, dv = _dkdv_tile(dk, dv, k, v, q_base, do_base, lse_base, delta_base, desc_q, desc_do, g * HEAD_D,
                                stride_qt, stride_dot, lo + t * BLOCK_M, offs_m, offs_n, offs_d, shift, Lq, Lk,
                                win_left, win_right, hstu, HSTU, qk_scale, True, HAS_LEFT, HAS_RIGHT, DOT_PREC,
                                FUSED_FORM, TMA)
    dk = dk * sm_scale
    tl.store(DK + (k_start + offs_n[:, None]).to(tl.int64) * stride_dkt + kvh * stride_dkh + offs_d[None, :],
             dk.to(DK.dtype.element_ty), mask=in_k[:, None])
    tl.store(DV + (k_start + offs_n[:, None]).to(tl.int64) * stride_dvt + kvh * stride_dvh + offs_d[None, :],
             dv.to(DV.dtype.element_ty), mask=in_k[:, None])


@triton.jit
def _dq_tile(dq, q, do, lse2, delta, k_base, v_base, desc_k, desc_v, stride_kt, stride_vt, n, offs_m, offs_n, offs_d,
             shift, Lq, Lk, win_left, win_right, hstu, HSTU: tl.constexpr, qk_scale,
             MASKED: tl.constexpr, CLAMP: tl.constexpr, HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr,
             DOT_PREC: tl.constexpr, FUSED_FORM: tl.constexpr, TMA: tl.constexpr, RIGHT_CLOSED: tl.constexpr):
    cols = n + offs_n
    in_k = cols < Lk
    if FUSED_FORM:  # contiguous [BLOCK_N, D] rows, transposed for free in the dot
        if TMA:
            k = desc_k.load([n, 0])
            v = desc_v.load([n, 0])
        else:
            k = tl.load(k_base + cols[:, None] * stride_kt + offs_d[None, :], mask=in_k[:, None], other=0.0)
            v = tl.load(v_base + cols[:, None] * stride_vt + offs_d[None, :], mask=in_k[:, None], other=0.0)
        s = tu.dot(q, tl.trans(k), DOT_PREC) * qk_scale - lse2[:, None]
    else:
        kT = tl.load(k_base + cols[None, :] * stride_kt + offs_d[:, None], mask=in_k[None, :], other=0.0)
        vT = tl.load(v_base + cols[None, :] * stride_vt + offs_d[:, None], mask=in_k[None, :], other=0.0)
        s = tu.dot(q, kT, DOT_PREC) * qk_scale - lse2[:, None]
    if CLAMP:  # zero-loaded keys: p <= 1 holds for real keys, the clamp keeps masked ones finite (times k = 0)
        s = tl.minimum(s, 0.0)
    p = tl.math.exp2(s)
    if MASKED:
        if HSTU:
            vis = tu.hstu_visible(offs_m[:, None], cols[None, :], hstu)
        elif FUSED_FORM:
            vis = _vis2(offs_m, cols, shift, Lk, win_left, win_right, HAS_LEFT, HAS_RIGHT, RIGHT_CLOSED)
        else:
            vis = _vis(offs_m, cols, shift, Lq, Lk, win_left, win_right, HAS_LEFT, HAS_RIGHT)
        p = tl.where(vis, p, 0.0)
    if FUSED_FORM:
        dp = tu.dot(do, tl.trans(v), DOT_PREC)
        ds = p * (dp - delta[:, None])
        dq = tu.dot_acc(ds.to(k.dtype), k, dq, DOT_PREC)
    else:
        dp = tu.dot(do, vT, DOT_PREC)
        ds = p * (dp - delta[:, None])
        dq += tu.dot(ds.to(q.dtype), tl.trans(kT), DOT_PREC)
    return dq


@triton.jit
def _jfa_bwd_dq_kernel(Q, K, V, DO, LSE, DELTA, DQ, O, OFF_Q, OFF_K, WORK,
                       stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_dot, stride_doh,
                       stride_dqt, stride_dqh, stride_ot, stride_oh, stride_lh, qk_scale, sm_scale, win_left,
                       win_right, NT, H_GRID: tl.constexpr, GROUP: tl.constexpr, SUB: tl.constexpr,
                       MASK_EDGE: tl.constexpr, HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr,
                       RIGHT_CLOSED: tl.constexpr, DOT_PREC: tl.constexpr, FUSED_FORM: tl.constexpr, TMA: tl.constexpr,
                       FUSE_DELTA: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, HEAD_D: tl.constexpr,
                       NUM_TARGETS, HSTU_CTX, HSTU_MAX_ATTN, HSTU: tl.constexpr):
    item, h = _program_item(WORK, NT, H_GRID, FUSED_FORM)  # fused_delta: the flat grid
    if item < 0:
        return
    (q_start, Lq, Lk, shift, offs_m, offs_n, offs_d, in_q, hstu, k_base, v_base, desc_k, desc_v, lo, n_t, k_lo, k_hi,
     runs) = _q_kv_item(K, V, OFF_Q, OFF_K, item, h, NT, stride_kt, stride_kh, stride_vt, stride_vh, win_left,
                              win_right, NUM_TARGETS, HSTU_CTX, HSTU_MAX_ATTN, HSTU, GROUP, HAS_LEFT, HAS_RIGHT, TMA,
                              BLOCK_M, BLOCK_N, HEAD_D)
    rows = (q_start + offs_m[:, None]).to(tl.int64)
    q = tl.load(Q + rows * stride_qt + h * stride_qh + offs_d[None, :], mask=in_q[:, None], other=0.0)
    do = tl.load(DO + rows * stride_dot + h * stride_doh + offs_d[None, :], mask=in_q[:, None], other=0.0)
    lse2 = tl.load(LSE + h * stride_lh + q_start + offs_m, mask=in_q, other=float("inf")) * 1.4426950408889634
    if FUSE_DELTA:  # delta = rowsum(O * dO) here, for the dK/dV pass that runs after this one
        o = tl.load(O + rows * stride_ot + h * stride_oh + offs_d[None, :], mask=in_q[:, None], other=0.0)
        delta = tl.sum(o.to(tl.float32) * do.to(tl.float32), 1)
        tl.store(DELTA + h * stride_lh + q_start + offs_m, delta, mask=in_q)
    else:
        delta = tl.load(DELTA + h * stride_lh + q_start + offs_m, mask=in_q, other=0.0)
    k_full = tl.maximum(tl.minimum(k_hi, (Lk - lo) // BLOCK_N), k_lo)  # fully visible and fully in-sequence

    dq = tl.zeros([BLOCK_M, HEAD_D], dtype=tl.float32)
    for t in range(k_lo):
        dq = _dq_tile(dq, q, do, lse2, delta, k_base, v_base, desc_k, desc_v, stride_kt, stride_vt, lo + t * BLOCK_N,
                      offs_m, offs_n, offs_d, shift, Lq, Lk, win_left, win_right, hstu, HSTU, qk_scale, True, False,
                      HAS_LEFT, HAS_RIGHT, DOT_PREC, FUSED_FORM, TMA, RIGHT_CLOSED)
    for t in range(k_lo, k_full):
        dq = _dq_tile(dq, q, do, lse2, delta, k_base, v_base, desc_k, desc_v, stride_kt, stride_vt, lo + t * BLOCK_N,
                      offs_m, offs_n, offs_d, shift, Lq, Lk, win_left, win_right, hstu, HSTU, qk_scale, False, False,
                      HAS_LEFT, HAS_RIGHT, DOT_PREC, FUSED_FORM, TMA, RIGHT_CLOSED)
    for t in range(k_full, k_hi):  # the fully visible tile crossing Lk: masked, or clamped for the sub scheme
        dq = _dq_tile(dq, q, do, lse2, delta, k_base, v_base, desc_k, desc_v, stride_kt, stride_vt, lo + t * BLOCK_N,
                      offs_m, offs_n, offs_d, shift, Lq, Lk, win_left, win_right, hstu, HSTU, qk_scale,
                      MASKED=MASK_EDGE, CLAMP=SUB, HAS_LEFT=HAS_LEFT, HAS_RIGHT=HAS_RIGHT, DOT_PREC=DOT_PREC,
                      FUSED_FORM=FUSED_FORM, TMA=TMA, RIGHT_CLOSED=RIGHT_CLOSED)
    for t in range(k_hi, n_t):
        n = lo + t * BLOCK_N
        if HSTU:
            n = tu.hstu_tile_start(t, runs, BLOCK_N)
        dq = _dq_tile(dq, q, do, lse2, delta, k_base, v_base, desc_k, desc_v, stride_kt, stride_vt, n, offs_m, offs_n,
                      offs_d, shift, Lq, Lk, win_left, win_right, hstu, HSTU, qk_scale, True, False, HAS_LEFT,
                      HAS_RIGHT, DOT_PREC, FUSED_FORM, TMA, RIGHT_CLOSED)
    dq = dq * sm_scale
    tl.store(DQ + (q_start + offs_m[:, None]).to(tl.int64) * stride_dqt + h * stride_dqh + offs_d[None, :],
             dq.to(DQ.dtype.element_ty), mask=in_q[:, None])


# ----------------------------------------------------------------------------------------------- host side


def _cached_table(offsets_a, offsets_b, max_len_a: int, block: int, left: int, right: int):
    """The work table of one pass over tiles of `block` rows of offsets_a's sequences (gem.ops.triton_utils)."""
    return tu.work_table("seq_span", offsets_a, offsets_b, max_len_a, block, left=left, right=right)


# The backward form per call: "delta_pre" from this max_len_q up when there is no left window (full or causal rows).
# fused_delta was measured ahead through rows of 8192 at D 128 (2-3.5% at ~U[1, 8192]) and not timed above that,
# where "delta_pre" stays. A module constant so tests can move it.
_BWD_DELTA_PRE_MIN_LEN = 16384


def _bwd_form(max_len_q: int, left: int) -> str:
    """"delta_pre" or "fused_delta" (see the module doc): a left window bounds the rows each tile visits, where the
    fused_delta backward's lean edge masks and fused delta win."""
    return "delta_pre" if max_len_q >= _BWD_DELTA_PRE_MIN_LEN and left < 0 else "fused_delta"


# Head dims whose fused_delta backward takes TMA loads on the GPU (others take pointer loads). At D = 64 the TMA
# backward faulted on the H200 (unspecified launch failure, non-causal, rows of 1000 and more; tools/jfa_fault_matrix.py).
# The interpreter still runs it.
_TMA_BWD_HEAD_DIMS = (128,)


def _tiles(entries) -> list[LaunchConfig]:
    """LaunchConfigs of (BLOCK_M, BLOCK_N, num_warps, num_stages[, maxnreg]) entries."""
    return [tile_config(*e) for e in entries]


# The first entry of each list is the default.
def _fwd_configs(d: int) -> list[LaunchConfig]:
    if triton_interpreting():
        return _tiles([(16, 16, 4, 1)])
    # a 128-row q tile on 8 warps (two wgmma warpgroups). (128, 64, 8, 2) needs ~96 KB of shared memory: two
    # programs fit by shared memory, and by registers once capped (below), hiding each other's pipeline fill on
    # short jagged rows and causal diagonals.
    if d <= 64:
        return _tiles([(128, 64, 4, 3), (128, 64, 8, 4), (128, 64, 4, 2), (128, 64, 8, 2, 128)])
    if d <= 128:
        # A 5th entry is ptxas's register cap (maxnreg). At 253 registers an 8-warp program fills the SM's register
        # file: one program per SM, latency-bound on short jagged rows. Capped at 128, two (128, 64, 8, 2) programs
        # (~96 KB of shared memory each) fit on one SM.
        # No 64-row tile on 4 warps: on the H200 it faults (unspecified launch failure) on causal calls with
        # jagged rows (test_gpu_forms_every_config), and a tuner trying it would kill the process's CUDA context.
        return _tiles([(128, 128, 8, 3), (128, 64, 8, 3), (128, 64, 8, 4), (128, 64, 8, 2), (128, 64, 8, 2, 128)])
    return _tiles([(64, 64, 4, 2), (128, 32, 8, 2)])


def _bwd_configs(d: int, form: str = "delta_pre"):
    """Paired tiles of the two passes, (dkdv BLOCK_M, dkdv BLOCK_N, dq BLOCK_M, dq BLOCK_N, num_warps, num_stages):
    each pass takes its half of every entry as a candidate LaunchConfig (_pass_configs); the first is the default."""
    if triton_interpreting():
        return [(16, 16, 16, 16, 4, 1)]
    if d <= 128:
        if form == "delta_pre":
            return [(64, 128, 128, 64, 8, 3), (64, 64, 64, 64, 4, 3)]
        # (32, 128, ...): the one 8-warp fused_delta dK/dV tile that ptxas fits in 255 registers without spilling (the
        # 64-row ones spill). The 4-warp (32, 64, ...) tiles run two programs per SM, so one's K/V load and dK/dV store
        # overlap the other's loop; the 3-stage one is the tuner's usual dK/dV pick at D 128 on the H200. No 32-key
        # dQ tile: (64, 32, 4, 2) timed 7% faster on causal rows of <= 1024 tokens but returned non-finite dQ on
        # causal jagged rows on the H200 (the interpreter computes it right).
        return [(64, 128, 128, 64, 8, 2), (64, 128, 128, 64, 8, 3), (64, 64, 64, 64, 4, 3), (32, 128, 128, 64, 8, 2),
                (32, 64, 64, 64, 4, 2), (32, 64, 64, 64, 4, 3)]
    return [(32, 64, 64, 32, 4, 2), (32, 32, 32, 32, 4, 1)]


def _pass_configs(d: int, form: str, which: str) -> list[LaunchConfig]:
    """One backward pass's candidates, projected from _bwd_configs: the
    dK/dV and dQ passes are tuned apart, so a pass may pair its best tile with the other's."""
    out = []
    for bm1, bn1, bm2, bn2, warps, stages in _bwd_configs(d, form):
        cfg = tile_config(bm1, bn1, warps, stages) if which == "dkdv" else tile_config(bm2, bn2, warps, stages)
        if cfg not in out:
            out.append(cfg)
    return out


# Smaller tiles for where no candidate fits the device's shared memory (fp32 at wide heads), largest first.
_FALLBACK = _tiles([(64, 32, 4, 1), (32, 32, 4, 1), (16, 16, 4, 1)])


def _smem(pass_: str, d: int, elt: int):
    """The shared-memory estimate of a config of one pass at head dim d."""
    return attention_pass_smem(pass_, d, elt)


_TUNER = ConfigTuner("gem.ops.jfa")


def _scratch(size: int, alignment: int, stream):
    """Global scratch for in-kernel TMA descriptors (128 bytes per program)."""
    return torch.empty(size, dtype=torch.int8, device="cuda")


def _tma_ok(*tensors) -> bool:
    """TMA needs 16-byte aligned bases and row strides; the kernels' descriptors also span adjacent heads of one
    token (contiguous [H, D] per token)."""
    return all(t.data_ptr() % 16 == 0 and (t.stride(0) * t.element_size()) % 16 == 0
               and t.stride(2) == 1 and (t.shape[1] == 1 or t.stride(1) == t.shape[2]) for t in tensors)


def _fwd(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, offsets_q: torch.Tensor, offsets_k: torch.Tensor,
         max_len_q: int, max_len_k: int, scale: float, left: int, right: int, mask_inf: bool,
         num_targets: Optional[torch.Tensor] = None,  # noqa: UP045 (custom-op schemas)
         hstu_ctx: int = 0, hstu_max_attn: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    tq, h, d = q.shape
    group = h // k.shape[1]
    out = torch.empty_like(q)
    lse = torch.empty((h, tq), device=q.device, dtype=torch.float32)
    if tq == 0 or offsets_q.numel() <= 1:
        return out, lse
    tma = _tma_ok(k, v)
    if tma and q.is_cuda:
        triton.set_allocator(_scratch)  # a context variable: set it on this thread, right before launch
    common = {"GROUP": group, "SUB": not mask_inf, "HAS_LEFT": left >= 0, "HAS_RIGHT": right >= 0,
              "DOT_PREC": tu.dot_prec(q.dtype), "HEAD_D": d,
              **tu.hstu_kw(offsets_q, num_targets, hstu_ctx, hstu_max_attn, max(max_len_q, max_len_k))}

    def launch(cfg):
        work, nt = _cached_table(offsets_q, offsets_k, max_len_q, cfg.block_m, left, right)
        _jfa_fwd_kernel[(work.shape[0] * h,)](
            q, k, v, out, lse, offsets_q, offsets_k, work, q.stride(0), q.stride(1), k.stride(0), k.stride(1),
            v.stride(0), v.stride(1), out.stride(0), out.stride(1), lse.stride(0), scale * LOG2E, max(left, 0),
            max(right, 0), nt, H=h, TMA=tma, RIGHT_CLOSED=right == 0, **cfg.launch_kwargs(), **common)

    key = (tma, d, q.dtype, tu.len_bucket(max_len_q), tu.len_bucket(max_len_k), left, right, mask_inf)
    if num_targets is not None:  # keys without the HSTU mask stay as they were
        key += ("hstu",)
    launch(_TUNER.pick("fwd", key, lambda: _fwd_configs(d), launch, q.device, outputs=(out, lse),
                       estimate=lambda cfg: _smem("fwd", d, q.element_size())(cfg), fallback=_FALLBACK))
    return out, lse


def _bwd(do: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor, lse: torch.Tensor,
         offsets_q: torch.Tensor, offsets_k: torch.Tensor, max_len_q: int, max_len_k: int, scale: float, left: int,
         right: int, mask_inf: bool,
         num_targets: Optional[torch.Tensor] = None,  # noqa: UP045 (custom-op schemas)
         hstu_ctx: int = 0, hstu_max_attn: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    tq, h, d = q.shape
    tk, h_kv, _ = k.shape
    group = h // h_kv
    do = do.contiguous()
    dq = torch.empty_like(q)
    dk = torch.empty_like(k)
    dv = torch.empty_like(v)
    if offsets_q.numel() <= 1 or (tq == 0 and tk == 0):
        return dq, dk.zero_(), dv.zero_()
    if tq == 0:  # keys without any query: zero gradient
        return dq, dk.zero_(), dv.zero_()
    form = _bwd_form(max_len_q, left)
    fused = form == "fused_delta"
    tma = fused and (not q.is_cuda or d in _TMA_BWD_HEAD_DIMS) and _tma_ok(q, k, v, do)
    if tma and q.is_cuda:
        triton.set_allocator(_scratch)  # the backward may run on another thread than the forward
    delta = torch.empty_like(lse)
    if not fused:
        pre_block = 16 if triton_interpreting() else 128
        _jfa_bwd_pre_kernel[(cdiv(tq, pre_block), h)](
            out, do, delta, tq, out.stride(0), out.stride(1), do.stride(0), do.stride(1), delta.stride(0),
            BLOCK=pre_block, HEAD_D=d)
    hstu = tu.hstu_kw(offsets_q, num_targets, hstu_ctx, hstu_max_attn, max(max_len_q, max_len_k))
    common = {"HAS_LEFT": left >= 0, "HAS_RIGHT": right >= 0, "DOT_PREC": tu.dot_prec(q.dtype), "HEAD_D": d,
              "FUSED_FORM": fused, "TMA": tma, **hstu}

    in_strides = (q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1), do.stride(0),
                  do.stride(1))
    scalars = (scale * LOG2E, scale, max(left, 0), max(right, 0))

    # The two passes are separate kernels, each tuned on its own (tiles, warps and stages): per pass, its kernel, the
    # sides its work table tiles (keys for dK/dV, queries for dQ), which tile is the work table's height, its heads,
    # its outputs and its own constexprs.
    passes = {
        "bwd_dkdv": (_jfa_bwd_dkdv_kernel, offsets_k, offsets_q, max_len_k, "BLOCK_N", h_kv, (dk, dv), {}),
        "bwd_dq": (_jfa_bwd_dq_kernel, offsets_q, offsets_k, max_len_q, "BLOCK_M", h, (dq, out),
                   {"SUB": not mask_inf, "MASK_EDGE": mask_inf, "FUSE_DELTA": fused, "RIGHT_CLOSED": right == 0}),
    }

    def launch(kind, cfg):
        kernel, off_a, off_b, max_len_a, tile_of, heads, (out1, out2), extra = passes[kind]
        work, nt = _cached_table(off_a, off_b, max_len_a, cfg.tile(tile_of), left, right)
        kernel[(work.shape[0] * heads,) if fused else (work.shape[0], heads)](
            q, k, v, do, lse, delta, out1, out2, offsets_q, offsets_k, work, *in_strides, out1.stride(0),
            out1.stride(1), out2.stride(0), out2.stride(1), lse.stride(0), *scalars, nt, H_GRID=heads, GROUP=group,
            **cfg.launch_kwargs(), **common, **extra)

    key = (form + ("-tma" if tma else ""), d, q.dtype, tu.len_bucket(max_len_q),
           tu.len_bucket(max_len_k), left, right, group)
    if num_targets is not None:
        key += ("hstu",)
    # fused_delta: the dQ pass writes delta, which dK/dV reads; delta_pre: the pre kernel wrote it
    for kind in ("bwd_dq", "bwd_dkdv") if fused else ("bwd_dkdv", "bwd_dq"):
        if kind == "bwd_dkdv" and not tk:
            continue
        run = functools.partial(launch, kind)
        written = (dk, dv) if kind == "bwd_dkdv" else (dq, delta) if fused else (dq,)  # delta_pre: delta is an input
        run(_TUNER.pick(kind, key, lambda kind=kind: _pass_configs(d, form, kind[4:]), run, q.device,
                        outputs=written, estimate=lambda cfg, p=kind[4:]: _smem(p, d, q.element_size())(cfg),
                        fallback=_FALLBACK))
    return dq, dk, dv


# ----------------------------------------------------------------------------------------------- torch op


def _fwd_fake(q, k, v, offsets_q, offsets_k, *rest):
    return torch.empty_like(q), q.new_empty((q.shape[1], q.shape[0]), dtype=torch.float32)


def _bwd_fake(do, q, k, v, *rest):
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


# inputs (q, k, v, offsets_q, offsets_k, *constants) -> (out, lse); backward(do, q, k, v, out, lse, offsets_q,
# offsets_k, *constants) -> (dq, dk, dv)
jfa_op = KernelOp("jfa", _fwd, _bwd, fake=_fwd_fake, backward_fake=_bwd_fake, n_tensors=5, nondiff=(1,),
                  save=lambda i, o: (*i[:3], *o, *i[3:5]))


def _unit_last(t: torch.Tensor) -> torch.Tensor:
    """The kernels take token and head strides: only the head dim must be dense. A slice of a fused QKV projection
    (v in [T, 3 * H * D]) then goes in as it is, with no copy."""
    return t if t.stride(-1) == 1 else t.contiguous()


def jfa_triton_with_lse(q, k, v, offsets_q, offsets_k, max_len_q, max_len_k, scale, left=-1, right=-1,
                        mask_inf=False, hstu=None, batches=None):
    """(out, lse [H, Tq] natural log, +inf for rows that see no key) — for tests and callers that need lse. hstu:
    a gem.ops.hstu_mask.HstuMask (self attention or its cached form, no window). batches: the (query, key)
    gem.ops.JaggedBatch pair whose offsets these are, which keeps the work tables."""
    args = (_unit_last(q), _unit_last(k), _unit_last(v), offsets_q, offsets_k, int(max_len_q), int(max_len_k),
            float(scale), int(left), int(right), bool(mask_inf))
    if hstu is not None:
        args += (hstu.num_targets, hstu.contextual_len, hstu.max_attn)
    return jfa_op(*args, batches=batches)


def jfa_triton(q, k, v, offsets_q, offsets_k, max_len_q, max_len_k, scale, left, right, mask_inf, hstu=None,
               batches=None):
    """Triton path of gem.ops.jagged_attention (arguments already validated and normalised)."""
    return jfa_triton_with_lse(q, k, v, offsets_q, offsets_k, max_len_q, max_len_k, scale, left, right, mask_inf,
                               hstu, batches)[0]
