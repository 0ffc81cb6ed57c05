"""Probe: the memory rate GDPA's short-K/V kernels could reach with their own access pattern and no math.

    python tools/stream_probe.py [--cases 64,128] [--iters 10]

Two Triton kernels move exactly the least traffic of GDPA's short-K/V forward and one-pass backward, laid out as
those kernels are: one program per (sequence, head), longest q first; each loads its sequence's K/V tile once,
then streams its q-side rows in tiles of BLOCK_M rows (forward: read q, write o; backward: read q and dO, write dq),
and the backward writes dK and dV at the end. Nothing is computed but a sum that keeps every load live (scaled by a
runtime zero, so the outputs are copies of the inputs). Each runs with its q-tile loop software-pipelined (as
GDPA's loops are, whose loads feed dots; Triton pipelines other loads only when asked) and plain (only other
programs hide a load's latency). The backward also runs in parts: without the K/V load before its stream, without
the dK/dV store after it, or neither (its K side's cost); with the K/V tile read again from L2 for the store (fewer
registers) or held in registers through the stream (as GDPA holds dK/dV); and over whole token rows, every head at
once (what per-head rows cost). Their device times, beside a 1 GiB copy, torch's flat elementwise kernels moving
the same byte counts (no layout at all) and GDPA's own kernels on the same batch (bench shapes: cross N256 x
U[1, M], bf16, H 4, D 128, ~512K query tokens), split the gap between GDPA and the copy's rate into what the layout
costs, what holding state costs and what the math costs. Needs CUDA.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch
import triton
import triton.language as tl

H, D = 4, 128


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


def _label(what: str, bm: int, w: int, s: int, pipe: bool) -> str:
    # a plain loop has no stages (the launch's num_stages only shapes pipelined loops)
    return f"{what} pipelined ({bm}, {w}, {s})" if pipe else f"{what} plain ({bm}, {w})"


def _case(m: int, copy: float, iters: int) -> None:
    from gem.ops.gdpa import gdpa
    from scripts.bench.common import device_ms, jagged_lengths, offsets_of

    lq = jagged_lengths(256, 8 * 65536, seed=256)  # the bench's cross shapes (scripts/bench/gdpa_section.py)
    lk = torch.randint(1, m + 1, (lq.numel(),), generator=torch.Generator().manual_seed(m)).to("cuda")
    oq, ok = offsets_of(lq), offsets_of(lk)
    q = torch.randn(int(lq.sum()), H, D, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    k = torch.randn(int(lk.sum()), H, D, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    v = torch.randn_like(k, requires_grad=True)
    do = torch.randn_like(q)
    order = torch.argsort(lq, descending=True, stable=True).to(torch.int32)
    block_n = max(16, triton.next_power_of_2(int(lk.max())))
    qb, kb = q.numel() * q.element_size(), k.numel() * k.element_size()
    fwd_bytes, bwd_bytes = 2 * qb + 2 * kb, 3 * qb + 4 * kb
    rows = []

    def row(label, fn, nbytes):
        if all(r[0] != label for r in rows):  # plain configs that differ only in stages run once
            rows.append((label, device_ms(fn, iters), nbytes))

    for pipe in (False, True):
        for bm, w, s in ((64, 4, 2), (64, 4, 3), (32, 4, 3), (128, 8, 2)):
            row(_label("stream fwd", bm, w, s, pipe), lambda bm=bm, w=w, s=s, pipe=pipe: stream_fwd(
                q, k, v, oq, ok, order, block_n, bm, w, s, pipe=pipe), fwd_bytes)
        for bm, w, s in ((32, 4, 3), (32, 4, 2), (64, 4, 3), (64, 8, 2)):
            row(_label("stream bwd", bm, w, s, pipe), lambda bm=bm, w=w, s=s, pipe=pipe: stream_bwd(
                q, k, v, do, oq, ok, order, block_n, bm, w, s, pipe=pipe), bwd_bytes)
    # the backward's K side (its K/V load before the stream, its dK/dV store after) and its per-head rows, apart
    q_bytes = 3 * qb
    for kv_in, kv_out, nbytes in ((False, True, 3 * qb + 4 * kb), (True, False, 3 * qb + 2 * kb),
                                  (False, False, q_bytes)):
        for bm, w, s, pipe in ((64, 4, 3, False), (32, 4, 3, True)):
            what = f"K/V load {'on' if kv_in else 'off'}, dK/dV store {'on' if kv_out else 'off'}"
            row(_label("stream bwd", bm, w, s, pipe) + " " + what, lambda bm=bm, w=w, s=s, pipe=pipe, kv_in=kv_in,
                kv_out=kv_out: stream_bwd(q, k, v, do, oq, ok, order, block_n, bm, w, s, pipe=pipe, kv_in=kv_in,
                                          kv_out=kv_out), nbytes)
    for bm, w, s, pipe in ((64, 4, 3, False), (32, 4, 3, True), (32, 4, 2, True)):
        row(_label("stream bwd", bm, w, s, pipe) + " K/V held, stored at the end", lambda bm=bm, w=w, s=s,
            pipe=pipe: stream_bwd(q, k, v, do, oq, ok, order, block_n, bm, w, s, pipe=pipe, hold=True), bwd_bytes)
    for bm, w, s, pipe in ((16, 4, 3, True), (16, 4, 2, False), (32, 8, 3, True), (8, 4, 3, False)):
        row(_label("whole-row q side", bm, w, s, pipe), lambda bm=bm, w=w, s=s, pipe=pipe: stream_rows(
            q, do, oq, order, bm, w, s, pipe=pipe), q_bytes)
    # layout-free bounds: torch's flat elementwise kernels moving the same byte counts over whole tensors
    o, scratch, g = torch.empty_like(q), torch.empty_like(k), (torch.empty_like(q), torch.empty_like(k),
                                                               torch.empty_like(v))

    def flat_fwd():  # reads q, k; writes o and a k-sized scratch: 2 qb + 2 kb, the forward's least traffic
        o.copy_(q.detach())
        scratch.copy_(k.detach())

    def flat_bwd():  # reads q, dO, k, v; writes dq, dk, dv: 3 qb + 4 kb, the backward's least traffic
        torch.add(q.detach(), do, alpha=0.0, out=g[0])
        g[1].copy_(k.detach())
        g[2].copy_(v.detach())

    rows.append(("torch elementwise fwd traffic", device_ms(flat_fwd, iters), fwd_bytes))
    rows.append(("torch elementwise bwd traffic", device_ms(flat_bwd, iters), bwd_bytes))
    rows.append(("torch elementwise q side (dq = q + 0 dO)", device_ms(
        lambda: torch.add(q.detach(), do, alpha=0.0, out=g[0]), iters), q_bytes))

    def fwd():
        return gdpa(q, k, v, oq, int(lq.max()), ok, int(lk.max()), activation="gelu_tanh", kernel="triton")

    torch.autograd.grad(fwd(), (q, k, v), do)  # compile and tune outside the timing
    f_ms = device_ms(fwd, iters)
    fb_ms = device_ms(lambda: torch.autograd.grad(fwd(), (q, k, v), do), iters)
    rows += [("gdpa fwd", f_ms, fwd_bytes), ("gdpa bwd", fb_ms - f_ms, bwd_bytes)]
    for name, ms, nbytes in rows:
        rate = nbytes / ms / 1e9
        print(f"| N256 M{m} | {name} | {ms:.3f} | {nbytes / 1e9:.3f} | {rate:.2f} | {rate / copy:.0%} |", flush=True)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cases", default="64,128", help="comma list of M (K/V lengths ~ U[1, M]; N 256 queries)")
    ap.add_argument("--iters", type=int, default=10)
    a = ap.parse_args()
    if not torch.cuda.is_available():
        print("stream_probe: needs CUDA")
        return 2
    from scripts.bench.common import copy_rate

    copy_ms, copy = copy_rate(a.iters)
    torch.cuda.empty_cache()
    print(f"1 GiB copy: {copy_ms:.3f} ms, {copy:.2f} TB/s (read + write)")
    print("| case | kernel | device ms | least traffic GB | TB/s | of copy |")
    print("|---|---|---|---|---|---|")
    for m in (int(x) for x in a.cases.split(",")):
        _case(m, copy, a.iters)
        torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    sys.exit(main())
