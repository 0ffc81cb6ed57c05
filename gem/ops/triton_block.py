"""Triton kernels for BlockAttention (gem.ops.block), forward and backward, with RoPE fused into tile loads.

Work is a device-built int32 table of (sequence, tile) items, so the grid depends only on T and B (no host sync).
Forward: one program per (q tile, head); a q tile visits only K tiles of its own block(s), up to the diagonal when
causal. Tiles wholly inside the allowed region skip the mask; the others mask by block id / causal / length, which
also covers block_size < tile. Online softmax in fp32 with exp2; the log2-domain lse is kept for the backward.
Backward, deterministic and without atomics (FlashAttention-2 style): one program per (q tile, head) for dQ, which
also writes delta = rowsum(dO * O) of its rows, then one program per (K tile, kv head) accumulating dK/dV over the
q heads of its group and the q tiles of its block; P and dP are recomputed in each (7 tile matmuls per (q tile, key
tile) pair).
A one-pass backward (one program per block and kv head, dQ through an fp32 scratch, 5 matmuls per pair) was built
and timed in session 12: 0.81 ms against 0.77 for the two passes with their extra rope pass, so it was removed.

RoPE: q/k tiles are loaded as the two rotary halves (+ the pass-through channels), so QK^T is the sum of two or
three tl.dot calls over the parts; dQ/dK are accumulated per part (w.r.t. the rotated q/k) and inversely rotated
before the store. The forward's stationary operand (q) is rotated in registers on load, once per program; the
backward passes read theirs (q in dQ, k in dK/dV) from the rotated copies the other pass streams
(GEM_BLOCK_BWD_STATIONARY=rotate rotates them on load instead). The streamed operand (k tiles in the forward
and dQ pass, q tiles in dK/dV) is read from a rotated copy that a rope-kernel pass writes: K_rot in the forward
(kept for the dQ pass by the eager path, recomputed under torch.compile) and Q_rot in the backward (never saved).
Rotating every streamed tile in the inner loop instead costs a load of cos/sin twice the tile's bytes plus math
between load and tl.dot: on the H200 (64K tokens, H 4, D 128, block 512) the three kernels took 1.16 ms with every
tile rotated in-kernel, 0.92 ms with streamed tiles pre-rotated (+ 36 us per rope pass), 0.80 ms without RoPE.
GEM_BLOCK_ROPE_STREAM=inkernel rotates streamed tiles in-kernel instead (no copies; the default is prerotated).
All rotations use the position within the block (scores depend only on j - i, and blocks start at sequence
starts), so the cos/sin rows read stay within block_size however long the sequence.
Holding rotated tiles whole instead (the stationary one rotated by reshape/split/join in registers, so every dot
spans the head dim) was timed in session 12 and lost: fwd 0.210 vs 0.188 ms, dQ 0.305 vs 0.263, dK/dV 0.475 vs 0.468.

Tiles (BLOCK_M, BLOCK_N) and num_warps/num_stages are picked per kernel by a small host-side tuner (gem.ops._tune),
since the work table, hence the grid, depends on the tile height.
"""

from __future__ import annotations

import functools
import math
import os

import torch
import triton
import triton.language as tl

from gem.ops._common import cdiv, eager_tables, next_pow2, offsets_cached, triton_interpreting
from gem.ops._tune import ConfigTuner, reg_cap
from gem.ops.rotary import (
    RopeConfig,
    _rope_triton,
    cos_sin_table,
    positions_cached,
    rope_load_halves,
    rope_load_rotated,
    rope_rotate_regs,
    rope_store_halves,
)

_LOG2E = 1.4426950408889634


@triton.jit
def _load_parts(ptr, row_off, ok, pos, block_size, cos_ptr, sin_ptr, half, rd, D: tl.constexpr, R: tl.constexpr,
                HALF_B: tl.constexpr, PASS_B: tl.constexpr, ROPE: tl.constexpr, HAS_PASS: tl.constexpr,
                INTERLEAVED: tl.constexpr, ROTATE: tl.constexpr):
    """[R, D] tile as (rotated half 1, rotated half 2, pass-through part), all in the input dtype.

    ROTATE=False: ptr already holds rotated rows (a rope-kernel copy); the halves are only split out, in the same
    column convention, so the parts line up with a rotated operand's."""
    ty = ptr.dtype.element_ty
    if ROPE:
        if ROTATE:
            a1, a2 = rope_load_rotated(ptr, row_off, ok, pos % block_size, cos_ptr, sin_ptr, half, HALF_B,
                                       INTERLEAVED, 1.0)
            a1 = a1.to(ty)
            a2 = a2.to(ty)
        else:
            a1, a2 = rope_load_halves(ptr, row_off, ok, half, HALF_B, INTERLEAVED)
    else:
        a1 = tl.zeros([R, HALF_B], dtype=ty)
        a2 = tl.zeros([R, HALF_B], dtype=ty)
    if HAS_PASS:
        j = tl.arange(0, PASS_B)
        ap = tl.load(ptr + row_off[:, None] + rd + j[None, :], mask=ok[:, None] & (j < D - rd)[None, :], other=0.0)
    else:
        ap = tl.zeros([R, PASS_B], dtype=ty)
    return a1, a2, ap


@triton.jit
def _mm(a, b, acc, PREC: tl.constexpr, DOT_F32: tl.constexpr):
    """acc + a @ b. DOT_F32 (interpreter only): Triton 3.7's interpreter multiplies the raw bit patterns of bf16
    operands, so they are widened first; the values are the same bf16-rounded operands the GPU multiplies."""
    if DOT_F32:
        acc = tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision="ieee")
    else:
        acc = tl.dot(a, b, acc, input_precision=PREC)
    return acc


@triton.jit
def _dot_parts(a1, a2, ap, b1, b2, bp, acc, ROPE: tl.constexpr, HAS_PASS: tl.constexpr, PREC: tl.constexpr,
               DOT_F32: tl.constexpr):
    """acc + A @ B^T with A, B given as (half 1, half 2, pass) parts."""
    if ROPE:
        acc = _mm(a1, tl.trans(b1), acc, PREC, DOT_F32)
        acc = _mm(a2, tl.trans(b2), acc, PREC, DOT_F32)
    if HAS_PASS:
        acc = _mm(ap, tl.trans(bp), acc, PREC, DOT_F32)
    return acc


