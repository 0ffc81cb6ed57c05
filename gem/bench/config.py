"""The config a benchmark run trains: composed as gem-train composes it (gem.config), with the benchmark's own
settings."""

from __future__ import annotations

import math

from gem.bench.options import BenchError


def compose(overrides: list[str], world_size: int):
    """The composed config (as gem-train composes it), or BenchError with gem-train's one-line message."""
    from gem.config import UserError
    from gem.config import compose as compose_config

    try:
        return compose_config(overrides, job_name="gem_bench")
    except UserError as e:
        raise BenchError(str(e)) from None


def plan_steps(cfg, overrides: list[str], warmup: int, steps: int, window: int) -> tuple[int, int, int]:
    """(total, timed, log window): `train.steps=N` among the overrides fixes the total."""
    if any(o.split("=", 1)[0].lstrip("+") == "train.steps" for o in overrides):
        total = int(cfg.train.steps)
        if total <= warmup:
            raise BenchError(f"train.steps={total}: must exceed --warmup {warmup} to leave timed steps")
    else:
        total = warmup + steps
    timed = total - warmup
    g = math.gcd(warmup, timed)
    win = max(d for d in range(1, min(window, g) + 1) if g % d == 0)
    return total, timed, win


def apply_bench_settings(cfg, total: int, warmup: int, log_every: int, measured_peak: float | None) -> None:
    """Only training steps: no evaluation, no checkpoints, no early stop; the LR warmup fits in the run."""
    t = cfg.train
    t.steps = total
    t.warmup_steps = min(int(t.warmup_steps), total)
    t.log_every = log_every
    t.eval_every = 0
    t.stop_at_step = None
    t.resume = False
    t.checkpoint.every = 0
    t.mfu.comm_probe_every = 0  # the benchmark probes in its warmup (StepRecorder), away from the timed steps
    if measured_peak:
        t.mfu.measured_peak_flops = float(measured_peak)
    cfg.data.eval_batches = 0