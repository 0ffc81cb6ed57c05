"""Shared pieces of the attention benchmarks: jagged batches (shapes in docs/PERF.md), timing, tables."""

from __future__ import annotations

import contextlib
import json
import math
from dataclasses import dataclass, field

import torch


@contextlib.contextmanager
def patched(obj, attrs: dict | None):
    """obj's attributes set to `attrs` inside the block (a benchmark row timing another choice of a kernel's host
    code), restored after; None leaves all alone."""
    old = {name: getattr(obj, name) for name in attrs or {}}
    for name, value in (attrs or {}).items():
        setattr(obj, name, value)
    try:
        yield
    finally:
        for name, value in old.items():
            setattr(obj, name, value)


def jagged_lengths(n: int, tokens: int, *, low: int = 1, seed: int = 0, device="cuda") -> torch.Tensor:
    """Lengths ~ U[low, n] (sparsity 0.5 when low = 1), batch sized to hold about `tokens` tokens."""
    g = torch.Generator().manual_seed(seed)
    mean = (low + n) / 2
    b = max(1, round(tokens / mean))
    return torch.randint(low, n + 1, (b,), generator=g).to(device)


def offsets_of(lengths: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.pad(torch.cumsum(lengths, 0), (1, 0)).to(torch.int32)


def attn_flops(lengths: torch.Tensor, heads: int, dim: int, *, causal: bool, lengths_k=None) -> float:
    """Effective forward FLOPs counting real tokens only: 4*H*D*sum(Lq*Lk), halved when causal."""
    lq = lengths.double()
    lk = lq if lengths_k is None else lengths_k.double()
    f = 4.0 * heads * dim * float((lq * lk).sum())
    return f / 2 if causal else f


def compile_static(fn, **kwargs):
    """torch.compile for a competitor, specialised to the shapes of its first call.

    Dynamo caches by code object: a competitor built per case from the same nested function would, on its second
    shape, be recompiled with symbolic sizes (automatic dynamic shapes), slower kernels than a user padding to fixed
    maxima gets. Clearing the caches and compiling with dynamic=False gives every case its own static graph.
    """
    torch._dynamo.reset()
    return torch.compile(fn, dynamic=False, **kwargs)


def bench_ms(fn, *, warmup: int = 25, rep: int = 100) -> float:
    """Median milliseconds of fn() with CUDA events (triton.testing.do_bench)."""
    import triton.testing

    return float(triton.testing.do_bench(fn, warmup=warmup, rep=rep, return_mode="median"))


def device_ms(fn, iters: int = 10) -> float:
    """Milliseconds of GPU work per call: the CUDA kernels (and copies) torch.profiler records over `iters` calls.
    Event times also count the gaps where the GPU waits for the host; this does not, so where the two differ the
    call is host-bound. No L2 flush between calls (do_bench flushes); nan when the profiler records nothing."""
    from torch.profiler import ProfilerActivity, profile

    for _ in range(2):
        fn()
    torch.cuda.synchronize()
    try:
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(iters):
                fn()
            torch.cuda.synchronize()
        us = sum(ev.device_time for ev in prof.events() if ev.device_type == torch.autograd.DeviceType.CUDA)
    except Exception as e:  # noqa: BLE001 - a profiler that cannot run must not cost the row its event times
        print(f"device_ms: profiler failed ({str(e).splitlines()[0][:100] if str(e) else type(e).__name__})")
        return math.nan
    return us / iters / 1e3 if us > 0 else math.nan


def copy_rate(iters: int = 10) -> tuple[float, float]:
    """The memory anchor: (device ms, TB/s of read + write traffic) of a 1 GiB device-to-device copy."""
    src = torch.empty(2**29, device="cuda", dtype=torch.bfloat16).normal_()
    dst = torch.empty_like(src)
    ms = device_ms(lambda: dst.copy_(src), iters)
    return ms, 2 * src.numel() * src.element_size() / ms / 1e9


def peak_mem_mb(fn) -> float:
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    fn()
    torch.cuda.synchronize()
    return (torch.cuda.max_memory_allocated() - base) / 2**20


def matmul_peak_tflops(n: int = 8192) -> float:
    """Measured bf16 matmul rate on random data, the practical ceiling reported beside every table."""
    a = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    ms = bench_ms(lambda: a @ b)
    return 2 * n**3 / ms / 1e9


@dataclass
class Row:
    section: str
    case: str
    impl: str
    fwd_ms: float = math.nan
    bwd_ms: float = math.nan
    fwd_tflops: float = math.nan
    bwd_tflops: float = math.nan
    mem_mb: float = math.nan
    extra: dict = field(default_factory=dict)


def print_table(rows: list[Row], title: str = "") -> None:
    if title:
        print(f"\n## {title}")
    print("| section | case | impl | fwd ms | bwd ms | fwd TFLOP/s | bwd TFLOP/s | peak MB | notes |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        notes = " ".join(f"{k}={v}" for k, v in r.extra.items())
        print(
            f"| {r.section} | {r.case} | {r.impl} | {r.fwd_ms:.3f} | {r.bwd_ms:.3f} | {r.fwd_tflops:.1f} | "
            f"{r.bwd_tflops:.1f} | {r.mem_mb:.0f} | {notes} |"
        )


def dump_json(rows: list[Row], path: str) -> None:
    with open(path, "w") as f:
        json.dump([r.__dict__ for r in rows], f, indent=1)
