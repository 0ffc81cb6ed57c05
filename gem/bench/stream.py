"""Memory-rate anchors for the attention benchmarks: Triton kernels that move exactly the least traffic of GDPA's
short-K/V forward and one-pass backward, laid out as those kernels are (one program per (sequence, head), longest
q first; the K/V tile loaded once, the q-side rows streamed in tiles of BLOCK_M rows), with no math but a sum that
keeps every load live, scaled by a runtime zero so the outputs are copies of the inputs. tools/stream_probe.py
times them beside a device copy and GDPA's own kernels."""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _bounds(OFF_Q, OFF_K, ORDER, NUM_HEADS: tl.constexpr):
    b = tl.load(ORDER + tl.program_id(0) // NUM_HEADS)
    q0 = tl.load(OFF_Q + b).to(tl.int64)
    k0 = tl.load(OFF_K + b).to(tl.int64)
    lq = (tl.load(OFF_Q + b + 1) - q0).to(tl.int32)
    lk = (tl.load(OFF_K + b + 1) - k0).to(tl.int32)
    return q0, lq, k0, lk, tl.program_id(0) % NUM_HEADS


@triton.jit
def _kv(K, V, k0, lk, h, NUM_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_N: tl.constexpr):
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, HEAD_DIM)
    ptrs = (k0 + offs_n[:, None]) * (NUM_HEADS * HEAD_DIM) + h * HEAD_DIM + offs_d[None, :]
    kmask = offs_n[:, None] < lk
    return tl.load(K + ptrs, mask=kmask, other=0.0), tl.load(V + ptrs, mask=kmask, other=0.0), ptrs, kmask


@triton.jit
def _fwd_stream(Q, K, V, O, OFF_Q, OFF_K, ORDER, zero, NUM_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr,
                BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, PIPE: tl.constexpr):
    """o = q (+ 0 x a sum of K and V): the forward's reads and writes."""
    q0, lq, k0, lk, h = _bounds(OFF_Q, OFF_K, ORDER, NUM_HEADS)
    k, v, _, _ = _kv(K, V, k0, lk, h, NUM_HEADS, HEAD_DIM, BLOCK_N)
    live = (tl.sum(k.to(tl.float32), 0) + tl.sum(v.to(tl.float32), 0)) * zero
    offs_d = tl.arange(0, HEAD_DIM)
    for t in tl.range(tl.cdiv(lq, BLOCK_M), num_stages=PIPE):
        offs_m = t * BLOCK_M + tl.arange(0, BLOCK_M)
        ptrs = (q0 + offs_m[:, None]) * (NUM_HEADS * HEAD_DIM) + h * HEAD_DIM + offs_d[None, :]
        m = offs_m[:, None] < lq
        x = tl.load(Q + ptrs, mask=m, other=0.0)
        tl.store(O + ptrs, (x.to(tl.float32) + live[None, :]).to(O.dtype.element_ty), mask=m)


@triton.jit
def _bwd_stream(Q, K, V, DO, DQ, DK, DV, OFF_Q, OFF_K, ORDER, zero, NUM_HEADS: tl.constexpr,
                HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, PIPE: tl.constexpr,
                KV_IN: tl.constexpr, KV_OUT: tl.constexpr, HOLD: tl.constexpr):
    """dq = q, dk = k, dv = v (+ 0 x sums of everything read): the one-pass backward's reads and writes. K/V are
    read again for the final store rather than held through the loop (from L2: no DRAM traffic more), so the
    registers, and the programs per SM, are the layout's best case. KV_IN / KV_OUT off: no K/V load before the
    stream / no dK/dV store after it (what the program's K side costs). HOLD: the K/V tile loaded first is held
    in registers through the stream and stored at the end, as GDPA holds its dK/dV accumulators."""
    q0, lq, k0, lk, h = _bounds(OFF_Q, OFF_K, ORDER, NUM_HEADS)
    live = tl.zeros([HEAD_DIM], dtype=tl.float32)
    if KV_IN:
        k, v, _, _ = _kv(K, V, k0, lk, h, NUM_HEADS, HEAD_DIM, BLOCK_N)
        live = (tl.sum(k.to(tl.float32), 0) + tl.sum(v.to(tl.float32), 0)) * zero
    acc = tl.zeros([HEAD_DIM], dtype=tl.float32)
    offs_d = tl.arange(0, HEAD_DIM)
    for t in tl.range(tl.cdiv(lq, BLOCK_M), num_stages=PIPE):
        offs_m = t * BLOCK_M + tl.arange(0, BLOCK_M)
        ptrs = (q0 + offs_m[:, None]) * (NUM_HEADS * HEAD_DIM) + h * HEAD_DIM + offs_d[None, :]
        m = offs_m[:, None] < lq
        x = tl.load(Q + ptrs, mask=m, other=0.0).to(tl.float32)
        g = tl.load(DO + ptrs, mask=m, other=0.0).to(tl.float32)
        tl.store(DQ + ptrs, (x + g * zero + live[None, :]).to(DQ.dtype.element_ty), mask=m)
        acc += tl.sum(g, 0)
    acc = acc * zero
    if HOLD:
        tl.static_assert(KV_IN and KV_OUT)
        kptrs = (k0 + tl.arange(0, BLOCK_N)[:, None]) * (NUM_HEADS * HEAD_DIM) + h * HEAD_DIM + offs_d[None, :]
        kmask = tl.arange(0, BLOCK_N)[:, None] < lk
        tl.store(DK + kptrs, (k.to(tl.float32) + acc[None, :]).to(DK.dtype.element_ty), mask=kmask)
        tl.store(DV + kptrs, (v.to(tl.float32) + acc[None, :]).to(DV.dtype.element_ty), mask=kmask)
    elif KV_OUT:
        k, v, kptrs, kmask = _kv(K, V, k0, lk, h, NUM_HEADS, HEAD_DIM, BLOCK_N)
        tl.store(DK + kptrs, (k.to(tl.float32) + acc[None, :]).to(DK.dtype.element_ty), mask=kmask)
        tl.store(DV + kptrs, (v.to(tl.float32) + acc[None, :]).to(DV.dtype.element_ty), mask=kmask)


