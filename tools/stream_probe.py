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

import torch
import triton

from gem.bench.stream import stream_bwd, stream_fwd, stream_rows

H, D = 4, 128


def _label(what: str, bm: int, w: int, s: int, pipe: bool) -> str:
    # a plain loop has no stages (the launch's num_stages only shapes pipelined loops)
    return f"{what} pipelined ({bm}, {w}, {s})" if pipe else f"{what} plain ({bm}, {w})"


def _case(m: int, copy: float, iters: int) -> None:
    from gem.bench.kernels import device_ms, jagged_lengths, offsets_of
    from gem.ops.gdpa import gdpa

    lq = jagged_lengths(256, 8 * 65536, seed=256)  # the bench's cross shapes (gem/bench/attention/gdpa.py)
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
    from gem.bench.kernels import copy_rate

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