@triton.jit
def _store_parts(ptr, row_off, ok, g1, g2, gp, pos, block_size, cos_ptr, sin_ptr, half, rd, D: tl.constexpr,
                 HALF_B: tl.constexpr, PASS_B: tl.constexpr, ROPE: tl.constexpr, HAS_PASS: tl.constexpr,
                 INTERLEAVED: tl.constexpr):
    """Store a gradient given per part w.r.t. the rotated tensor, applying the inverse rotation first."""
    if ROPE:
        g1, g2 = rope_rotate_regs(g1, g2, pos % block_size, ok, cos_ptr, sin_ptr, half, HALF_B, -1.0)
        rope_store_halves(ptr, row_off, ok, g1, g2, half, HALF_B, INTERLEAVED)
    if HAS_PASS:
        j = tl.arange(0, PASS_B)
        tl.store(ptr + row_off[:, None] + rd + j[None, :], gp.to(ptr.dtype.element_ty),
                 mask=ok[:, None] & (j < D - rd)[None, :])


@triton.jit
def _item_head(NH: tl.constexpr, HEAD_INNER: tl.constexpr):
    """(work item, head) of this program: a (W, NH) grid, or with HEAD_INNER a flat one whose NH programs of one
    item are adjacent, so they meet its RoPE table rows in L2."""
    if HEAD_INNER:
        pid = tl.program_id(0)
        return pid // NH, pid % NH
    return tl.program_id(0), tl.program_id(1)


@triton.jit
def _q_range(m0, length, block_size, BLOCK: tl.constexpr, CAUSAL: tl.constexpr):
    """Keys visited by query rows [m0, m0+BLOCK): [lo, hi), and full_hi: key tiles ending <= full_hi need no mask."""
    m_last = tl.minimum(m0 + BLOCK, length) - 1
    b_first = m0 // block_size
    b_last = m_last // block_size
    lo = b_first * block_size
    if CAUSAL:
        hi = m_last + 1
        full_hi = m0 + 1
    else:
        hi = tl.minimum((b_last + 1) * block_size, length)
        full_hi = hi
    full_hi = tl.where(b_first == b_last, full_hi, lo)
    return lo, hi, full_hi


