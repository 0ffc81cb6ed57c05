"""Shared pieces of the attention benchmarks: jagged batches (shapes in docs/PERF.md), timing, tables."""

from __future__ import annotations

import contextlib
import json
import math
import os
import statistics
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


def disagreement(got, want, names=("out", "dq", "dk", "dv"), tol=(5e-2, 1e-1, 1e-1, 1e-1)) -> str:
    """"" when gem's tensors match the reference's (finite, max error within tol x max(1, max |reference|)), else
    what differs: a speed of a wrong result is not a speed. Looser than the kernel tests' bf16 tolerances against
    fp64 (3e-2 to 6e-2), since both sides round: this catches NaN and broken tiles, the tests catch precision."""
    bad = []
    for name, a, b, t in zip(names, got, want, tol):
        if not torch.isfinite(a).all():
            bad.append(f"{name} non-finite")
            continue
        if a.numel() == 0:
            continue
        err = (a.double() - b.double()).abs().max().item()
        scale = max(1.0, b.double().abs().max().item())
        if err > t * scale:
            bad.append(f"{name} max error {err:.3g} > {t * scale:.3g}")
    return "; ".join(bad)


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


def _markdown(title: str, header: list[str], lines) -> None:
    """A markdown table under an optional `## title`; `lines` yields each row's cells."""
    if title:
        print(f"\n## {title}")
    print("| " + " | ".join(header) + " |")
    print("|" + "---|" * len(header))
    for cells in lines:
        print("| " + " | ".join(cells) + " |")


def print_table(rows: list[Row], title: str = "") -> None:
    _markdown(title, ["section", "case", "impl", "fwd ms", "bwd ms", "fwd TFLOP/s", "bwd TFLOP/s", "peak MB", "notes"],
              ([r.section, r.case, r.impl, f"{r.fwd_ms:.3f}", f"{r.bwd_ms:.3f}", f"{r.fwd_tflops:.1f}",
                f"{r.bwd_tflops:.1f}", f"{r.mem_mb:.0f}", " ".join(f"{k}={v}" for k, v in r.extra.items())]
               for r in rows))


def _jsonable(o):
    if isinstance(o, Row):
        return o.__dict__
    if isinstance(o, Stat):
        return {"min": o.min, "median": o.median, "max": o.max, "n": o.n}
    raise TypeError(f"not JSON serializable: {type(o).__name__}")


def dump_json(rows, path: str) -> None:
    """Rows (or a dict/list holding rows and Stats) as JSON; written beside `path`, then renamed over it."""
    tmp = f"{path}.tmp"
    with open(tmp, "w") as f:
        json.dump(rows, f, indent=1, default=_jsonable)
    os.replace(tmp, path)


def load_json(path: str) -> list[Row]:
    """The rows dump_json wrote for one run."""
    with open(path) as f:
        return [Row(**d) for d in json.load(f)]


# Several processes: the same rows timed in each fresh process, summarised per (section, case, impl).


@dataclass(frozen=True)
class Stat:
    """min / median / max of one number over the processes that measured it (n of them; nan ones left out)."""

    min: float
    median: float
    max: float
    n: int

    @classmethod
    def of(cls, values) -> Stat:
        vals = sorted(v for v in values if not math.isnan(v))
        if not vals:
            return cls(math.nan, math.nan, math.nan, 0)
        return cls(vals[0], statistics.median(vals), vals[-1], len(vals))

    @property
    def spread_pct(self) -> float:
        """(max - min) / median in percent; nan below 2 measurements."""
        if self.n < 2 or not self.median:
            return math.nan
        return 100.0 * (self.max - self.min) / abs(self.median)

    def __format__(self, spec: str) -> str:
        if not spec:
            return str(self)
        if self.n == 0:
            return format(math.nan, spec)
        return f"{self.min:{spec}} / {self.median:{spec}} / {self.max:{spec}}"

    def __str__(self) -> str:  # a note: one value when every process agrees
        if self.n and self.min == self.max:
            return format(self.min, ".6g")
        return format(self, ".6g")


