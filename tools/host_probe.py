"""Where an eager attention call's host time goes, piece by piece, on one GPU.

    python tools/host_probe.py [--reps 5] [--calls 20] [--profile] [--ops block,gdpa]

Each line is the host microseconds per call of one piece, measured with the GPU asleep (the calls queue behind a
GPU sleep, so the host never waits for the device): the median of --reps runs of --calls calls. Pieces: torch
primitives (an allocation, a dtype cast, the current stream), the autograd engine on a trivial Function, one
Triton launch, then gem's block and GDPA calls whole, with Triton launches as no-ops, and their forward and
backward alone. Where the host time of a call exceeds its kernels' device time (kernel_probe.py), the call is
host-bound and these lines say which piece to cut. --profile adds a cProfile of the block fwd+bwd by cumulative
time. Needs CUDA.
"""

from __future__ import annotations

import argparse
import contextlib
import cProfile
import io
import pstats
import statistics
import sys
import time

import torch
import triton
import triton.language as tl

from gem.bench.kernels import jagged_lengths, offsets_of

H, D = 4, 128


@triton.jit
def _noop_kernel(x, n, a1, a2, a3, a4, a5, a6, a7, a8, B: tl.constexpr, C: tl.constexpr):
    i = tl.program_id(0) * B + tl.arange(0, B)
    if C > 0:
        tl.store(x + i, tl.load(x + i, mask=i < n), mask=i < n)


@contextlib.contextmanager
def _no_launch():
    """Every Triton launch a no-op: what is left is Python glue, autograd, allocations and torch's own launches."""
    from triton.runtime.jit import JITFunction

    real = JITFunction.run
    JITFunction.run = lambda self, *a, **k: None
    try:
        yield
    finally:
        JITFunction.run = real


def _host_us(fn, calls: int, reps: int) -> float:
    fn()
    runs = []
    for _ in range(reps):
        torch.cuda.synchronize()
        torch.cuda._sleep(1_000_000_000)  # longer than `calls` calls' host time: no call waits for the device
        woke = torch.cuda.Event()
        woke.record()
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        runs.append((time.perf_counter() - t0) / calls * 1e6)
        if woke.query():  # the sleep ended inside the loop: later calls may have waited for the device
            print(f"host_probe: the GPU woke before {calls} calls were queued; lower --calls", flush=True)
        torch.cuda.synchronize()
    return statistics.median(runs)


class _Id(torch.autograd.Function):
    """The autograd engine's own cost: no kernels either way."""

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        return g


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--calls", type=int, default=20)
    ap.add_argument("--profile", action="store_true")
    ap.add_argument("--ops", default="block,gdpa", help="whose whole calls to time (a comma list of block, gdpa)")
    a = ap.parse_args()
    ops = set(a.ops.split(","))
    if not ops <= {"block", "gdpa"}:
        print(f"host_probe: --ops {a.ops!r}: expected a comma list of block, gdpa")
        return 2
    if not torch.cuda.is_available():
        print("host_probe: needs CUDA")
        return 2
    from gem.ops.block import block_attention
    from gem.ops.gdpa import gdpa
    from gem.ops.rotary import RopeConfig

    lq = jagged_lengths(32768, 65536, low=16384, seed=32768)
    t = int(lq.sum())
    q, k, v = (torch.randn(t, H, D, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
    off, mq = offsets_of(lq), int(lq.max())
    off64 = off.long()
    g = torch.randn_like(q)
    x = torch.zeros(1024, device="cuda")
    small = torch.randn(64, device="cuda", requires_grad=True)
    gs = torch.ones_like(small)
    rope = RopeConfig()

    def blk(**kw):
        return lambda: block_attention(q, k, v, off, mq, block_size=512, kernel="triton", **kw)

    ls = jagged_lengths(512, 65536, seed=512)
    ts = int(ls.sum())
    qs, ks, vs = (torch.randn(ts, H, D, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
    offs, ms = offsets_of(ls), int(ls.max())
    gg = torch.randn_like(qs)

    def gd():
        return gdpa(qs, ks, vs, offs, ms, offs, ms, activation="silu", causal=True, kernel="triton")

    pieces = [
        ("torch.empty_like(q)", lambda: torch.empty_like(q)),
        ("offsets int32 -> int32 .to", lambda: off.to(torch.int32)),
        ("offsets int64 -> int32 .to (a cast kernel)", lambda: off64.to(torch.int32)),
        ("torch.cuda.current_stream()", lambda: torch.cuda.current_stream(q.device)),
        ("torch.cuda.is_current_stream_capturing()", torch.cuda.is_current_stream_capturing),
        ("autograd.grad of a trivial Function", lambda: torch.autograd.grad(_Id.apply(small), small, gs)),
        ("autograd.grad of x * 2 (two torch kernels)", lambda: torch.autograd.grad(small * 2, small, gs)),
        ("one Triton launch, 10 args", lambda: _noop_kernel[(1,)](x, 0, 1, 2, 3, 4, 5, 6, 7, 8, B=128, C=0)),
    ]
    for label, fn in pieces:
        print(f"{_host_us(fn, a.calls, a.reps):8.1f} us  {label}", flush=True)

    for name, fwd, go in (("block L32K rope", blk(rope=rope), g), ("block L32K no rope", blk(), g),
                          ("gdpa self N512 causal", gd, gg)):
        if name.split()[0] not in ops:
            continue
        fwd()
        o = fwd()
        inputs = (q, k, v) if go is g else (qs, ks, vs)

        def both(fwd=fwd, go=go, inputs=inputs):
            return torch.autograd.grad(fwd(), inputs, go)

        both()
        f_us, fb_us = _host_us(fwd, a.calls, a.reps), _host_us(both, a.calls, a.reps)
        with _no_launch():
            f0, fb0 = _host_us(fwd, a.calls, a.reps), _host_us(both, a.calls, a.reps)
        print(f"{name}: fwd {f_us:.1f} us ({f0:.1f} no launches), fwd+bwd {fb_us:.1f} us ({fb0:.1f} no launches); "
              f"backward alone ~{fb_us - f_us:.1f} ({fb0 - f0:.1f})", flush=True)
        del o
    if a.profile and "block" in ops:
        fn = blk(rope=rope)
        torch.cuda.synchronize()
        with _no_launch():
            torch.cuda._sleep(1_000_000_000)
            prof = cProfile.Profile()
            prof.enable()
            for _ in range(a.calls):
                torch.autograd.grad(fn(), (q, k, v), g)
            prof.disable()
        torch.cuda.synchronize()
        buf = io.StringIO()
        pstats.Stats(prof, stream=buf).sort_stats("cumtime").print_stats(45)
        print(f"block L32K rope fwd+bwd, no launches, {a.calls} calls, by cumulative time:\n{buf.getvalue()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
