"""Simulated rank imbalance with and without data.balance=cost, on the host (no GPU).

    python scripts/balance_sim.py [--batches 1000] [--worlds 2,8,64,512] [--seed 0] [experiment ...]

For each experiment preset (default: gpu_base gpu_base_skewed) and world size W: `--batches` global batches of
W x data.batch_size history lengths drawn from the preset's length law, each example costed by the model's FLOP
model (gem.model.flops.example_flops), and E[max] / mean of the ranks' FLOPs as drawn (`none`: rank r takes the
r-th block of examples) and after data.balance's equal-count split (`cost`) — the factor by which a synchronous
step exceeds a perfectly even one (gem/plan/straggler.py). `split ms`: host milliseconds of one partition of a
global batch (median of 20).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.strip().splitlines()[0])
    ap.add_argument("experiments", nargs="*", default=["gpu_base", "gpu_base_skewed"])
    ap.add_argument("--batches", type=int, default=1000)
    ap.add_argument("--worlds", default="2,8,64,512")
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args(argv)

    from gem.data.balance import HISTORY, partition
    from gem.data.synthetic import sample_lengths
    from gem.model.flops import example_flops
    from gem.plan.cli import compose
    from gem.plan.straggler import simulate

    print("| experiment | per-rank batch | W | global batch | E[max]/mean none | E[max]/mean cost | split ms |")
    print("|---|---|---|---|---|---|---|")
    for name in a.experiments:
        cfgs = compose([f"experiment={name}"])
        b = cfgs.data.batch_size
        for w in (int(x) for x in a.worlds.split(",")):
            s = simulate(cfgs.model, cfgs.data.schema, b, w, a.batches, a.seed)
            gen = torch.Generator().manual_seed(a.seed + 1)
            times = []
            for _ in range(20):
                c = example_flops(cfgs.model, {HISTORY: sample_lengths(cfgs.data.schema, w * b, gen)}).numpy()
                t0 = time.perf_counter()
                partition(c, w)
                times.append(1e3 * (time.perf_counter() - t0))
            print(f"| {name} | {b} | {w} | {w * b} | {s.none:.3f} | {s.cost:.4f} | {statistics.median(times):.1f} |",
                  flush=True)


if __name__ == "__main__":
    main()
