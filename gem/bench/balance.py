"""data.balance measured: the simulated straggler factor (host only) and a one-device rehearsal of W ranks.

    python scripts/balance_sim.py [--batches 1000] [--worlds 2,8,64,512] [--seed 0] [experiment ...]
    python scripts/bench_balance.py --world 8 --processes 3 [--batches 6] [--warmup 2] [--repeats 2] \\
        [--json out.json] experiment=gpu_base_skewed [overrides ...]

Simulation (`simulate_main`): for each experiment preset (default: gpu_base gpu_base_skewed) and world size W,
`--batches` global batches of W x data.batch_size examples with history lengths drawn from each history's length
law, each example costed by the model's FLOP model (gem.model.flops.example_flops); printed: E[max] / mean of the
ranks' FLOPs as drawn (`none`: rank r takes the r-th block of examples) and after data.balance's equal-count split
(`cost`), the factor by which a synchronous step exceeds a perfectly even one (gem/plan/straggler.py), and the host
milliseconds of one partition of a global batch (`split ms`, median of 20).

Rehearsal (`main`): a synchronous step of W ranks lasts as long as its slowest rank's forward + backward +
optimizer step, plus the collectives. Each process builds the experiment's model on one device (the plain loop, no
pipeline) and runs the W shares of each global batch one after another, each timed alone (host clock around the
step, the device synchronised before and after; the copy to the device is not timed; the fastest of `--repeats`
back-to-back steps of the share, so compiling and tuning for lengths seen first are not counted): the slowest share
is the step a W-rank job would wait for, communication excluded, the mean share what a perfectly even split would
take. Shares: as drawn (`none`: rank r's batch of the step) and after data.balance=cost's split, for the same
global batches, the two alternating which goes first. Printed: each process's figures and the median over
`--processes` fresh processes (step ms none / cost, the even-split ms, the speedup none / cost).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field

import numpy as np
import torch

from gem.bench.options import BenchError
from gem.bench.processes import stderr_tail, this_tree

MODES = ("none", "cost")
FIGURES = ("step_ms_none", "step_ms_cost", "even_ms_none", "even_ms_cost", "speedup")


# ---- simulation ------------------------------------------------------------------------------------------------
def typed_configs(overrides: list[str]):
    """The typed training configs (gem.train.trainer.Configs) these overrides compose to, as gem-train composes."""
    from gem.bench.config import compose
    from gem.train.trainer import build_configs

    try:
        return build_configs(compose(overrides, 1))
    except ValueError as e:
        raise BenchError(str(e).splitlines()[0]) from None


def simulate_rows(experiments: list[str], worlds: list[int], batches: int, seed: int, timings: int = 20):
    """Per (experiment, W): the simulated straggler factors and the host ms of one partition (median of `timings`)."""
    from gem.data.balance import partition
    from gem.data.synthetic import sample_lengths
    from gem.model.flops import example_flops
    from gem.plan.straggler import simulate

    for name in experiments:
        cfgs = typed_configs([f"experiment={name}"])
        schema, b = cfgs.data.schema, cfgs.data.batch_size
        for w in worlds:
            s = simulate(cfgs.model, schema, b, w, batches, seed, cfgs.data.max_candidates)
            gen = torch.Generator().manual_seed(seed + 1)
            ms = []
            for _ in range(timings):
                lengths = {h.name: sample_lengths(h, w * b, gen) for h in schema.histories}
                c = example_flops(cfgs.model, lengths).numpy()
                t0 = time.perf_counter()
                partition(c, w)
                ms.append(1e3 * (time.perf_counter() - t0))
            yield {"experiment": name, "batch": b, "world": w, "none": s.none, "cost": s.cost,
                   "split_ms": statistics.median(ms)}


def simulate_main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="balance_sim", description="Simulated rank imbalance with and without "
                                 "data.balance=cost, on the host (no GPU).")
    ap.add_argument("experiments", nargs="*", default=["gpu_base", "gpu_base_skewed"])
    ap.add_argument("--batches", type=int, default=1000, help="global batches drawn per row")
    ap.add_argument("--worlds", default="2,8,64,512", help="comma-separated world sizes")
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args(argv)
    try:
        worlds = [int(x) for x in a.worlds.split(",")]
    except ValueError:
        ap.error(f"--worlds: expected comma-separated integers, got {a.worlds!r}")
    if a.batches < 1 or min(worlds) < 1:
        ap.error("--batches and every world size must be >= 1")
    print("| experiment | per-rank batch | W | global batch | E[max]/mean none | E[max]/mean cost | split ms |")
    print("|---|---|---|---|---|---|---|")
    try:
        for r in simulate_rows(a.experiments, worlds, a.batches, a.seed):
            print(f"| {r['experiment']} | {r['batch']} | {r['world']} | {r['world'] * r['batch']} | {r['none']:.3f} "
                  f"| {r['cost']:.4f} | {r['split_ms']:.1f} |", flush=True)
    except BenchError as e:
        print(f"balance_sim: error: {e}", file=sys.stderr)
        return 2
    return 0


# ---- rehearsal -------------------------------------------------------------------------------------------------
@dataclass
class Rehearsal:
    """Per measured global batch and mode: every share's step milliseconds (rank order)."""

    world: int
    share_ms: dict[str, list[list[float]]] = field(default_factory=lambda: {m: [] for m in MODES})

    def step_ms(self, mode: str) -> float:
        """Mean over global batches of the slowest share: the synchronous step."""
        return statistics.fmean(max(s) for s in self.share_ms[mode])

    def even_ms(self, mode: str) -> float:
        """Mean over global batches of the mean share: a perfectly even split of the same work."""
        return statistics.fmean(statistics.fmean(s) for s in self.share_ms[mode])

    def summary(self) -> dict[str, float]:
        out = {f"step_ms_{m}": self.step_ms(m) for m in MODES}
        out.update({f"even_ms_{m}": self.even_ms(m) for m in MODES})
        out["speedup"] = out["step_ms_none"] / out["step_ms_cost"]
        return out


