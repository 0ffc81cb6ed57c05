"""Triton kernels for BlockAttention (gem.ops.block), forward and backward, with RoPE fused into tile loads.

Work is a device-built int32 table of (sequence, tile) items, so the grid depends only on T and B (no host sync).
Forward: one program per (q tile, head); a q tile visits only K tiles of its own block(s), up to the diagonal when
causal. Tiles wholly inside the allowed region skip the mask; the others mask by block id / causal / length, which
also covers block_size < tile. Online softmax in fp32 with exp2; the log2-domain lse is kept for the backward.
Backward, deterministic and without atomics (FlashAttention-2 style): one program per (q tile, head) for dQ, which
also writes delta = rowsum(dO * O) of its rows, then one program per (K tile, kv head) accumulating dK/dV over the
q heads of its group and the q tiles of its block; P and dP are recomputed in each (7 tile matmuls per (q tile, key
tile) pair).

RoPE: q/k tiles are loaded as the two rotary halves (+ the pass-through channels), so QK^T is the sum of two or
three tl.dot calls over the parts; dQ/dK are accumulated per part (w.r.t. the rotated q/k) and inversely rotated
before the store. The forward's stationary operand (q) is rotated in registers on load, once per program; the
backward passes read theirs (q in dQ, k in dK/dV) from the rotated copies the other pass streams. The streamed
operand (k tiles in the forward and dQ pass, q tiles in dK/dV) is read from a rotated copy that a rope-kernel pass
writes: K_rot in the forward (kept for the dQ pass by the eager path, recomputed under torch.compile) and Q_rot in
the backward (never saved). Rotating every streamed tile in the inner loop instead would load cos/sin twice the
tile's bytes, plus math between load and tl.dot, per tile: slower on the H200.
All rotations use the position within the block (scores depend only on j - i, and blocks start at sequence
starts), so the cos/sin rows read stay within block_size however long the sequence.

Tiles (BLOCK_M, BLOCK_N) and num_warps/num_stages are picked per kernel by a small host-side tuner (gem.ops._tune),
since the work table, hence the grid, depends on the tile height.
"""

from __future__ import annotations

import functools
import math
from typing import Optional

import torch
import triton
import triton.language as tl

from gem.ops._common import cached, next_pow2, triton_interpreting
from gem.ops._register import KernelOp
from gem.ops._tune import ConfigTuner, LaunchConfig, attention_pass_smem, tile_config
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
from gem.ops.triton_utils import dot_acc, dot_prec, work_table

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
def _dot_parts(a1, a2, ap, b1, b2, bp, acc, ROPE: tl.constexpr, HAS_PASS: tl.constexpr, DOT_PREC: tl.constexpr):
    """acc + A @ B^T with A, B given as (half 1, half 2, pass) parts."""
    if ROPE:
        acc = dot_acc(a1, tl.trans(b1), acc, DOT_PREC)
        acc = dot_acc(a2, tl.trans(b2), acc, DOT_PREC)
    if HAS_PASS:
        acc = dot_acc(ap, tl.trans(bp), acc, DOT_PREC)
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
def _work_item(work, NH: tl.constexpr):
    """(work row, head, sequence) of this program on a flat grid whose NH programs of one work item are adjacent,
    so they meet its K/V and RoPE table rows in L2. Sequence -1: a spare row."""
    pid = tl.program_id(0)
    w = pid // NH
    return w, pid % NH, tl.load(work + 2 * w)


@triton.jit
def _tile_rows(work, w, offsets, b, head, NH: tl.constexpr, D: tl.constexpr, BLOCK: tl.constexpr):
    """Sequence start and length of work row w, its tile's first row, rows, in-sequence mask and row offsets of
    `head` in a [T, NH, D] tensor."""
    tile = tl.load(work + 2 * w + 1)
    start = tl.load(offsets + b)
    length = tl.load(offsets + b + 1) - start
    r0 = tile * BLOCK
    offs = r0 + tl.arange(0, BLOCK)
    ok = offs < length
    row = (start + offs).to(tl.int64) * (NH * D) + head * D
    return start, length, r0, offs, ok, row


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
              ROPE: tl.constexpr, HAS_PASS: tl.constexpr, INTERLEAVED: tl.constexpr,
              DOT_PREC: tl.constexpr):
    """One key tile of the online softmax; MASK: diagonal, ragged-end or block-straddling tile."""
    offs_n = n0 + tl.arange(0, BLOCK_N)
    n_ok = offs_n < hi
    k_row = (start + offs_n).to(tl.int64) * (HKV * D) + hk * D
    k1, k2, kp = _load_parts(K, k_row, n_ok, offs_n, block_size, cos_ptr, sin_ptr, half, rd, D, BLOCK_N, HALF_B,
                             PASS_B, ROPE, HAS_PASS, INTERLEAVED, False)
    s = _dot_parts(q1, q2, qp, k1, k2, kp, tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32), ROPE, HAS_PASS, DOT_PREC)
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
    acc = dot_acc(p.to(v.dtype), v, acc, DOT_PREC)
    return m_new, l_i, acc