@triton.jit
def _fwd_tile(m_i, l_i, acc, q1, q2, qp, K, V, start, hk, n0, hi, offs_m, d, d_ok, cos_ptr, sin_ptr, qk_scale,
              block_size, half, rd, HKV: tl.constexpr, D: tl.constexpr, BLOCK_M: tl.constexpr,
              BLOCK_N: tl.constexpr, HALF_B: tl.constexpr, PASS_B: tl.constexpr, MASK: tl.constexpr,
              CAUSAL: tl.constexpr,
              ROPE: tl.constexpr, HAS_PASS: tl.constexpr, INTERLEAVED: tl.constexpr, ROT_STREAM: tl.constexpr,
              PREC: tl.constexpr, DOT_F32: tl.constexpr):
    """One key tile of the online softmax; MASK: diagonal, ragged-end or block-straddling tile."""
    offs_n = n0 + tl.arange(0, BLOCK_N)
    n_ok = offs_n < hi
    k_row = (start + offs_n).to(tl.int64) * (HKV * D) + hk * D
    k1, k2, kp = _load_parts(K, k_row, n_ok, offs_n, block_size, cos_ptr, sin_ptr, half, rd, D, BLOCK_N, HALF_B,
                             PASS_B, ROPE, HAS_PASS, INTERLEAVED, ROT_STREAM)
    s = _dot_parts(q1, q2, qp, k1, k2, kp, tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32), ROPE, HAS_PASS, PREC,
                   DOT_F32)
    s = s * qk_scale
    if MASK:
        allowed = ((offs_m[:, None] // block_size) == (offs_n[None, :] // block_size)) & n_ok[None, :]
        if CAUSAL:
            allowed = allowed & (offs_n[None, :] <= offs_m[:, None])
        s = tl.where(allowed, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    alpha = tl.math.exp2(m_i - m_new)
    p = tl.math.exp2(s - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None]
    v = tl.load(V + k_row[:, None] + d[None, :], mask=n_ok[:, None] & d_ok[None, :], other=0.0)
    acc = _mm(p.to(v.dtype), v, acc, PREC, DOT_F32)
    return m_new, l_i, acc


@triton.jit
def _fwd_kernel(Q, K, V, O, LSE, offsets, work, cos_ptr, sin_ptr, qk_scale, T, block_size, half, rd,
                H: tl.constexpr, HKV: tl.constexpr, D: tl.constexpr, GROUP: tl.constexpr, D_B: tl.constexpr,
                BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, HALF_B: tl.constexpr, PASS_B: tl.constexpr,
                CAUSAL: tl.constexpr, ROPE: tl.constexpr, HAS_PASS: tl.constexpr, INTERLEAVED: tl.constexpr,
                ROT_STREAM: tl.constexpr, PREC: tl.constexpr, DOT_F32: tl.constexpr, HEAD_INNER: tl.constexpr):
    """K: rotated copy of k unless ROT_STREAM (then k itself, rotated per tile)."""
    w, h = _item_head(H, HEAD_INNER)
    b = tl.load(work + 2 * w)
    if b < 0:
        return
    tile = tl.load(work + 2 * w + 1)
    start = tl.load(offsets + b)
    length = tl.load(offsets + b + 1) - start
    hk = h // GROUP
    m0 = tile * BLOCK_M
    offs_m = m0 + tl.arange(0, BLOCK_M)
    m_ok = offs_m < length
    q_row = (start + offs_m).to(tl.int64) * (H * D) + h * D
    q1, q2, qp = _load_parts(Q, q_row, m_ok, offs_m, block_size, cos_ptr, sin_ptr, half, rd, D, BLOCK_M, HALF_B,
                             PASS_B, ROPE, HAS_PASS, INTERLEAVED, True)
    # Checked: every key tile in [lo, hi) holds an allowed (row, key) pair; only diagonal, ragged-end and
    # block-straddling tiles take the mask.
    lo, hi, full_hi = _q_range(m0, length, block_size, BLOCK_M, CAUSAL)
    d = tl.arange(0, D_B)
    d_ok = d < D
    m_i = tl.full([BLOCK_M], -1.0e30, dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, D_B], dtype=tl.float32)
    # key tiles ending at or before full_hi need no mask: run them first, in a loop of their own
    n_full = lo + tl.maximum(full_hi - lo, 0) // BLOCK_N * BLOCK_N
    for n0 in range(lo, n_full, BLOCK_N):
        m_i, l_i, acc = _fwd_tile(m_i, l_i, acc, q1, q2, qp, K, V, start, hk, n0, hi, offs_m, d, d_ok, cos_ptr,
                                  sin_ptr, qk_scale, block_size, half, rd, HKV, D, BLOCK_M, BLOCK_N, HALF_B,
                                  PASS_B, False, CAUSAL, ROPE, HAS_PASS, INTERLEAVED, ROT_STREAM, PREC, DOT_F32)
    for n0 in range(n_full, hi, BLOCK_N):
        m_i, l_i, acc = _fwd_tile(m_i, l_i, acc, q1, q2, qp, K, V, start, hk, n0, hi, offs_m, d, d_ok, cos_ptr,
                                  sin_ptr, qk_scale, block_size, half, rd, HKV, D, BLOCK_M, BLOCK_N, HALF_B,
                                  PASS_B, True, CAUSAL, ROPE, HAS_PASS, INTERLEAVED, ROT_STREAM, PREC, DOT_F32)
    l_safe = tl.where(l_i > 0.0, l_i, 1.0)
    acc = acc / l_safe[:, None]
    tl.store(O + q_row[:, None] + d[None, :], acc.to(O.dtype.element_ty), mask=m_ok[:, None] & d_ok[None, :])
    tl.store(LSE + h.to(tl.int64) * T + start + offs_m, m_i + tl.math.log2(l_safe), mask=m_ok)


@triton.jit
def _dkdv_tile(dv, dk1, dk2, dkp, k1, k2, kp, v, Q, DO, LSE, DELTA, start, h, m0, hi, offs_n, d, d_ok, cos_ptr,
               sin_ptr, qk_scale, T, block_size, half, rd, H: tl.constexpr, D: tl.constexpr, BLOCK_M: tl.constexpr,
               BLOCK_N: tl.constexpr, HALF_B: tl.constexpr, PASS_B: tl.constexpr, MASK: tl.constexpr,
               CAUSAL: tl.constexpr, ROPE: tl.constexpr, HAS_PASS: tl.constexpr, INTERLEAVED: tl.constexpr,
               ROT_STREAM: tl.constexpr, PREC: tl.constexpr, DOT_F32: tl.constexpr):
    """dK, dV of a key tile += one query tile's share (query rows < hi). MASK: diagonal, ragged-end or
    block-straddling tile. Key rows past the sequence end make garbage rows of dK/dV that are never stored."""
    offs_m = m0 + tl.arange(0, BLOCK_M)
    m_ok = offs_m < hi
    q_row = (start + offs_m).to(tl.int64) * (H * D) + h * D
    q1, q2, qp = _load_parts(Q, q_row, m_ok, offs_m, block_size, cos_ptr, sin_ptr, half, rd, D, BLOCK_M, HALF_B,
                             PASS_B, ROPE, HAS_PASS, INTERLEAVED, ROT_STREAM)
    r_off = h.to(tl.int64) * T + start + offs_m
    lse = tl.load(LSE + r_off, mask=m_ok, other=0.0)
    delta = tl.load(DELTA + r_off, mask=m_ok, other=0.0)
    s_t = _dot_parts(k1, k2, kp, q1, q2, qp, tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32), ROPE, HAS_PASS, PREC,
                     DOT_F32)
    s_t = s_t * qk_scale - lse[None, :]
    if MASK:
        allowed = ((offs_n[:, None] // block_size) == (offs_m[None, :] // block_size)) & m_ok[None, :]
        if CAUSAL:
            allowed = allowed & (offs_n[:, None] <= offs_m[None, :])
        s_t = tl.where(allowed, s_t, float("-inf"))
    p_t = tl.math.exp2(s_t)
    do = tl.load(DO + q_row[:, None] + d[None, :], mask=m_ok[:, None] & d_ok[None, :], other=0.0)
    dv = _mm(p_t.to(do.dtype), do, dv, PREC, DOT_F32)
    dp_t = _mm(v, tl.trans(do), tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32), PREC, DOT_F32)
    ds_t = (p_t * (dp_t - delta[None, :])).to(q1.dtype)
    if ROPE:
        dk1 = _mm(ds_t, q1, dk1, PREC, DOT_F32)
        dk2 = _mm(ds_t, q2, dk2, PREC, DOT_F32)
    if HAS_PASS:
        dkp = _mm(ds_t, qp, dkp, PREC, DOT_F32)
    return dv, dk1, dk2, dkp


@triton.jit
def _bwd_dkdv_kernel(Q, K, V, DO, LSE, DELTA, DK, DV, offsets, work, cos_ptr, sin_ptr, qk_scale, sm_scale, T,
                     block_size, half, rd, H: tl.constexpr, HKV: tl.constexpr, D: tl.constexpr,
                     GROUP: tl.constexpr, D_B: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                     HALF_B: tl.constexpr, PASS_B: tl.constexpr, CAUSAL: tl.constexpr, ROPE: tl.constexpr,
                     HAS_PASS: tl.constexpr, INTERLEAVED: tl.constexpr, ROT_STREAM: tl.constexpr, PREC: tl.constexpr,
                     DOT_F32: tl.constexpr, ROT_STAT: tl.constexpr, HEAD_INNER: tl.constexpr):
    """Q: rotated copy of q unless ROT_STREAM (then q itself, rotated per tile). K: k, rotated here on load when
    ROT_STAT, else its rotated copy."""
    w, hk = _item_head(HKV, HEAD_INNER)
    b = tl.load(work + 2 * w)
    if b < 0:
        return
    tile = tl.load(work + 2 * w + 1)
    start = tl.load(offsets + b)
    length = tl.load(offsets + b + 1) - start
    n0 = tile * BLOCK_N
    offs_n = n0 + tl.arange(0, BLOCK_N)
    n_ok = offs_n < length
    k_row = (start + offs_n).to(tl.int64) * (HKV * D) + hk * D
    k1, k2, kp = _load_parts(K, k_row, n_ok, offs_n, block_size, cos_ptr, sin_ptr, half, rd, D, BLOCK_N, HALF_B,
                             PASS_B, ROPE, HAS_PASS, INTERLEAVED, ROT_STAT)
    d = tl.arange(0, D_B)
    d_ok = d < D
    v = tl.load(V + k_row[:, None] + d[None, :], mask=n_ok[:, None] & d_ok[None, :], other=0.0)
    # Query rows that see these keys: same block, and at or after the key when causal.
    n_last = tl.minimum(n0 + BLOCK_N, length) - 1
    b_first = n0 // block_size
    b_last = n_last // block_size
    if CAUSAL:
        lo = n0
    else:
        lo = b_first * block_size
    hi = tl.minimum((b_last + 1) * block_size, length)
    one_block = b_first == b_last
    # Checked: every q tile in [lo, hi) sees some key of this tile; only diagonal, ragged-end and straddling
    # tiles take the mask.
    dv = tl.zeros([BLOCK_N, D_B], dtype=tl.float32)
    dk1 = tl.zeros([BLOCK_N, HALF_B], dtype=tl.float32)
    dk2 = tl.zeros([BLOCK_N, HALF_B], dtype=tl.float32)
    dkp = tl.zeros([BLOCK_N, PASS_B], dtype=tl.float32)
    # Query tiles [m_a, m_b) need no mask: one block, past the diagonal (causal), not ragged at hi. The others run
    # in loops of their own, so the unmasked one carries no per-tile branch.
    m_a = lo
    if CAUSAL:
        m_a = lo + tl.cdiv(tl.maximum(n_last - lo, 0), BLOCK_M) * BLOCK_M
    m_b = tl.maximum(lo + (hi - lo) // BLOCK_M * BLOCK_M, m_a)
    m_a = tl.where(one_block, m_a, lo)
    m_b = tl.where(one_block, m_b, lo)
    for g in range(GROUP):
        h = hk * GROUP + g
        for m0 in range(lo, m_a, BLOCK_M):
            dv, dk1, dk2, dkp = _dkdv_tile(dv, dk1, dk2, dkp, k1, k2, kp, v, Q, DO, LSE, DELTA, start, h, m0, hi,
                                           offs_n, d, d_ok, cos_ptr, sin_ptr, qk_scale, T, block_size, half, rd, H,
                                           D, BLOCK_M, BLOCK_N, HALF_B, PASS_B, True, CAUSAL, ROPE, HAS_PASS,
                                           INTERLEAVED, ROT_STREAM, PREC, DOT_F32)
        for m0 in range(m_a, m_b, BLOCK_M):
            dv, dk1, dk2, dkp = _dkdv_tile(dv, dk1, dk2, dkp, k1, k2, kp, v, Q, DO, LSE, DELTA, start, h, m0, hi,
                                           offs_n, d, d_ok, cos_ptr, sin_ptr, qk_scale, T, block_size, half, rd, H,
                                           D, BLOCK_M, BLOCK_N, HALF_B, PASS_B, False, CAUSAL, ROPE, HAS_PASS,
                                           INTERLEAVED, ROT_STREAM, PREC, DOT_F32)
        for m0 in range(m_b, hi, BLOCK_M):
            dv, dk1, dk2, dkp = _dkdv_tile(dv, dk1, dk2, dkp, k1, k2, kp, v, Q, DO, LSE, DELTA, start, h, m0, hi,
                                           offs_n, d, d_ok, cos_ptr, sin_ptr, qk_scale, T, block_size, half, rd, H,
                                           D, BLOCK_M, BLOCK_N, HALF_B, PASS_B, True, CAUSAL, ROPE, HAS_PASS,
                                           INTERLEAVED, ROT_STREAM, PREC, DOT_F32)
    tl.store(DV + k_row[:, None] + d[None, :], dv.to(DV.dtype.element_ty), mask=n_ok[:, None] & d_ok[None, :])
    _store_parts(DK, k_row, n_ok, dk1 * sm_scale, dk2 * sm_scale, dkp * sm_scale, offs_n, block_size, cos_ptr, sin_ptr,
                 half, rd, D, HALF_B, PASS_B, ROPE, HAS_PASS, INTERLEAVED)


@triton.jit
def _dq_tile(dq1, dq2, dqp, q1, q2, qp, do, lse, delta, K, V, start, hk, n0, hi, offs_m, d, d_ok, cos_ptr, sin_ptr,
             qk_scale, block_size, half, rd, HKV: tl.constexpr, D: tl.constexpr,
             BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, HALF_B: tl.constexpr, PASS_B: tl.constexpr,
             MASK: tl.constexpr, CAUSAL: tl.constexpr, ROPE: tl.constexpr, HAS_PASS: tl.constexpr,
             INTERLEAVED: tl.constexpr, ROT_STREAM: tl.constexpr, PREC: tl.constexpr, DOT_F32: tl.constexpr):
    """dQ of a query tile += one key tile's share; MASK: diagonal, ragged-end or block-straddling tile."""
    offs_n = n0 + tl.arange(0, BLOCK_N)
    n_ok = offs_n < hi
    k_row = (start + offs_n).to(tl.int64) * (HKV * D) + hk * D
    k1, k2, kp = _load_parts(K, k_row, n_ok, offs_n, block_size, cos_ptr, sin_ptr, half, rd, D, BLOCK_N, HALF_B,
                             PASS_B, ROPE, HAS_PASS, INTERLEAVED, ROT_STREAM)
    v = tl.load(V + k_row[:, None] + d[None, :], mask=n_ok[:, None] & d_ok[None, :], other=0.0)
    s = _dot_parts(q1, q2, qp, k1, k2, kp, tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32), ROPE, HAS_PASS,
                   PREC, DOT_F32)
    s = s * qk_scale - lse[:, None]
    if MASK:
        allowed = ((offs_m[:, None] // block_size) == (offs_n[None, :] // block_size)) & n_ok[None, :]
        if CAUSAL:
            allowed = allowed & (offs_n[None, :] <= offs_m[:, None])
        s = tl.where(allowed, s, float("-inf"))
    p = tl.math.exp2(s)
    dp = _mm(do, tl.trans(v), tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32), PREC, DOT_F32)
    ds = (p * (dp - delta[:, None])).to(q1.dtype)
    if ROPE:
        dq1 = _mm(ds, k1, dq1, PREC, DOT_F32)
        dq2 = _mm(ds, k2, dq2, PREC, DOT_F32)
    if HAS_PASS:
        dqp = _mm(ds, kp, dqp, PREC, DOT_F32)
    return dq1, dq2, dqp


@triton.jit
def _bwd_dq_kernel(Q, K, V, O, DO, LSE, DELTA, DQ, offsets, work, cos_ptr, sin_ptr, qk_scale, sm_scale, T,
                   block_size, half, rd, H: tl.constexpr, HKV: tl.constexpr, D: tl.constexpr, GROUP: tl.constexpr,
                   D_B: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, HALF_B: tl.constexpr,
                   PASS_B: tl.constexpr, CAUSAL: tl.constexpr, ROPE: tl.constexpr, HAS_PASS: tl.constexpr,
                   INTERLEAVED: tl.constexpr, ROT_STREAM: tl.constexpr, PREC: tl.constexpr, DOT_F32: tl.constexpr,
                   ROT_STAT: tl.constexpr, HEAD_INNER: tl.constexpr):
    """K: rotated copy of k unless ROT_STREAM (then k itself, rotated per tile). Q: q, rotated here on load when
    ROT_STAT, else its rotated copy. Also
    computes and stores delta = rowsum(dO * O) of its rows, which it needs and the dK/dV pass (run after) reads."""
    w, h = _item_head(H, HEAD_INNER)
    b = tl.load(work + 2 * w)
    if b < 0:
        return
    tile = tl.load(work + 2 * w + 1)
    start = tl.load(offsets + b)
    length = tl.load(offsets + b + 1) - start
    hk = h // GROUP
    m0 = tile * BLOCK_M
    offs_m = m0 + tl.arange(0, BLOCK_M)
    m_ok = offs_m < length
    q_row = (start + offs_m).to(tl.int64) * (H * D) + h * D
    q1, q2, qp = _load_parts(Q, q_row, m_ok, offs_m, block_size, cos_ptr, sin_ptr, half, rd, D, BLOCK_M, HALF_B,
                             PASS_B, ROPE, HAS_PASS, INTERLEAVED, ROT_STAT)
    d = tl.arange(0, D_B)
    d_ok = d < D
    do = tl.load(DO + q_row[:, None] + d[None, :], mask=m_ok[:, None] & d_ok[None, :], other=0.0)
    r_off = h.to(tl.int64) * T + start + offs_m
    lse = tl.load(LSE + r_off, mask=m_ok, other=0.0)
    o = tl.load(O + q_row[:, None] + d[None, :], mask=m_ok[:, None] & d_ok[None, :], other=0.0)
    delta = tl.sum(o.to(tl.float32) * do.to(tl.float32), 1)
    tl.store(DELTA + r_off, delta, mask=m_ok)
    lo, hi, full_hi = _q_range(m0, length, block_size, BLOCK_M, CAUSAL)
    dq1 = tl.zeros([BLOCK_M, HALF_B], dtype=tl.float32)
    dq2 = tl.zeros([BLOCK_M, HALF_B], dtype=tl.float32)
    dqp = tl.zeros([BLOCK_M, PASS_B], dtype=tl.float32)
    n_full = lo + tl.maximum(full_hi - lo, 0) // BLOCK_N * BLOCK_N  # as in the forward: unmasked tiles first
    for n0 in range(lo, n_full, BLOCK_N):
        dq1, dq2, dqp = _dq_tile(dq1, dq2, dqp, q1, q2, qp, do, lse, delta, K, V, start, hk, n0, hi, offs_m, d, d_ok,
                                 cos_ptr, sin_ptr, qk_scale, block_size, half, rd, HKV, D,
                                 BLOCK_M, BLOCK_N, HALF_B, PASS_B, False, CAUSAL, ROPE, HAS_PASS, INTERLEAVED,
                                 ROT_STREAM, PREC, DOT_F32)
    for n0 in range(n_full, hi, BLOCK_N):
        dq1, dq2, dqp = _dq_tile(dq1, dq2, dqp, q1, q2, qp, do, lse, delta, K, V, start, hk, n0, hi, offs_m, d, d_ok,
                                 cos_ptr, sin_ptr, qk_scale, block_size, half, rd, HKV, D,
                                 BLOCK_M, BLOCK_N, HALF_B, PASS_B, True, CAUSAL, ROPE, HAS_PASS, INTERLEAVED,
                                 ROT_STREAM, PREC, DOT_F32)
    _store_parts(DQ, q_row, m_ok, dq1 * sm_scale, dq2 * sm_scale, dqp * sm_scale, offs_m, block_size, cos_ptr, sin_ptr,
                 half, rd, D, HALF_B, PASS_B, ROPE, HAS_PASS, INTERLEAVED)


# ----------------------------------------------------------------------------------------------------------------
# Host side


@triton.jit
def _work_kernel(offsets, cum, work, tile, BLOCK: tl.constexpr):
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


def work_table(offsets: torch.Tensor, tile: int, total: int) -> torch.Tensor:
    """int32 [W, 2] of (sequence, tile index), W = cdiv(total, tile) + B >= the real count; spare rows are (-1, -1).

    Built on device (a prefix sum and one small kernel), so no host sync and a grid size known from shapes alone.
    """
    nb = offsets.numel() - 1
    bound = max(1, cdiv(total, tile) + nb)
    work = torch.full((bound, 2), -1, dtype=torch.int32, device=offsets.device)
    if nb == 0:
        return work
    offsets = offsets.to(torch.int32)
    cum = torch.cumsum(torch.div(offsets.diff() + (tile - 1), tile, rounding_mode="floor"), 0, dtype=torch.int32)
    _work_kernel[(nb,)](offsets, cum, work, tile, BLOCK=16 if triton_interpreting() else 128)
    return work


def _prev_pow2(n: int) -> int:
    return 1 << (max(1, n).bit_length() - 1)


def _default_tiles(block_size: int, backward: bool) -> tuple[int, int]:
    """The pre-tuner heuristic (what GEM_BLOCK_AUTOTUNE=0 runs): tiles no taller than a block."""
    cap = 64 if backward else 128
    bm = max(16, min(cap, _prev_pow2(block_size)))
    return bm, max(16, min(64, bm))


# Candidate tiles (BLOCK_M, BLOCK_N), crossed with num_warps x num_stages below. dK/dV keeps a BLOCK_N key tile
# resident and streams BLOCK_M query tiles; dQ the reverse, so their useful shapes are mirrored.
FWD_TILES = ((128, 64), (64, 64), (64, 128), (128, 128))
DKDV_TILES = ((64, 64), (32, 64), (32, 128), (64, 128), (128, 128))
DQ_TILES = ((64, 64), (128, 32), (128, 64), (128, 128))


def configs(kind: str, block_size: int) -> list[tuple[int, ...]]:
    """(BLOCK_M, BLOCK_N, num_warps, num_stages[, maxnreg]) candidates for kind in fwd/dkdv/dq; the first is the
    default.

    Tiles are clamped to max(16, next_pow2(block_size)) (larger ones only add masked-out work in block-local
    attention) and deduplicated. Under the interpreter: one small config, so CPU tests stay fast.
    """
    if triton_interpreting():
        return [(16, 16, 4, 1)]
    cap = max(16, next_pow2(block_size))
    tiles = {"fwd": FWD_TILES, "dkdv": DKDV_TILES, "dq": DQ_TILES}[kind]
    bm, bn = _default_tiles(block_size, kind != "fwd")
    # The backward holds more per thread (two accumulators, K/V or q/dO, RoPE tables): at D 128 with RoPE ptxas
    # spills 190-1600 bytes per thread in 4-warp backward tiles, less on 8 warps (session 11: the dK/dV
    # default 64x64 still spills 440 bytes with pre-rotated RoPE, 88 without; the tuner times the rest).
    def warps(m, n):
        return 8 if kind != "fwd" or m * n >= 128 * 64 else 4

    out = [(bm, bn, warps(bm, bn), 3)]  # default warps/stages: a guess, not measured
    # One warps count per tile and two stages (plus the few extras below): every candidate costs a compile per key,
    # in the first training step.
    for tm, tn in tiles:
        tm, tn = min(tm, cap), min(tn, cap)
        cfg = (tm, tn, warps(tm, tn), 2)
        if cfg not in out:
            out.append(cfg)
    # JFA's tuner picks on the H200, for the same short causal loops: a 4-warp 3-stage backward tile (session 14),
    # two programs per SM; and a forward 8-warp tile capped at 128 registers (5th entry: maxnreg; session 15), so
    # that two programs share an SM (uncapped, an 8-warp D 128 program takes the whole register file). Both won
    # their block-512 keys in session 15 (docs/PERF.md).
    extra = {"fwd": ((128, 64, 8, 2, 128),), "dkdv": ((32, 64, 4, 3),), "dq": ((64, 64, 4, 3),)}[kind]
    for cfg in extra:
        cfg = (min(cfg[0], cap), min(cfg[1], cap)) + cfg[2:]
        if cfg not in out:
            out.append(cfg)
    return out


_TUNER = ConfigTuner("gem.ops.block", "GEM_BLOCK_AUTOTUNE")


ROPE_STREAM_MODES = ("prerotated", "inkernel")


def rope_stream_mode() -> str:
    """GEM_BLOCK_ROPE_STREAM, read per call (benchmarks switch it): how the streamed q/k tiles get rotated."""
    mode = os.environ.get("GEM_BLOCK_ROPE_STREAM", "prerotated")
    if mode not in ROPE_STREAM_MODES:
        raise ValueError(f"GEM_BLOCK_ROPE_STREAM={mode!r}: expected one of {ROPE_STREAM_MODES}")
    return mode


HEAD_ORDERS = ("outer", "inner")


def head_order() -> str:
    """GEM_BLOCK_HEAD_ORDER, read per call: "inner" (default) runs the heads of one tile side by side (a flat grid),
    so that they share the tile's K/V and RoPE table rows in L2; "outer" runs every tile of head 0, then head 1, ...
    (a (W, H) grid). Inner was 0.4-1.7% faster by device time at L 1K-64K (H200, sessions 16-17, docs/PERF.md)."""
    order = os.environ.get("GEM_BLOCK_HEAD_ORDER", "inner")
    if order not in HEAD_ORDERS:
        raise ValueError(f"GEM_BLOCK_HEAD_ORDER={order!r}: expected one of {HEAD_ORDERS}")
    return order


def _grid(items: int, heads: int, inner: bool) -> tuple:
    return (items * heads,) if inner else (items, heads)


BWD_STATIONARY_MODES = ("copy", "rotate")


def bwd_stationary_mode() -> str:
    """GEM_BLOCK_BWD_STATIONARY, read per call: how the backward passes get their stationary tile rotated when the
    streamed ones come from rotated copies: read from those copies (copy, default) or rotated on load (rotate)."""
    mode = os.environ.get("GEM_BLOCK_BWD_STATIONARY", "copy")
    if mode not in BWD_STATIONARY_MODES:
        raise ValueError(f"GEM_BLOCK_BWD_STATIONARY={mode!r}: expected one of {BWD_STATIONARY_MODES}")
    return mode


def _tune_key(q, k, block_size, causal, rotary_dim, interleaved, stream) -> tuple:
    _, h, d = q.shape
    # block_size exactly (few distinct values per model); not T: a new batch size must not re-tune. The stream
    # mode changes the kernels' inner loops, so each mode is tuned on its own (no mode without rope).
    return (d, q.dtype, block_size, causal, rotary_dim > 0, d > rotary_dim, interleaved, h, h // k.shape[1],
            stream if rotary_dim > 0 else None, head_order())


class _Tables:
    """Per-batch tables of one offsets tensor: work tables per tile height and the rope token positions, each built
    on first use. One instance per offsets tensor (gem.ops._common.offsets_cached, GEM_BLOCK_WORK_CACHE=0: one per
    call), so the layers of a model, the backward and the tuner's timed configs share them for one cache lookup.
    It keeps no reference to the offsets (the cache holds it under a weak key; a value that referenced the key would
    keep it alive): callers pass them to each method."""

    def __init__(self, total):
        self.total, self.cache, self.pos = total, {}, {}

    def work(self, offsets32, tile):
        table = self.cache.get(tile)
        if table is None:
            table = self.cache[tile] = work_table(offsets32, tile, self.total)
        return table

    def positions(self, offsets, block_size):
        """Each token's position within its block (the rope op's per-sequence positions mod block_size)."""
        pos = self.pos.get(block_size)
        if pos is None:
            pos = self.pos[block_size] = positions_cached(offsets, self.total) % block_size
        return pos

    @staticmethod
    def of(offsets, total):
        return offsets_cached("_gem_block_tables", "GEM_BLOCK_WORK_CACHE", offsets, offsets, (int(total),),
                              lambda: _Tables(total))


_DUMMY: dict = {}


def _rope_rows(max_len: int, block_size: int) -> int:
    """cos/sin rows the kernels index: positions within a block (see _rotated)."""
    return max(1, min(max_len, block_size))


def _rope_tables(rotary_dim: int, base: float, rows: int, device):
    if rotary_dim == 0:
        key = str(device)
        if key not in _DUMMY:
            _DUMMY[key] = torch.zeros(1, dtype=torch.float32, device=device)
        return _DUMMY[key], _DUMMY[key]
    return cos_sin_table(rows, rotary_dim, base, device)


_METAS: dict = {}


def _meta(q, k, rotary_dim, interleaved, causal, stream):
    key = (q.shape[1], k.shape[1], q.shape[2], q.dtype, rotary_dim, interleaved, causal, stream,
           triton_interpreting())
    meta = _METAS.get(key)
    if meta is None:
        meta = _METAS[key] = _make_meta(q, k, rotary_dim, interleaved, causal, stream)
    return meta


def _make_meta(q, k, rotary_dim, interleaved, causal, stream):
    d = q.shape[2]
    half = rotary_dim // 2
    return dict(  # noqa: C408 -- kernel meta-parameters read best as keywords
        H=q.shape[1], HKV=k.shape[1], D=d, GROUP=q.shape[1] // k.shape[1], D_B=next_pow2(d),
        HALF_B=max(16, next_pow2(max(half, 1))),
        PASS_B=max(16, next_pow2(max(d - rotary_dim, 1))),
        CAUSAL=causal, ROPE=rotary_dim > 0, HAS_PASS=d > rotary_dim, INTERLEAVED=interleaved,
        ROT_STREAM=rotary_dim > 0 and stream == "inkernel",
        PREC="ieee" if q.dtype == torch.float32 else "tf32",
        DOT_F32=triton_interpreting() and q.dtype == torch.bfloat16,
    )


def _rotated(x, tables, offsets, max_len, block_size, rope_base, rotary_dim, interleaved, stream):
    """The copy of x that a kernel streams: x rotated by one rope-kernel pass (a temporary), or x itself when the
    kernel rotates streamed tiles (inkernel) or there is no rope.

    Every rotation here (copies and in-kernel) is by the position within the block, not within the sequence: a
    RoPE score depends only on the distance j - i, and blocks start at sequence starts, so both give the same
    attention. The cos/sin rows read are then at most block_size (256 KB at 512 x 64 fp32 pairs) and stay in L2,
    where a 62K-token sequence read 32 MB of tables."""
    if rotary_dim == 0 or stream == "inkernel":
        return x
    return _rope_triton(x, offsets, _rope_rows(max_len, block_size), rope_base, rotary_dim, interleaved, False,
                        tables.positions(offsets, block_size))


def _fwd(q, k, v, offsets, max_len, block_size, causal, scale, rope_base, rotary_dim, interleaved):
    return _fwd_keep(q, k, v, offsets, max_len, block_size, causal, scale, rope_base, rotary_dim, interleaved)[:2]


def _fwd_keep(q, k, v, offsets, max_len, block_size, causal, scale, rope_base, rotary_dim, interleaved):
    """(o, lse, K_rot): K_rot is the rotated copy of k the forward streamed, None when it streamed k itself."""
    stream = rope_stream_mode()
    bwd_stationary_mode()  # a bad GEM_BLOCK_BWD_STATIONARY fails here, before any work
    t, h, _ = q.shape
    o = torch.empty_like(q)
    lse = torch.empty((h, t), dtype=torch.float32, device=q.device)
    if t == 0 or offsets.numel() < 2:
        return o.zero_(), lse.zero_(), None
    tables = _Tables.of(offsets, t)
    user, offsets = offsets, offsets.to(torch.int32)
    cos, sin = _rope_tables(rotary_dim, rope_base, _rope_rows(max_len, block_size), q.device)
    meta = _meta(q, k, rotary_dim, interleaved, causal, stream)
    k_s = _rotated(k, tables, user, max_len, block_size, rope_base, rotary_dim, interleaved, stream)  # streamed
    inner = head_order() == "inner"

    def launch(cfg):
        bm, bn, warps, stages = cfg[:4]
        work = tables.work(offsets, bm)
        _fwd_kernel[_grid(work.shape[0], h, inner)](
            q, k_s, v, o, lse, offsets, work, cos, sin, scale * _LOG2E, t, block_size, rotary_dim // 2, rotary_dim,
            BLOCK_M=bm, BLOCK_N=bn, num_warps=warps, num_stages=stages, HEAD_INNER=inner, **reg_cap(cfg), **meta)

    key = _tune_key(q, k, block_size, causal, rotary_dim, interleaved, stream)
    launch(_TUNER.pick("fwd", key, lambda: configs("fwd", block_size), launch, q.device))
    return o, lse, (k_s if k_s is not k else None)


def _bwd(do, q, k, v, o, lse, offsets, max_len, block_size, causal, scale, rope_base, rotary_dim, interleaved,
         k_rot=None):
    """k_rot: the forward's rotated copy of k (pre-rotated streaming only), reused instead of a rope pass."""
    stream = rope_stream_mode()
    t, h, _ = q.shape
    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    if t == 0 or offsets.numel() < 2:
        return dq.zero_(), dk.zero_(), dv.zero_()
    do = do.contiguous()
    tables = _Tables.of(offsets, t)
    user, offsets = offsets, offsets.to(torch.int32)
    delta = torch.empty_like(lse)  # written by the dQ pass
    cos, sin = _rope_tables(rotary_dim, rope_base, _rope_rows(max_len, block_size), q.device)
    meta = _meta(q, k, rotary_dim, interleaved, causal, stream)
    args = (cos, sin, scale * _LOG2E, scale, t, block_size, rotary_dim // 2, rotary_dim)

    # Stationary tiles: rotated on load (GEM_BLOCK_BWD_STATIONARY=rotate), or read from the same rotated copies the
    # other pass streams (copy, the default with pre-rotated streaming): only dQ/dK's inverse rotation stays.
    stat = bwd_stationary_mode() if rotary_dim > 0 and stream == "prerotated" else "rotate"
    inner = head_order() == "inner"

    # The two passes are independent kernels (each only stores its own outputs), so each is tuned on its own.
    def dkdv(cfg, q_s, k_t):
        bm, bn, warps, stages = cfg[:4]
        work = tables.work(offsets, bn)  # one program per key tile
        _bwd_dkdv_kernel[_grid(work.shape[0], k.shape[1], inner)](
            q_s, k_t, v, do, lse, delta, dk, dv, offsets, work, *args, BLOCK_M=bm, BLOCK_N=bn, num_warps=warps,
            num_stages=stages, ROT_STAT=stat == "rotate", HEAD_INNER=inner, **reg_cap(cfg), **meta)

    def dq_pass(cfg, q_t, k_s):
        bm, bn, warps, stages = cfg[:4]
        work = tables.work(offsets, bm)  # one program per query tile
        _bwd_dq_kernel[_grid(work.shape[0], h, inner)](
            q_t, k_s, v, o, do, lse, delta, dq, offsets, work, *args, BLOCK_M=bm, BLOCK_N=bn, num_warps=warps,
            num_stages=stages, ROT_STAT=stat == "rotate", HEAD_INNER=inner, **reg_cap(cfg), **meta)

    key = _tune_key(q, k, block_size, causal, rotary_dim, interleaved, stream) + (stat,)
    rot = (tables, user, max_len, block_size, rope_base, rotary_dim, interleaved, stream)
    # K_rot: the eager forward's (k-sized, small under GQA), else made here. Q_rot is recomputed, not saved by the
    # forward (activation memory weighs more than a ~35 us pass): with stat "rotate" only after the dQ pass (which
    # writes delta) is done, so a recomputed K_rot is freed first; with "copy" before it, as the dQ pass reads it.
    k_s = k_rot if k_rot is not None and stream == "prerotated" else _rotated(k, *rot)
    q_s = _rotated(q, *rot) if stat == "copy" else None
    run = functools.partial(dq_pass, q_t=q if q_s is None else q_s, k_s=k_s)
    run(_TUNER.pick("dq", key, lambda: configs("dq", block_size), run, q.device))
    if q_s is None:
        del run, k_s  # frees a recomputed K_rot before Q_rot is made
        k_s = None
        q_s = _rotated(q, *rot)
    run = functools.partial(dkdv, q_s=q_s, k_t=k if k_s is None else k_s)
    run(_TUNER.pick("dkdv", key, lambda: configs("dkdv", block_size), run, q.device))
    return dq, dk, dv


@torch.library.custom_op("gem::block_attention_fwd", mutates_args=())
def _fwd_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, offsets: torch.Tensor, max_len: int,
            block_size: int, causal: bool, scale: float, rope_base: float, rotary_dim: int,
            interleaved: bool) -> tuple[torch.Tensor, torch.Tensor]:
    return _fwd(q, k, v, offsets, max_len, block_size, causal, scale, rope_base, rotary_dim, interleaved)


@_fwd_op.register_fake
def _(q, k, v, offsets, max_len, block_size, causal, scale, rope_base, rotary_dim, interleaved):
    return torch.empty_like(q), q.new_empty((q.shape[1], q.shape[0]), dtype=torch.float32)


@torch.library.custom_op("gem::block_attention_bwd", mutates_args=())
def _bwd_op(do: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, o: torch.Tensor,
            lse: torch.Tensor, offsets: torch.Tensor, max_len: int, block_size: int, causal: bool, scale: float,
            rope_base: float, rotary_dim: int, interleaved: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return _bwd(do, q, k, v, o, lse, offsets, max_len, block_size, causal, scale, rope_base, rotary_dim,
                interleaved)


@_bwd_op.register_fake
def _(do, q, k, v, o, lse, offsets, max_len, block_size, causal, scale, rope_base, rotary_dim, interleaved):
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


def _setup(ctx, inputs, output):
    q, k, v, offsets, *rest = inputs
    o, lse = output
    ctx.save_for_backward(q, k, v, o, lse, offsets)
    ctx.rest = rest
    ctx.mark_non_differentiable(lse)


def _backward(ctx, do, _dlse):
    q, k, v, o, lse, offsets = ctx.saved_tensors
    dq, dk, dv = _bwd_op(do, q, k, v, o, lse, offsets, *ctx.rest)
    return dq, dk, dv, None, None, None, None, None, None, None, None


_fwd_op.register_autograd(_backward, setup_context=_setup)


class _BlockAttentionFn(torch.autograd.Function):
    """Eager path: same kernels as the custom op, without its per-call dispatch overhead (tens of microseconds,
    comparable to a whole forward at 64K tokens). With pre-rotated RoPE it also keeps the forward's K_rot for the
    dQ pass (one k-sized activation more, one rope pass less; RoPE as a separate op keeps both rotated q and k)."""

    @staticmethod
    def forward(ctx, q, k, v, offsets, *rest):
        with eager_tables():
            o, lse, k_rot = _fwd_keep(q, k, v, offsets, *rest)
        ctx.save_for_backward(q, k, v, o, lse, offsets, k_rot)
        ctx.rest = rest
        return o

    @staticmethod
    def backward(ctx, do):
        q, k, v, o, lse, offsets, k_rot = ctx.saved_tensors
        with eager_tables():
            dq, dk, dv = _bwd(do, q, k, v, o, lse, offsets, *ctx.rest, k_rot=k_rot)
        return (dq, dk, dv) + (None,) * (1 + len(ctx.rest))


def block_attention_triton(q, k, v, offsets, max_len, *, block_size, causal=True, rope: RopeConfig | None = None,
                           scale=None):
    """Triton path of gem.ops.block.block_attention (inputs already validated)."""
    d = q.shape[2]
    scale = 1.0 / math.sqrt(d) if scale is None else float(scale)
    rd = rope.resolve_dim(d) if rope is not None else 0
    base = float(rope.base) if rope is not None else 10000.0
    interleaved = bool(rope.interleaved) if rope is not None else False
    args = (q.contiguous(), k.contiguous(), v.contiguous(), offsets, int(max_len), int(block_size), bool(causal),
            scale, base, rd, interleaved)
    if torch.compiler.is_compiling():  # the custom op lets torch.compile trace around the kernels
        return _fwd_op(*args)[0]
    return _BlockAttentionFn.apply(*args)
