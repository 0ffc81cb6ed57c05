"""Step time while a checkpoint is saved, inline vs in the background (`train.checkpoint.async`), through the real
trainer on one GPU. Writes JSON: per mode the median normal step, the step that called save (it includes the copy to
host memory) and the median and slowest step while the background write was in flight, each as ms and as a ratio
to the normal step (the inline mode's where the writes leave the background mode none), and how many steps one
write spanned.

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
    busy = [a or b for a, b in itertools.pairwise(in_flight)]  # in flight at the step's start or end
    return classify(ms, busy, steps, every)


def classify(ms: list[float], in_flight: list[bool], steps: int, every: int) -> dict:
    """Steps after the first interval (compile, autotune, allocator) sorted into: the steps that called save, the
    steps during which a background write was in flight, and normal steps (neither, nor the step right after a
    save). Also how many steps in a row one background write spanned at most."""
    step_of = [i + 2 for i in range(len(ms))]
    save_steps = set(range(2 * every, steps + 1, every))
    out: dict = {"save_step_ms": [], "while_writing_ms": [], "normal_ms": [], "write_spans_steps": 0}
    run = 0
    for t, s, busy in zip(ms, step_of, in_flight):
        run = run + 1 if busy else 0
        if s <= every:
            continue
        out["write_spans_steps"] = max(out["write_spans_steps"], run)
        if s in save_steps:
            out["save_step_ms"].append(t)
        elif busy:
            out["while_writing_ms"].append(t)
        elif s - 1 not in save_steps:
            out["normal_ms"].append(t)
    return out


def summarise(raw: dict, base: float | None) -> dict:
    """Medians and ratios to `base` (this mode's normal step, else the other mode's: a background write that
    outlasts the interval leaves no normal step)."""
    out = {"normal_steps": len(raw["normal_ms"]), "write_spans_steps": raw["write_spans_steps"]}
    if raw["normal_ms"]:
        base = statistics.median(raw["normal_ms"])
    if base is None:
        raise SystemExit("gpu_checkpoint_step: no normal step in either mode; raise --every")
    out["normal_ms"] = base
    if raw["save_step_ms"]:
        out["save_step_ms"] = statistics.median(raw["save_step_ms"])
        out["save_step_ratio"] = out["save_step_ms"] / base
    if raw["while_writing_ms"]:
        during = raw["while_writing_ms"]
        out.update(while_writing_median_ms=statistics.median(during), while_writing_max_ms=max(during),
                   while_writing_median_ratio=statistics.median(during) / base,
                   while_writing_max_ratio=max(during) / base, while_writing_steps=len(during))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    # gpu_base's checkpoint is ~8 GB: on an H100 its background write outlasted 40 steps (5.4 s)
    ap.add_argument("--steps", type=int, default=240)
    ap.add_argument("--every", type=int, default=80)
    a, overrides = ap.parse_known_args()
    from gem.cli.quiet import quiet_third_party

    quiet_third_party()
    result = {"device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
              "torch": torch.__version__, "overrides": overrides, "steps": a.steps, "every": a.every}
    raw = {}
    for mode, background in (("async", True), ("inline", False)):  # the JSON is rewritten as each mode ends
        raw[mode] = measure(overrides, background, a.steps, a.every)
        result[f"{mode}_raw"] = raw[mode]
        with open(a.out, "w") as f:
            json.dump(result, f, indent=1)
    inline = summarise(raw["inline"], None)
    result["inline"] = inline
    result["async"] = summarise(raw["async"], inline["normal_ms"])
    for mode in ("async", "inline"):
        print(mode, json.dumps(result[mode]), flush=True)
    with open(a.out, "w") as f:
        json.dump(result, f, indent=1)
    if dist.is_initialized():
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