@triton.jit
def _fwd_kernel(Q, K, V, O, LSE, offsets, work, cos_ptr, sin_ptr, qk_scale, T, block_size, half, rd,
                H: tl.constexpr, HKV: tl.constexpr, D: tl.constexpr, GROUP: tl.constexpr, D_B: tl.constexpr,
                BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, HALF_B: tl.constexpr, PASS_B: tl.constexpr,
                CAUSAL: tl.constexpr, ROPE: tl.constexpr, HAS_PASS: tl.constexpr, INTERLEAVED: tl.constexpr,
                DOT_PREC: tl.constexpr):
    """K: the rotated copy of k (with RoPE)."""
    w, h, b = _work_item(work, H)
    if b < 0:
        return
    start, length, m0, offs_m, m_ok, q_row = _tile_rows(work, w, offsets, b, h, H, D, BLOCK_M)
    hk = h // GROUP
    # the stationary q tile, rotated on load (ROTATE): once per program
    q1, q2, qp = _load_parts(Q, q_row, m_ok, offs_m, block_size, cos_ptr, sin_ptr, half, rd, D, BLOCK_M,
                             HALF_B, PASS_B, ROPE, HAS_PASS, INTERLEAVED, ROTATE=True)
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
                                  PASS_B, False, CAUSAL, ROPE, HAS_PASS, INTERLEAVED, DOT_PREC)
    for n0 in range(n_full, hi, BLOCK_N):
        m_i, l_i, acc = _fwd_tile(m_i, l_i, acc, q1, q2, qp, K, V, start, hk, n0, hi, offs_m, d, d_ok, cos_ptr,
                                  sin_ptr, qk_scale, block_size, half, rd, HKV, D, BLOCK_M, BLOCK_N, HALF_B,
                                  PASS_B, True, CAUSAL, ROPE, HAS_PASS, INTERLEAVED, DOT_PREC)
    l_safe = tl.where(l_i > 0.0, l_i, 1.0)
    acc = acc / l_safe[:, None]
    tl.store(O + q_row[:, None] + d[None, :], acc.to(O.dtype.element_ty), mask=m_ok[:, None] & d_ok[None, :])
    tl.store(LSE + h.to(tl.int64) * T + start + offs_m, m_i + tl.math.log2(l_safe), mask=m_ok)


