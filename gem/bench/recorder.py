"""What the training benchmark measures while the trainer runs: step ends (through `Trainer.on_step_end`), the
trainer's window figures (through `Trainer.on_window`), and the batches it consumed (replayed afterwards)."""

from __future__ import annotations

import time

import torch

from gem.bench.options import BenchError
from gem.bench.profiler import StepProfiler
from gem.train.mfu import CommProbe


class StepRecorder:
    """Hooks the trainer's per-step and per-window callbacks: an event (CUDA) or a clock reading (CPU) at each step's
    end, and the scalars of each log window (the trainer's own MFU/memory figures). A StepProfiler, when given,
    advances at each step's end, after the mark, so its own work lands in the next step. `probe_steps` > 0: a
    CommProbe records the warmup steps before `warmup` (it ends before that step's mark, so reading it stays out of
    the timed steps)."""

    def __init__(self, trainer, profiler: StepProfiler | None = None, warmup: int = 0, probe_steps: int = 0) -> None:
        self.cuda = trainer.is_cuda
        self.marks: list = []
        self.windows: list[tuple[int, dict]] = []
        self.comm: tuple[float, float] | None = None  # (exposed, all) communication, fractions of the probed steps
        self._probe = CommProbe(trainer.device) if probe_steps else None
        self._profiler, self._warmup, self._probe_steps = profiler, warmup, probe_steps
        trainer.on_step_end.append(self.on_step)
        trainer.on_window.append(self.on_window)

    def on_step(self, step: int) -> None:
        probe = self._probe
        if probe is not None and probe.running and step == self._warmup:
            self.comm = probe.stop()
        if self.cuda:
            ev = torch.cuda.Event(enable_timing=True)
            ev.record()
            self.marks.append(ev)
        else:
            self.marks.append(time.perf_counter())
        if self._profiler is not None:
            self._profiler.step()
        if probe is not None and step == self._warmup - self._probe_steps:
            probe.start()

    def on_window(self, step: int, scalars: dict) -> None:
        self.windows.append((int(step), dict(scalars)))

    def step_ms(self) -> list[float]:
        """Milliseconds of step i+1 for i >= 1 (step 1 has no start mark)."""
        if self.cuda:
            torch.cuda.synchronize()
            return [a.elapsed_time(b) for a, b in zip(self.marks, self.marks[1:])]
        return [1e3 * (b - a) for a, b in zip(self.marks, self.marks[1:])]


def replay_batches(trainer, total: int) -> tuple[list[dict], float]:
    """tokens / samples / model FLOPs of the trainer's first `total` batches on this rank (same data stream), and
    the host milliseconds one batch takes to produce (on the training thread unless data.num_workers > 0)."""
    from gem.data import build_dataset
    from gem.model.flops import example_cost

    ds = build_dataset(trainer.cfgs.data, trainer.rank, trainer.world_size, split="train",
                       cost=example_cost(trainer.cfgs.model))
    out, it, make_s = [], iter(ds), 0.0
    for _ in range(total):
        t0 = time.perf_counter()
        b = next(it, None)
        make_s += time.perf_counter() - t0
        if b is None:
            raise BenchError(f"the training data ended after {len(out)} batches; the run needs {total}")
        out.append({"tokens": int(b.seq_offsets[-1]), "samples": int(b.batch_size), "flops": float(trainer.inner.flops(b))})
    return out, 1e3 * make_s / total


def window_check(windows: list[tuple[int, dict]], per_step: list[dict]) -> float | None:
    """Largest relative gap between the trainer's window FLOPs and the replayed batches' FLOPs (None: no window
    carried the figures)."""
    worst, prev = None, 0
    for step, s in windows:
        n = step - prev
        mine = sum(b["flops"] for b in per_step[prev:step])
        prev = step
        if "perf/tflops_per_device" not in s or "perf/step_time_s" not in s:
            continue
        theirs = s["perf/tflops_per_device"] * 1e12 * s["perf/step_time_s"] * n
        worst = max(worst or 0.0, abs(mine - theirs) / max(mine, 1.0))
    return worst