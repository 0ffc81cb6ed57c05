"""One-GPU rehearsal of data.balance: W ranks' shares of the same global batches, trained one after another.

    python scripts/bench_balance.py --world 8 --processes 3 [--batches 6] [--warmup 2] [--json out.json] \\
        experiment=gpu_base_skewed [overrides ...]

Each process builds the experiment's model on one device (the plain loop, no pipeline) and, for every global batch
of W x data.batch_size examples, trains each rank's share (forward + backward + optimizer) alone, as drawn
(`none`) and after data.balance=cost's split; the slowest share is the synchronous step of a W-rank job with its
communication excluded (gem/train/rehearse.py). Prints each process's figures and the median over `--processes`
fresh processes: step ms none / cost, the even-split ms and the speedup none / cost.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

FIGURES = ("step_ms_none", "step_ms_cost", "even_ms_none", "even_ms_cost", "speedup")


def _line(label: str, s: dict) -> str:
    return (f"{label}: step none {s['step_ms_none']:.1f} ms | cost {s['step_ms_cost']:.1f} ms | even split "
            f"{s['even_ms_cost']:.1f} ms | speedup {s['speedup']:.3f}x (slowest of the shares, communication excluded)")


def _child(a: argparse.Namespace, overrides: list[str]) -> dict:
    from gem.train.rehearse import build_trainer, rehearse

    trainer = build_trainer(overrides)
    try:
        r = rehearse(trainer, a.world, a.batches, a.warmup)
    finally:
        trainer.close()
    out = {**r.summary(), "share_ms": r.share_ms}
    print(_line(f"bench_balance W={a.world}", out), flush=True)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.strip().splitlines()[0])
    ap.add_argument("--world", type=int, default=8)
    ap.add_argument("--processes", type=int, default=3, help="fresh processes, one after another (1: this one)")
    ap.add_argument("--batches", type=int, default=6, help="measured global batches per process")
    ap.add_argument("--warmup", type=int, default=2, help="global batches run first, not measured")
    ap.add_argument("--json", default=None)
    a, overrides = ap.parse_known_args(argv)
    if a.world < 1 or a.processes < 1 or a.batches < 1 or a.warmup < 0:
        ap.error("--world, --processes and --batches must be >= 1, --warmup >= 0")
    if a.processes == 1:
        runs = [_child(a, overrides)]
    else:
        runs = []
        with tempfile.TemporaryDirectory() as d:
            for p in range(a.processes):
                path = os.path.join(d, f"run{p}.json")
                cmd = [sys.executable, os.path.abspath(__file__), "--processes", "1", "--world", str(a.world),
                       "--batches", str(a.batches), "--warmup", str(a.warmup), "--json", path, *overrides]
                r = subprocess.run(cmd, check=False)
                if r.returncode != 0:
                    print(f"bench_balance: error: process {p} failed ({r.returncode})", file=sys.stderr)
                    return r.returncode
                with open(path) as f:
                    runs.append(json.load(f)["processes"][0])
    summary = {k: statistics.median(r[k] for r in runs) for k in FIGURES}
    if a.processes > 1:
        print(_line(f"bench_balance W={a.world} median of {a.processes} processes", summary), flush=True)
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"world": a.world, "overrides": overrides, "processes": runs, "summary": summary}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