@triton.jit
def _dkdv_tile(dv, dk1, dk2, dkp, k1, k2, kp, v, Q, DO, LSE, DELTA, start, h, m0, hi, offs_n, d, d_ok, cos_ptr,
               sin_ptr, qk_scale, T, block_size, half, rd, H: tl.constexpr, D: tl.constexpr, BLOCK_M: tl.constexpr,
               BLOCK_N: tl.constexpr, HALF_B: tl.constexpr, PASS_B: tl.constexpr, MASK: tl.constexpr,
               CAUSAL: tl.constexpr, ROPE: tl.constexpr, HAS_PASS: tl.constexpr, INTERLEAVED: tl.constexpr,
               DOT_PREC: tl.constexpr):
    """dK, dV of a key tile += one query tile's share (query rows < hi). MASK: diagonal, ragged-end or
    block-straddling tile. Key rows past the sequence end make garbage rows of dK/dV that are never stored."""
    offs_m = m0 + tl.arange(0, BLOCK_M)
    m_ok = offs_m < hi
    q_row = (start + offs_m).to(tl.int64) * (H * D) + h * D
    q1, q2, qp = _load_parts(Q, q_row, m_ok, offs_m, block_size, cos_ptr, sin_ptr, half, rd, D, BLOCK_M, HALF_B,
                             PASS_B, ROPE, HAS_PASS, INTERLEAVED, False)
    r_off = h.to(tl.int64) * T + start + offs_m
    lse = tl.load(LSE + r_off, mask=m_ok, other=0.0)
    delta = tl.load(DELTA + r_off, mask=m_ok, other=0.0)
    s_t = _dot_parts(k1, k2, kp, q1, q2, qp, tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32), ROPE, HAS_PASS, DOT_PREC)
    s_t = s_t * qk_scale - lse[None, :]
    if MASK:
        allowed = ((offs_n[:, None] // block_size) == (offs_m[None, :] // block_size)) & m_ok[None, :]
        if CAUSAL:
            allowed = allowed & (offs_n[:, None] <= offs_m[None, :])
        s_t = tl.where(allowed, s_t, float("-inf"))
    p_t = tl.math.exp2(s_t)
    do = tl.load(DO + q_row[:, None] + d[None, :], mask=m_ok[:, None] & d_ok[None, :], other=0.0)
    dv = dot_acc(p_t.to(do.dtype), do, dv, DOT_PREC)
    dp_t = dot_acc(v, tl.trans(do), tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32), DOT_PREC)
    ds_t = (p_t * (dp_t - delta[None, :])).to(q1.dtype)
    if ROPE:
        dk1 = dot_acc(ds_t, q1, dk1, DOT_PREC)
        dk2 = dot_acc(ds_t, q2, dk2, DOT_PREC)
    if HAS_PASS:
        dkp = dot_acc(ds_t, qp, dkp, DOT_PREC)
    return dv, dk1, dk2, dkp


@triton.jit
def _bwd_dkdv_kernel(Q, K, V, DO, LSE, DELTA, DK, DV, offsets, work, cos_ptr, sin_ptr, qk_scale, sm_scale, T,
                     block_size, half, rd, H: tl.constexpr, HKV: tl.constexpr, D: tl.constexpr,
                     GROUP: tl.constexpr, D_B: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                     HALF_B: tl.constexpr, PASS_B: tl.constexpr, CAUSAL: tl.constexpr, ROPE: tl.constexpr,
                     HAS_PASS: tl.constexpr, INTERLEAVED: tl.constexpr, DOT_PREC: tl.constexpr):
    """Q, K: the rotated copies of q and k (with RoPE)."""
    w, hk, b = _work_item(work, HKV)
    if b < 0:
        return
    start, length, n0, offs_n, n_ok, k_row = _tile_rows(work, w, offsets, b, hk, HKV, D, BLOCK_N)
    k1, k2, kp = _load_parts(K, k_row, n_ok, offs_n, block_size, cos_ptr, sin_ptr, half, rd, D, BLOCK_N, HALF_B,
                             PASS_B, ROPE, HAS_PASS, INTERLEAVED, False)
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
                                           INTERLEAVED, DOT_PREC)
        for m0 in range(m_a, m_b, BLOCK_M):
            dv, dk1, dk2, dkp = _dkdv_tile(dv, dk1, dk2, dkp, k1, k2, kp, v, Q, DO, LSE, DELTA, start, h, m0, hi,
                                           offs_n, d, d_ok, cos_ptr, sin_ptr, qk_scale, T, block_size, half, rd, H,
                                           D, BLOCK_M, BLOCK_N, HALF_B, PASS_B, False, CAUSAL, ROPE, HAS_PASS,
                                           INTERLEAVED, DOT_PREC)
        for m0 in range(m_b, hi, BLOCK_M):
            dv, dk1, dk2, dkp = _dkdv_tile(dv, dk1, dk2, dkp, k1, k2, kp, v, Q, DO, LSE, DELTA, start, h, m0, hi,
                                           offs_n, d, d_ok, cos_ptr, sin_ptr, qk_scale, T, block_size, half, rd, H,
                                           D, BLOCK_M, BLOCK_N, HALF_B, PASS_B, True, CAUSAL, ROPE, HAS_PASS,
                                           INTERLEAVED, DOT_PREC)
    tl.store(DV + k_row[:, None] + d[None, :], dv.to(DV.dtype.element_ty), mask=n_ok[:, None] & d_ok[None, :])
    _store_parts(DK, k_row, n_ok, dk1 * sm_scale, dk2 * sm_scale, dkp * sm_scale, offs_n, block_size, cos_ptr, sin_ptr,
                 half, rd, D, HALF_B, PASS_B, ROPE, HAS_PASS, INTERLEAVED)


