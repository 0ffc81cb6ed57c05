"""Model FLOPs utilisation, and how much of the step communication leaves uncovered.

- E2E MFU = model FLOPs per device / wall step time / peak (bf16 dense, vendor sheet; also against a measured
  matmul peak when one is given).
- Exposed communication = time in the step when a communication kernel runs on the device and no compute kernel
  does, from the device timeline of a few profiled steps (`CommProbe`, `comm_times`). On CPU (gloo) there are no
  device kernels: the probe times the host-side ops instead (the gloo collectives on their worker threads against
  the other ops), so there it is host time.
- local MFU = model FLOPs / (step time - exposed communication) / peak: this device with communication for free.
- scaling ratio = E2E / local, so E2E = local x scaling; on one device exposed communication is 0 and scaling 1.
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from dataclasses import dataclass

import torch

# bf16 dense tensor-core peak (no sparsity), FLOP/s, matched against torch.cuda.get_device_name().
PEAK_BF16_FLOPS = {
    "H200": 989e12,
    "H100": 989e12,
    "H800": 989e12,
    "GH200": 989e12,
    "B200": 2250e12,
    "A100": 312e12,
    "A800": 312e12,
    "L40S": 362e12,
}


def device_peak_flops(device: torch.device) -> float | None:
    """Vendor bf16 peak of `device`, or None where unknown (e.g. CPU)."""
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device).upper()
    for key in sorted(PEAK_BF16_FLOPS, key=len, reverse=True):  # longest first: GH200 before H200
        if key in name:
            return PEAK_BF16_FLOPS[key]
    return None


def measure_matmul_peak(device: torch.device, n: int = 8192, iters: int = 20) -> float:
    """Measured bf16 matmul FLOP/s on `device` (a square n×n×n GEMM)."""
    a = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    b = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    for _ in range(3):
        a @ b
    torch.cuda.synchronize(device)
    t0 = time.perf_counter()
    for _ in range(iters):
        a @ b
    torch.cuda.synchronize(device)
    return 2.0 * n**3 * iters / (time.perf_counter() - t0)


# ---------------------------------------------------------------------------------------------- communication

# Substrings (lower case) of communication kernel and op names: NCCL kernels (ncclDevKernel_AllReduce_...,
# ncclKernel_...), the c10d ops (c10d::allreduce_, record_param_comms), gloo's worker-thread ranges
# (gloo:all_reduce) and the collectives' own names.
COMM_PATTERNS = ("nccl", "c10d::", "gloo:", "record_param_comms", "all_reduce", "allreduce", "all_gather",
                 "allgather", "reduce_scatter", "reducescatter", "all_to_all", "alltoall")


def is_comm(name: str) -> bool:
    """Whether a kernel or op of this name is communication."""
    n = name.lower()
    return any(p in n for p in COMM_PATTERNS)


@dataclass(frozen=True)
class CommTimes:
    """Time over a set of intervals (any unit): `busy` anything runs, `comm` communication runs, `exposed`
    communication runs and no compute does."""

    busy: float
    comm: float
    exposed: float


def _union(spans: Iterable[tuple[float, float]]) -> list[tuple[float, float]]:
    out: list[list[float]] = []
    for s, e in sorted(spans):
        if e <= s:
            continue
        if out and s <= out[-1][1]:
            out[-1][1] = max(out[-1][1], e)
        else:
            out.append([s, e])
    return [(s, e) for s, e in out]


def _length(spans: list[tuple[float, float]]) -> float:
    return sum(e - s for s, e in spans)


def _overlap(a: list[tuple[float, float]], b: list[tuple[float, float]]) -> float:
    """Length of the intersection of two sorted disjoint span lists."""
    i = j = 0
    total = 0.0
    while i < len(a) and j < len(b):
        lo, hi = max(a[i][0], b[j][0]), min(a[i][1], b[j][1])
        if hi > lo:
            total += hi - lo
        if a[i][1] < b[j][1]:
            i += 1
        else:
            j += 1
    return total


def comm_times(intervals: Iterable[tuple[float, float, str]]) -> CommTimes:
    """Busy, communication and exposed-communication time of (start, end, kind) intervals, kind "comm" or anything
    else for compute; intervals may overlap, nest and come from several streams or threads."""
    comm, compute = [], []
    for s, e, kind in intervals:
        (comm if kind == "comm" else compute).append((s, e))
    comm_u, compute_u = _union(comm), _union(compute)
    comm_len = _length(comm_u)
    return CommTimes(busy=_length(_union(comm_u + compute_u)), comm=comm_len,
                     exposed=comm_len - _overlap(comm_u, compute_u))


def profiler_intervals(prof, cuda: bool) -> list[tuple[float, float, str]]:
    """(start ns, end ns, "comm" | "compute") of what a finished torch.profiler run recorded: the device kernels and
    copies with CUDA; the host ops without (ranges that only annotate, like ProfilerStep#, left out, except gloo's
    collectives, which are such ranges on its worker threads)."""
    from torch.autograd import DeviceType

    out = []
    for e in prof.profiler.kineto_results.events():
        name = e.name()
        on_device = e.device_type() != DeviceType.CPU
        if on_device != cuda:
            continue
        comm = is_comm(name)
        if getattr(e, "is_user_annotation", lambda: False)() and not (comm and not cuda):
            continue
        start = e.start_ns()
        out.append((start, start + e.duration_ns(), "comm" if comm else "compute"))
    return out


class CommProbe:
    """torch.profiler over a few training steps, reduced to the share of their wall time that communication
    is exposed (and runs at all). `start()` before the first step, `stop()` after the last; the profiler records
    device kernels on CUDA, host ops on CPU."""

    def __init__(self, device: torch.device) -> None:
        self.device, self.cuda = device, device.type == "cuda"
        self._prof = None
        self._t0 = self._start_s = 0.0
        self.overhead_s = 0.0

    @property
    def running(self) -> bool:
        return self._prof is not None

    def start(self) -> bool:
        """Starts profiling; False (and nothing started) while another profiler runs in this process."""
        from torch.profiler import ProfilerActivity, profile

        if torch.autograd.profiler._is_profiler_enabled:
            return False
        acts = [ProfilerActivity.CUDA] if self.cuda else [ProfilerActivity.CPU]
        self._prof = profile(activities=acts, record_shapes=False, with_stack=False, profile_memory=False)
        if self.cuda:
            torch.cuda.synchronize(self.device)  # the wall time below is then the probed steps' device time
        t = time.perf_counter()
        self._prof.start()
        self._t0 = time.perf_counter()
        self._start_s = self._t0 - t
        return True

    def stop(self) -> tuple[float, float]:
        """(exposed, comm) communication as fractions of the probed steps' wall time. `overhead_s` is then the
        host time spent on starting the profiler, stopping it and reading it (the device idles meanwhile)."""
        prof, self._prof = self._prof, None
        if self.cuda:
            torch.cuda.synchronize(self.device)
        end = time.perf_counter()
        prof.stop()
        t = comm_times(profiler_intervals(prof, self.cuda))
        wall_ns = max((end - self._t0) * 1e9, t.busy, 1.0)
        self.overhead_s = self._start_s + time.perf_counter() - end
        return min(t.exposed / wall_ns, 1.0), min(t.comm / wall_ns, 1.0)


# ---------------------------------------------------------------------------------------------- MFU


@dataclass
class MFUReport:
    flops_per_s: float  # achieved model FLOP/s per device, over the wall step time
    mfu_e2e: float | None  # vs the vendor peak, wall step time
    mfu_local: float | None  # vs the vendor peak, step time less exposed communication
    mfu_measured_peak: float | None  # E2E vs a measured matmul peak
    scaling_ratio: float | None  # E2E / local
    exposed_comm_s: float | None  # per step
    comm_s: float | None  # per step, hidden or not

    def scalars(self) -> dict[str, float]:
        out = {"perf/tflops_per_device": self.flops_per_s / 1e12}
        for key, v in (("perf/mfu_e2e", self.mfu_e2e), ("perf/mfu_local", self.mfu_local),
                       ("perf/mfu_vs_measured_peak", self.mfu_measured_peak),
                       ("perf/scaling_ratio", self.scaling_ratio)):
            if v is not None:
                out[key] = v
        if self.exposed_comm_s is not None:
            out["time/exposed_comm_ms"] = 1e3 * self.exposed_comm_s
        if self.comm_s is not None:
            out["time/comm_ms"] = 1e3 * self.comm_s
        return out


def mfu_report(
    flops_per_device: float,
    seconds: float,
    peak_flops: float | None,
    measured_peak_flops: float | None = None,
    exposed_comm_fraction: float | None = None,
    comm_fraction: float | None = None,
) -> MFUReport:
    """MFU of `flops_per_device` model FLOPs done in `seconds` (wall, per step) on one device, of which
    `exposed_comm_fraction` was exposed communication (0 on one device; None: not measured, so no local MFU)."""
    rate = flops_per_device / seconds if seconds > 0 else 0.0
    e2e = rate / peak_flops if peak_flops else None
    mfu_m = rate / measured_peak_flops if measured_peak_flops else None
    if exposed_comm_fraction is None:
        return MFUReport(rate, e2e, None, mfu_m, None, None, None)
    scaling = max(1.0 - exposed_comm_fraction, 1e-9)  # local = e2e / scaling stays finite
    local = e2e / scaling if e2e is not None else None
    comm = comm_fraction * seconds if comm_fraction is not None else None
    return MFUReport(rate, e2e, local, mfu_m, scaling, exposed_comm_fraction * seconds, comm)