def build_trainer(overrides: list[str]):
    """A one-rank Trainer for these training overrides, on the plain loop (each share's step timed alone)."""
    from gem.train.trainer import Trainer

    cfgs = typed_configs([*overrides, "train.pipeline=none", "train.tensorboard=false", "train.eval_every=0",
                          "train.checkpoint.every=0"])
    return Trainer(cfgs)


def shares(trainer, world: int, index: int) -> dict[str, list]:
    """The W shares of global batch `index` of the trainer's training data: as drawn and balanced."""
    from gem.data import build_dataset
    from gem.data.balance import BalancedDataset, take_rows
    from gem.model.flops import example_cost

    data = dataclasses.replace(trainer.cfgs.data, balance="none")
    source = build_dataset(data, 0, world, split="train")
    drawn = [source.batch(index, rank=q) for q in range(world)]
    whole, part, _ = BalancedDataset(source, example_cost(trainer.cfgs.model)).split(index)
    balanced = [take_rows(whole, np.flatnonzero(part == q)) for q in range(world)]
    return {"none": drawn, "cost": balanced}


def _timed_step(trainer, batch, step: int) -> float:
    from gem.train.step import train_step

    b = batch.to(trainer.device)
    sync = torch.cuda.synchronize if trainer.device.type == "cuda" else (lambda: None)
    sync()
    t0 = time.perf_counter()
    train_step(trainer.model, trainer.optimizer, b, trainer.step_cfg, step)
    sync()
    return 1e3 * (time.perf_counter() - t0)


def rehearse(trainer, world: int, batches: int, warmup: int = 1, repeats: int = 2) -> Rehearsal:
    """`warmup` global batches (both modes, not recorded), then `batches` measured ones. Each share is stepped
    `repeats` times back to back and counts its fastest step: a share's first step can include compiling and
    tuning kernels for lengths not seen before (seconds on a GPU), which a long job pays once, not every step."""
    out = Rehearsal(world)
    step = 0
    for i in range(warmup + batches):
        by_mode = shares(trainer, world, i)
        for mode in (MODES if i % 2 == 0 else MODES[::-1]):
            times = []
            for b in by_mode[mode]:
                best = float("inf")
                for _ in range(repeats):
                    step += 1
                    best = min(best, _timed_step(trainer, b, step))
                times.append(best)
            if i >= warmup:
                out.share_ms[mode].append(times)
    return out


def _line(label: str, s: dict) -> str:
    return (f"{label}: step none {s['step_ms_none']:.1f} ms | cost {s['step_ms_cost']:.1f} ms | even split "
            f"{s['even_ms_cost']:.1f} ms | speedup {s['speedup']:.3f}x (slowest of the shares, communication excluded)")


def _one_process(a: argparse.Namespace, overrides: list[str]) -> dict:
    trainer = build_trainer(overrides)
    try:
        r = rehearse(trainer, a.world, a.batches, a.warmup, a.repeats)
    finally:
        trainer.close()
    out = {**r.summary(), "share_ms": r.share_ms}
    print(_line(f"bench_balance W={a.world}", out), flush=True)
    return out


def _processes(a: argparse.Namespace, overrides: list[str]) -> list[dict]:
    """`a.processes` fresh one-process runs of this gem, one after another."""
    _, root = this_tree()
    paths = [str(root), *(p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p)]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(paths))
    runs = []
    with tempfile.TemporaryDirectory(prefix="bench_balance.") as d:
        for p in range(a.processes):
            path = os.path.join(d, f"run{p}.json")
            cmd = [sys.executable, "-m", "gem.bench.balance", "--processes", "1", "--world", str(a.world),
                   "--batches", str(a.batches), "--warmup", str(a.warmup), "--repeats", str(a.repeats),
                   "--json", path, *overrides]
            r = subprocess.run(cmd, check=False, env=env, capture_output=True, text=True)
            sys.stdout.write(r.stdout)
            if r.returncode != 0:
                raise BenchError(f"process {p + 1} failed (exit status {r.returncode}): {stderr_tail(r.stderr)}")
            with open(path) as f:
                runs.append(json.load(f)["processes"][0])
    return runs


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="bench_balance", description="One-device rehearsal of data.balance: W ranks' "
                                 "shares of the same global batches, trained one after another.")
    ap.add_argument("--world", type=int, default=8)
    ap.add_argument("--processes", type=int, default=3, help="fresh processes, one after another (1: this one)")
    ap.add_argument("--batches", type=int, default=6, help="measured global batches per process")
    ap.add_argument("--warmup", type=int, default=2, help="global batches run first, not measured")
    ap.add_argument("--repeats", type=int, default=2, help="steps of each share back to back; its fastest counts")
    ap.add_argument("--json", default=None)
    a, overrides = ap.parse_known_args(argv)
    if a.world < 1 or a.processes < 1 or a.batches < 1 or a.warmup < 0 or a.repeats < 1:
        ap.error("--world, --processes, --batches and --repeats must be >= 1, --warmup >= 0")
    try:
        runs = [_one_process(a, overrides)] if a.processes == 1 else _processes(a, overrides)
    except BenchError as e:
        print(f"bench_balance: error: {e}", file=sys.stderr)
        return 2
    summary = {k: statistics.median(r[k] for r in runs) for k in FIGURES}
    if a.processes > 1:
        print(_line(f"bench_balance W={a.world} median of {a.processes} processes", summary), flush=True)
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"world": a.world, "overrides": overrides, "processes": runs, "summary": summary}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