class Stats(tuple):
    """A note such as 'x=1.23/1.45' (fwd/bwd ratios) summarised part by part."""

    def __str__(self) -> str:
        return "/".join(f"({s})" if s.n and s.min != s.max else str(s) for s in self)


@dataclass
class AggRow(Row):
    """A Row whose numbers are Stats over `processes` of the processes run."""

    processes: int = 0


_TIMED = ("fwd_ms", "bwd_ms", "fwd_tflops", "bwd_tflops", "mem_mb")


def _number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _numbers(v) -> list[float] | None:
    """'1.23/1.45' -> [1.23, 1.45]; None when v is not such a string."""
    if not isinstance(v, str) or "/" not in v:
        return None
    try:
        return [float(x) for x in v.split("/")]
    except ValueError:
        return None


def _aggregate_note(values: list):
    """One note over the processes that have it: numbers and ratios (as measured in each process) become Stats,
    anything else the distinct values in order."""
    if all(_number(v) for v in values):
        return Stat.of(values)
    parts = [_numbers(v) for v in values]
    if all(p is not None for p in parts) and len({len(p) for p in parts}) == 1:
        return Stats(Stat.of(p[i] for p in parts) for i in range(len(parts[0])))
    distinct = list(dict.fromkeys(str(v) for v in values))
    return distinct[0] if len(distinct) == 1 else "; ".join(distinct)


def aggregate_rows(runs: list[list[Row]]) -> list[AggRow]:
    """Rows of several processes -> one AggRow per (section, case, impl), in first-seen order.

    Times, rates, memory and numeric notes become Stats over the processes that have the row; a ratio note is
    summarised from each process's own ratio (never recomputed from medians). A row missing in some processes
    (a competitor that failed there) is summarised from the rest and notes how many processes it has."""
    groups: dict[tuple, list[Row]] = {}
    for rows in runs:
        seen: dict[tuple, int] = {}
        for r in rows:
            key = (r.section, r.case, r.impl)
            seen[key] = seen.get(key, 0) + 1
            groups.setdefault((*key, seen[key]), []).append(r)  # a repeated row pairs with its repeat elsewhere
    out = []
    for (section, case, impl, _), rows in groups.items():
        extra = {}
        for k in dict.fromkeys(k for r in rows for k in r.extra):
            extra[k] = _aggregate_note([r.extra[k] for r in rows if k in r.extra])
        if len(rows) < len(runs):
            extra["processes"] = f"{len(rows)}/{len(runs)}"
        out.append(AggRow(section, case, impl,
                          **{f: Stat.of(getattr(r, f) for r in rows) for f in _TIMED},
                          extra=extra, processes=len(rows)))
    return out


def largest_spread(rows: list[AggRow]) -> tuple[float, AggRow | None, str]:
    """The row and part (fwd or bwd) whose time varies most between processes: (percent, row, part)."""
    best = (math.nan, None, "")
    for r in rows:
        for part in ("fwd", "bwd"):
            pct = getattr(r, f"{part}_ms").spread_pct
            if not math.isnan(pct) and (best[1] is None or pct > best[0]):
                best = (pct, r, part)
    return best


def print_spread(rows: list[AggRow], title: str = "") -> None:
    """Each row's process-to-process spread of fwd and bwd time, (max - min) / median."""
    _markdown(title, ["case", "impl", "processes", "fwd spread %", "bwd spread %"],
              ([r.case, r.impl, str(r.processes), f"{r.fwd_ms.spread_pct:.1f}", f"{r.bwd_ms.spread_pct:.1f}"]
               for r in rows))


def medians(rows: list[AggRow]) -> list[Row]:
    """Plain Rows holding each Stat's median (what a plot of one process draws)."""

    def med(v):
        if isinstance(v, Stat):
            return v.median
        if isinstance(v, Stats):
            return "/".join(f"{s.median:.2f}" for s in v)
        return v

    return [Row(r.section, r.case, r.impl, **{f: med(getattr(r, f)) for f in _TIMED},
                extra={k: med(v) for k, v in r.extra.items()}) for r in rows]
