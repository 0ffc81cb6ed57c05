"""Step time while a checkpoint is saved, inline vs in the background (`train.checkpoint.async`), through the real
trainer on one GPU. Writes JSON: per mode the median normal step, the step that called save (it includes the copy to
host memory) and the slowest step while the background write was in flight, each as ms and as a ratio to the
normal step.

    python tests/dist/gpu_checkpoint_step.py --out ckpt_step.json experiment=gpu_base

Each step's end is the host after `torch.cuda.synchronize()` in a step hook (the same for every mode).
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
import tempfile
import time

import torch
import torch.distributed as dist


def measure(overrides: list[str], background: bool, steps: int, every: int) -> dict:
    from gem.config import compose
    from gem.train.trainer import Trainer

    with tempfile.TemporaryDirectory() as run_dir:
        cfg = compose([*overrides, f"train.steps={steps}", f"train.checkpoint.every={every}", "train.eval_every=0",
                       "data.eval_batches=0", "train.resume=false", f"train.checkpoint.async={str(background).lower()}",
                       f"train.log_every={every}"])
        ends: list[float] = []
        in_flight: list[bool] = []

        def hook(trainer) -> None:
            if torch.cuda.is_available():
                torch.cuda.synchronize()
            ends.append(time.perf_counter())
            pending = trainer.checkpointer.checkpointer._pending
            in_flight.append(pending is not None and not pending[2].is_set())

        trainer = Trainer(cfg, run_dir=run_dir, hooks=(hook,))
        try:
            trainer.fit()
        finally:
            trainer.close()
    ms = [1e3 * (b - a) for a, b in itertools.pairwise(ends)]  # ms[i]: step i + 2 (1-based)
    step_of = {i: i + 2 for i in range(len(ms))}
    warm = every  # the first checkpoint interval warms up (compile, autotune, allocator)
    save_steps = set(range(2 * every, steps + 1, every))
    saving = [ms[i] for i, s in step_of.items() if s in save_steps and s > warm]
    during = [ms[i] for i in range(len(ms)) if step_of[i] > warm and step_of[i] not in save_steps
              and in_flight[i]]
    normal = [ms[i] for i in range(len(ms)) if step_of[i] > warm and step_of[i] not in save_steps and not in_flight[i]
              and step_of[i] - 1 not in save_steps]
    if not normal or not saving:
        what = "normal" if saving else "save"
        raise SystemExit(f"gpu_checkpoint_step: no {what} step to compare: a write outlasted --every {every} steps; "
                         "raise --every (and --steps to at least 3 intervals)")
    base = statistics.median(normal)
    out = {"normal_ms": base, "save_step_ms": statistics.median(saving), "normal_steps": len(normal)}
    out["save_step_ratio"] = out["save_step_ms"] / base
    if during:
        out["while_writing_max_ms"] = max(during)
        out["while_writing_max_ratio"] = max(during) / base
        out["while_writing_steps"] = len(during)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    # gpu_base's checkpoint is ~8 GB: its background write spans tens of steps, so the interval must outlast it
    ap.add_argument("--steps", type=int, default=120)
    ap.add_argument("--every", type=int, default=40)
    a, overrides = ap.parse_known_args()
    from gem.cli.quiet import quiet_third_party

    quiet_third_party()
    result = {"device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
              "torch": torch.__version__, "overrides": overrides, "steps": a.steps, "every": a.every}
    for mode, background in (("async", True), ("inline", False)):  # the JSON is rewritten as each mode ends
        result[mode] = measure(overrides, background, a.steps, a.every)
        print(mode, json.dumps(result[mode]), flush=True)
        with open(a.out, "w") as f:
            json.dump(result, f, indent=1)
    if dist.is_initialized():
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