@triton.jit
def _bwd_rows(Q, DO, DQ, OFF_Q, ORDER, zero, ROW: tl.constexpr, BLOCK_M: tl.constexpr, PIPE: tl.constexpr):
    """dq = q (+ 0 x dO) over whole token rows (every head at once), one program per sequence: the backward's
    q-side streams with each row read and written as one contiguous run."""
    b = tl.load(ORDER + tl.program_id(0))
    q0 = tl.load(OFF_Q + b).to(tl.int64)
    lq = (tl.load(OFF_Q + b + 1) - q0).to(tl.int32)
    offs_c = tl.arange(0, ROW)
    for t in tl.range(tl.cdiv(lq, BLOCK_M), num_stages=PIPE):
        offs_m = t * BLOCK_M + tl.arange(0, BLOCK_M)
        ptrs = (q0 + offs_m[:, None]) * ROW + offs_c[None, :]
        m = offs_m[:, None] < lq
        x = tl.load(Q + ptrs, mask=m, other=0.0).to(tl.float32)
        g = tl.load(DO + ptrs, mask=m, other=0.0).to(tl.float32)
        tl.store(DQ + ptrs, (x + g * zero).to(DQ.dtype.element_ty), mask=m)


def stream_fwd(q, k, v, offsets_q, offsets_k, order, block_n, block_m=64, num_warps=4, num_stages=2, out=None,
               pipe=True):
    """The forward's traffic alone: returns o (a copy of q; into `out` if given). q, k, v contiguous [T, H, D] with
    the same H. pipe: the q-tile loop is software-pipelined over num_stages (as GDPA's loops, whose loads feed
    dots; Triton pipelines other loads only on request), else plain loads that only other warps' work hides."""
    o = torch.empty_like(q) if out is None else out
    _fwd_stream[(order.numel() * q.shape[1],)](q, k, v, o, offsets_q, offsets_k, order, 0.0, NUM_HEADS=q.shape[1],
                                               HEAD_DIM=q.shape[2], BLOCK_M=block_m, BLOCK_N=block_n,
                                               PIPE=num_stages if pipe else 1, num_warps=num_warps,
                                               num_stages=num_stages)
    return o


def stream_bwd(q, k, v, do, offsets_q, offsets_k, order, block_n, block_m=32, num_warps=4, num_stages=3, out=None,
               pipe=True, kv_in=True, kv_out=True, hold=False, zero=0.0):
    """The one-pass backward's traffic alone: returns (dq, dk, dv), copies of (q, k, v) (into `out` if given; dk
    and dv are left unwritten without kv_out). `zero` scales the sums that keep every load live (tests set 1)."""
    dq, dk, dv = (torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)) if out is None else out
    _bwd_stream[(order.numel() * q.shape[1],)](q, k, v, do, dq, dk, dv, offsets_q, offsets_k, order, zero,
                                               NUM_HEADS=q.shape[1], HEAD_DIM=q.shape[2], BLOCK_M=block_m,
                                               BLOCK_N=block_n, PIPE=num_stages if pipe else 1, KV_IN=kv_in,
                                               KV_OUT=kv_out, HOLD=hold, num_warps=num_warps, num_stages=num_stages)
    return dq, dk, dv


def stream_rows(q, do, offsets_q, order, block_m=16, num_warps=4, num_stages=3, out=None, pipe=True):
    """The backward's q-side traffic over whole token rows: returns dq, a copy of q (into `out` if given)."""
    dq = torch.empty_like(q) if out is None else out
    _bwd_rows[(order.numel(),)](q, do, dq, offsets_q, order, 0.0, ROW=q.shape[1] * q.shape[2], BLOCK_M=block_m,
                                PIPE=num_stages if pipe else 1, num_warps=num_warps, num_stages=num_stages)
    return dq