@triton.jit
def _dq_tile(dq1, dq2, dqp, q1, q2, qp, do, lse, delta, K, V, start, hk, n0, hi, offs_m, d, d_ok, cos_ptr, sin_ptr,
             qk_scale, block_size, half, rd, HKV: tl.constexpr, D: tl.constexpr,
             BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, HALF_B: tl.constexpr, PASS_B: tl.constexpr,
             MASK: tl.constexpr, CAUSAL: tl.constexpr, ROPE: tl.constexpr, HAS_PASS: tl.constexpr,
             INTERLEAVED: tl.constexpr, DOT_PREC: tl.constexpr):
    """dQ of a query tile += one key tile's share; MASK: diagonal, ragged-end or block-straddling tile."""
    offs_n = n0 + tl.arange(0, BLOCK_N)
    n_ok = offs_n < hi
    k_row = (start + offs_n).to(tl.int64) * (HKV * D) + hk * D
    k1, k2, kp = _load_parts(K, k_row, n_ok, offs_n, block_size, cos_ptr, sin_ptr, half, rd, D, BLOCK_N, HALF_B,
                             PASS_B, ROPE, HAS_PASS, INTERLEAVED, False)
    v = tl.load(V + k_row[:, None] + d[None, :], mask=n_ok[:, None] & d_ok[None, :], other=0.0)
    s = _dot_parts(q1, q2, qp, k1, k2, kp, tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32), ROPE, HAS_PASS,
                   DOT_PREC)
    s = s * qk_scale - lse[:, None]
    if MASK:
        allowed = ((offs_m[:, None] // block_size) == (offs_n[None, :] // block_size)) & n_ok[None, :]
        if CAUSAL:
            allowed = allowed & (offs_n[None, :] <= offs_m[:, None])
        s = tl.where(allowed, s, float("-inf"))
    p = tl.math.exp2(s)
    dp = dot_acc(do, tl.trans(v), tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32), DOT_PREC)
    ds = (p * (dp - delta[:, None])).to(q1.dtype)
    if ROPE:
        dq1 = dot_acc(ds, k1, dq1, DOT_PREC)
        dq2 = dot_acc(ds, k2, dq2, DOT_PREC)
    if HAS_PASS:
        dqp = dot_acc(ds, kp, dqp, DOT_PREC)
    return dq1, dq2, dqp


@triton.jit
def _bwd_dq_kernel(Q, K, V, O, DO, LSE, DELTA, DQ, offsets, work, cos_ptr, sin_ptr, qk_scale, sm_scale, T,
                   block_size, half, rd, H: tl.constexpr, HKV: tl.constexpr, D: tl.constexpr, GROUP: tl.constexpr,
                   D_B: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, HALF_B: tl.constexpr,
                   PASS_B: tl.constexpr, CAUSAL: tl.constexpr, ROPE: tl.constexpr, HAS_PASS: tl.constexpr,
                   INTERLEAVED: tl.constexpr, DOT_PREC: tl.constexpr):
    """Q, K: the rotated copies of q and k (with RoPE). Also computes and stores delta = rowsum(dO * O) of its rows,
    which it needs and the dK/dV pass (run after) reads."""
    w, h, b = _work_item(work, H)
    if b < 0:
        return
    start, length, m0, offs_m, m_ok, q_row = _tile_rows(work, w, offsets, b, h, H, D, BLOCK_M)
    hk = h // GROUP
    q1, q2, qp = _load_parts(Q, q_row, m_ok, offs_m, block_size, cos_ptr, sin_ptr, half, rd, D, BLOCK_M, HALF_B,
                             PASS_B, ROPE, HAS_PASS, INTERLEAVED, False)
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
                                 DOT_PREC)
    for n0 in range(n_full, hi, BLOCK_N):
        dq1, dq2, dqp = _dq_tile(dq1, dq2, dqp, q1, q2, qp, do, lse, delta, K, V, start, hk, n0, hi, offs_m, d, d_ok,
                                 cos_ptr, sin_ptr, qk_scale, block_size, half, rd, HKV, D,
                                 BLOCK_M, BLOCK_N, HALF_B, PASS_B, True, CAUSAL, ROPE, HAS_PASS, INTERLEAVED,
                                 DOT_PREC)
    _store_parts(DQ, q_row, m_ok, dq1 * sm_scale, dq2 * sm_scale, dqp * sm_scale, offs_m, block_size, cos_ptr, sin_ptr,
                 half, rd, D, HALF_B, PASS_B, ROPE, HAS_PASS, INTERLEAVED)


# ----------------------------------------------------------------------------------------------------------------
# Host side


def _prev_pow2(n: int) -> int:
    return 1 << (max(1, n).bit_length() - 1)


def _default_tiles(block_size: int, backward: bool) -> tuple[int, int]:
    """The pre-tuner heuristic (what GEM_AUTOTUNE=0 runs): tiles no taller than a block."""
    cap = 64 if backward else 128
    bm = max(16, min(cap, _prev_pow2(block_size)))
    return bm, max(16, min(64, bm))


# Candidate tiles (BLOCK_M, BLOCK_N), crossed with num_warps x num_stages below. dK/dV keeps a BLOCK_N key tile
# resident and streams BLOCK_M query tiles; dQ the reverse, so their useful shapes are mirrored.
FWD_TILES = ((128, 64), (64, 64), (64, 128), (128, 128))
DKDV_TILES = ((64, 64), (32, 64), (32, 128), (64, 128), (128, 128))
DQ_TILES = ((64, 64), (128, 32), (128, 64), (128, 128))


def configs(kind: str, block_size: int) -> list[LaunchConfig]:
    """Tile candidates for kind in fwd/dkdv/dq, built as (BLOCK_M, BLOCK_N, num_warps, num_stages[, maxnreg]); the
    first is the default.

    Tiles are clamped to max(16, next_pow2(block_size)) (larger ones only add masked-out work in block-local
    attention) and deduplicated. Under the interpreter: one small config, so CPU tests stay fast.
    """
    if triton_interpreting():
        return [tile_config(16, 16, 4, 1)]
    cap = max(16, next_pow2(block_size))
    tiles = {"fwd": FWD_TILES, "dkdv": DKDV_TILES, "dq": DQ_TILES}[kind]
    bm, bn = _default_tiles(block_size, kind != "fwd")
    # The backward holds more per thread (two accumulators, K/V or q/dO, RoPE tables): at D 128 with RoPE ptxas
    # spills in 4-warp backward tiles, less on 8 warps; the tuner times the rest.
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
    # JFA's tuner picks on the H200, for the same short causal loops: a 4-warp 3-stage backward tile, two programs
    # per SM; and a forward 8-warp tile capped at 128 registers (5th entry: maxnreg), so that two programs share an
    # SM (uncapped, an 8-warp D 128 program takes the whole register file).
    extra = {"fwd": ((128, 64, 8, 2, 128),), "dkdv": ((32, 64, 4, 3),), "dq": ((64, 64, 4, 3),)}[kind]
    for cfg in extra:
        cfg = (min(cfg[0], cap), min(cfg[1], cap)) + cfg[2:]
        if cfg not in out:
            out.append(cfg)
    return [tile_config(*c) for c in out]


# Smaller tiles for where no candidate fits the device's shared memory (fp32 at wide heads), largest first.
FALLBACK = [tile_config(32, 32, 4, 1), tile_config(16, 16, 4, 1)]


def _smem(kind: str, d: int, elt: int):
    """The shared-memory estimate of a config of one pass, at the tile width of head dim d."""
    return attention_pass_smem(kind, max(16, next_pow2(d)), elt)


_TUNER = ConfigTuner("gem.ops.block")


def _tune_key(q, k, block_size, causal, rotary_dim, interleaved) -> tuple:
    _, h, d = q.shape
    # block_size exactly (few distinct values per model); not T: a new batch size must not re-tune
    return (d, q.dtype, block_size, causal, rotary_dim > 0, d > rotary_dim, interleaved, h, h // k.shape[1])


class _Tables:
    """One call's work tables per tile height (gem.ops.triton_utils.work_table, kept in the call's JaggedBatch in
    eager calls), and the rope token positions within their block: built on first use, shared by the tuner's timed
    configs and both backward passes."""

    def __init__(self, offsets, total):
        self.offsets, self.total, self.work_tables, self.pos = offsets, total, {}, {}

    def work(self, tile):
        table = self.work_tables.get(tile)
        if table is None:
            table = self.work_tables[tile] = work_table("seq_len", self.offsets, self.offsets, 0, tile,
                                                        total=self.total)
        return table

    def positions(self, block_size):
        """Each token's position within its block (the rope op's per-sequence positions mod block_size)."""
        pos = self.pos.get(block_size)
        if pos is None:
            pos = self.pos[block_size] = cached(
                "block_rope_pos", self.offsets, self.offsets, (self.total, block_size),
                lambda: positions_cached(self.offsets, self.total) % block_size)
        return pos


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


def _meta(q, k, rotary_dim, interleaved, causal):
    key = (q.shape[1], k.shape[1], q.shape[2], q.dtype, rotary_dim, interleaved, causal, triton_interpreting())
    meta = _METAS.get(key)
    if meta is None:
        meta = _METAS[key] = _make_meta(q, k, rotary_dim, interleaved, causal)
    return meta


def _make_meta(q, k, rotary_dim, interleaved, causal):
    d = q.shape[2]
    half = rotary_dim // 2
    return dict(  # noqa: C408 -- kernel meta-parameters read best as keywords
        H=q.shape[1], HKV=k.shape[1], D=d, GROUP=q.shape[1] // k.shape[1], D_B=next_pow2(d),
        HALF_B=max(16, next_pow2(max(half, 1))),
        PASS_B=max(16, next_pow2(max(d - rotary_dim, 1))),
        CAUSAL=causal, ROPE=rotary_dim > 0, HAS_PASS=d > rotary_dim, INTERLEAVED=interleaved,
        DOT_PREC=dot_prec(q.dtype),
    )


def _rotated(x, tables, max_len, block_size, rope_base, rotary_dim, interleaved):
    """The copy of x that the kernels read: x rotated by one rope-kernel pass (a temporary), or x itself without
    rope.

    Every rotation here (copies and in-kernel) is by the position within the block, not within the sequence: a
    RoPE score depends only on the distance j - i, and blocks start at sequence starts, so both give the same
    attention. The cos/sin rows read are then at most block_size (256 KB at 512 x 64 fp32 pairs) and stay in L2,
    where a 62K-token sequence would read 32 MB of tables."""
    if rotary_dim == 0:
        return x
    return _rope_triton(x, tables.offsets, _rope_rows(max_len, block_size), rope_base, rotary_dim, interleaved,
                        False, tables.positions(block_size))


def _fwd(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, offsets: torch.Tensor, max_len: int, block_size: int,
         causal: bool, scale: float, rope_base: float, rotary_dim: int,
         interleaved: bool) -> tuple[torch.Tensor, torch.Tensor]:
    return _fwd_keep(q, k, v, offsets, max_len, block_size, causal, scale, rope_base, rotary_dim, interleaved)[:2]


def _fwd_keep(q, k, v, offsets, max_len, block_size, causal, scale, rope_base, rotary_dim, interleaved):
    """(o, lse, K_rot): K_rot is the rotated copy of k the forward streamed, None without rope."""
    t, h, _ = q.shape
    o = torch.empty_like(q)
    lse = torch.empty((h, t), dtype=torch.float32, device=q.device)
    if t == 0 or offsets.numel() < 2:
        return o.zero_(), lse.zero_(), None
    tables = _Tables(offsets, t)
    offsets32 = offsets.to(torch.int32)
    cos, sin = _rope_tables(rotary_dim, rope_base, _rope_rows(max_len, block_size), q.device)
    meta = _meta(q, k, rotary_dim, interleaved, causal)
    k_s = _rotated(k, tables, max_len, block_size, rope_base, rotary_dim, interleaved)  # streamed

    def launch(cfg):
        work = tables.work(cfg.block_m)
        _fwd_kernel[(work.shape[0] * h,)](
            q, k_s, v, o, lse, offsets32, work, cos, sin, scale * _LOG2E, t, block_size, rotary_dim // 2, rotary_dim,
            **cfg.launch_kwargs(), **meta)

    key = _tune_key(q, k, block_size, causal, rotary_dim, interleaved)
    launch(_TUNER.pick("fwd", key, lambda: configs("fwd", block_size), launch, q.device, outputs=(o, lse),
                       estimate=lambda cfg: _smem("fwd", q.shape[2], q.element_size())(cfg), fallback=FALLBACK))
    return o, lse, (k_s if k_s is not k else None)


def _bwd(do: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, o: torch.Tensor, lse: torch.Tensor,
         offsets: torch.Tensor, max_len: int, block_size: int, causal: bool, scale: float, rope_base: float,
         rotary_dim: int, interleaved: bool,
         k_rot: Optional[torch.Tensor] = None,  # noqa: UP045 (custom-op schemas)
         ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """k_rot: the forward's rotated copy of k, reused instead of a rope pass."""
    t, h, _ = q.shape
    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    if t == 0 or offsets.numel() < 2:
        return dq.zero_(), dk.zero_(), dv.zero_()
    do = do.contiguous()
    tables = _Tables(offsets, t)
    offsets32 = offsets.to(torch.int32)
    delta = torch.empty_like(lse)  # written by the dQ pass
    cos, sin = _rope_tables(rotary_dim, rope_base, _rope_rows(max_len, block_size), q.device)
    meta = _meta(q, k, rotary_dim, interleaved, causal)
    args = (cos, sin, scale * _LOG2E, scale, t, block_size, rotary_dim // 2, rotary_dim)

    # The two passes are independent kernels (each only stores its own outputs), so each is tuned on its own.
    # Both read the stationary and the streamed tiles from the rotated copies: only dQ/dK's inverse rotation stays.
    def dkdv(cfg, q_s, k_s):
        work = tables.work(cfg.block_n)  # one program per key tile
        _bwd_dkdv_kernel[(work.shape[0] * k.shape[1],)](
            q_s, k_s, v, do, lse, delta, dk, dv, offsets32, work, *args, **cfg.launch_kwargs(), **meta)

    def dq_pass(cfg, q_s, k_s):
        work = tables.work(cfg.block_m)  # one program per query tile
        _bwd_dq_kernel[(work.shape[0] * h,)](
            q_s, k_s, v, o, do, lse, delta, dq, offsets32, work, *args, **cfg.launch_kwargs(), **meta)

    key = _tune_key(q, k, block_size, causal, rotary_dim, interleaved)
    rot = (tables, max_len, block_size, rope_base, rotary_dim, interleaved)
    # K_rot: the eager forward's (k-sized, small under GQA), else made here. Q_rot is recomputed, not saved by the
    # forward: activation memory weighs more than a rope pass.
    k_s = k_rot if k_rot is not None else _rotated(k, *rot)
    q_s = _rotated(q, *rot)
    for kind, fn in (("dq", dq_pass), ("dkdv", dkdv)):  # dQ first: it writes delta
        run = functools.partial(fn, q_s=q_s, k_s=k_s)
        run(_TUNER.pick(kind, key, lambda kind=kind: configs(kind, block_size), run, q.device,
                        outputs=(dq, delta) if kind == "dq" else (dk, dv),
                        estimate=lambda cfg, kind=kind: _smem(kind, q.shape[2], q.element_size())(cfg),
                        fallback=FALLBACK))
    return dq, dk, dv


def _fwd_fake(q, *rest):
    return torch.empty_like(q), q.new_empty((q.shape[1], q.shape[0]), dtype=torch.float32)


def _bwd_fake(do, q, k, v, *rest, **kw):
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


def _keep(*inputs):
    """The eager forward also keeps K_rot for the dQ pass (one k-sized activation more, one rope pass less; RoPE as
    a separate op keeps both rotated q and k)."""
    o, lse, k_rot = _fwd_keep(*inputs)
    return (o, lse), {"k_rot": k_rot}


# inputs (q, k, v, offsets, *constants) -> (o, lse); backward(do, q, k, v, o, lse, offsets, *constants, k_rot=None)
block_attention_op = KernelOp("block_attention", _fwd, _bwd, fake=_fwd_fake, backward_fake=_bwd_fake, n_tensors=4,
                              nondiff=(1,), save=lambda i, o: (*i[:3], *o, i[3]), keep=_keep)


def block_attention_triton(q, k, v, batch, *, block_size, causal=True, rope: RopeConfig | None = None, scale=None):
    """Triton path of gem.ops.block.block_attention (inputs already validated)."""
    d = q.shape[2]
    scale = 1.0 / math.sqrt(d) if scale is None else float(scale)
    rd = rope.resolve_dim(d) if rope is not None else 0
    base = float(rope.base) if rope is not None else 10000.0
    interleaved = bool(rope.interleaved) if rope is not None else False
    args = (q.contiguous(), k.contiguous(), v.contiguous(), batch.offsets, batch.max_len, int(block_size),
            bool(causal), scale, base, rd, interleaved)
    return block_attention_op(*args, batches=(batch, batch))[0]
