"""The training benchmark's arguments: its own options, then Hydra overrides (key=value) for the config."""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from gem.bench.profiler import TOP_ROWS

DESCRIPTION = ("Training throughput and MFU of one experiment, measured through the real trainer "
               "(gem.train.Trainer).")

# Keys the benchmark sets itself; the rest of the config is whatever the overrides compose.
OWNED = ("train.log_every", "train.eval_every", "data.eval_batches", "train.checkpoint.every",
          "train.stop_at_step", "train.resume", "train.mfu.comm_probe_every")


class BenchError(ValueError):
    """A bad argument or config; printed as one line."""


def parse_args(argv: list[str] | None) -> tuple[argparse.Namespace, list[str]]:
    prog = "python -m gem.bench" if os.path.basename(sys.argv[0]) == "__main__.py" else None
    p = argparse.ArgumentParser(prog=prog, description=DESCRIPTION,
                                epilog="Remaining arguments are Hydra overrides, e.g. experiment=gpu_base")
    p.add_argument("--warmup", type=int, default=10, help="untimed steps first (compile, autotune, allocator)")
    p.add_argument("--steps", type=int, default=30, help="timed steps (ignored when train.steps=N is given)")
    p.add_argument("--window", type=int, default=10,
                   help="the trainer's log window (it syncs the host at each window end); the largest divisor "
                        "of gcd(warmup, timed steps) up to this is used")
    p.add_argument("--json", default=None, help="write the results (rank 0) to this file")
    p.add_argument("--matmul-n", type=int, default=8192, help="size of the measured bf16 matmul peak (CUDA)")
    p.add_argument("--no-matmul", action="store_true", help="skip the measured matmul peak")
    ref = p.add_mutually_exclusive_group()
    ref.add_argument("--single-gpu-tflops", type=float, default=None,
                     help="model TFLOP/s of a 1-GPU run of the same experiment: adds the scaling against it")
    ref.add_argument("--single-gpu-json", default=None, help="read that figure from a 1-GPU run's --json file")
    p.add_argument("--run-dir", default=None, help="give the trainer a run dir (TensorBoard, metrics.jsonl)")
    p.add_argument("--dump-stacks-after", type=float, default=None, metavar="S",
                   help="every rank prints its Python stacks after S seconds (where each waits, for a hung run)")
    p.add_argument("--comm-probe-steps", type=int, default=2,
                   help="on N > 1 ranks, profile this many of the last warmup steps for exposed communication "
                        "(0: off; needs --warmup > this)")
    p.add_argument("--profile-steps", type=int, default=0,
                   help="run the last K timed steps under torch.profiler and print the top ops (0: off)")
    p.add_argument("--profile-sources", default="",
                   help="with --profile-steps: comma list of op names (e.g. 'aten::copy_,aten::add_') whose time is "
                        "also split by the gem source lines that called them (records Python stacks)")
    p.add_argument("--profile-top", type=int, default=TOP_ROWS,
                   help=f"with --profile-steps: how many ops and kernels the tables list ({TOP_ROWS})")
    p.add_argument("--profile-dir", default=None,
                   help="with --profile-steps: write each rank's chrome trace here (trace_rank{r}.json)")
    p.add_argument("--processes", type=int, default=1,
                   help="run the benchmark in this many fresh single-rank processes, one after another, and print "
                        "min / median / max over them")
    p.add_argument("--baseline", default=None, metavar="CHECKOUT",
                   help="another gem checkout: its scripts/bench_train.py runs the same benchmark in as many fresh "
                        "processes, alternating with this one's, and the summary compares the two")
    p.add_argument("--write-reference", default=None, metavar="PATH",
                   help="write the measured step (one GPU; with --processes, the median of the process means) as "
                        "gem plan's reference step to PATH (the shipped one: gem/plan/reference.json); the only "
                        "override allowed is experiment=NAME")
    args, rest = p.parse_known_args(argv)
    unknown = [a for a in rest if a.startswith("-")]
    if unknown:
        p.error(f"unknown option(s) {unknown}; Hydra overrides look like key=value")
    bad = [a for a in rest if "=" not in a]
    if bad:
        p.error(f"not a Hydra override (key=value): {bad}")
    if args.warmup < 1:
        p.error(f"--warmup must be >= 1 (the timed steps start after a warmup step), got {args.warmup}")
    if args.steps < 1:
        p.error(f"--steps must be >= 1, got {args.steps}")
    if args.window < 1:
        p.error(f"--window must be >= 1, got {args.window}")
    if args.matmul_n < 256:
        p.error(f"--matmul-n must be >= 256, got {args.matmul_n}")
    if args.comm_probe_steps < 0:
        p.error(f"--comm-probe-steps must be >= 0, got {args.comm_probe_steps}")
    if args.profile_steps < 0:
        p.error(f"--profile-steps must be >= 0, got {args.profile_steps}")
    if args.profile_dir and not args.profile_steps:
        p.error("--profile-dir needs --profile-steps K > 0")
    if args.profile_top < 1:
        p.error("--profile-top must be at least 1")
    if args.profile_sources and not args.profile_steps:
        p.error("--profile-sources needs --profile-steps K > 0")
    if args.processes < 1:
        p.error(f"--processes must be >= 1, got {args.processes}")
    if args.baseline is not None and not (Path(args.baseline) / "scripts" / "bench_train.py").is_file():
        p.error(f"--baseline {args.baseline}: no scripts/bench_train.py there (give the root of a gem checkout)")
    if (args.processes > 1 or args.baseline) and args.profile_dir:
        p.error("--profile-dir with --processes/--baseline: each process would overwrite the traces; profile one")
    if args.single_gpu_tflops is not None and not args.single_gpu_tflops > 0:
        p.error(f"--single-gpu-tflops must be > 0, got {args.single_gpu_tflops}")
    if args.write_reference is not None and (len(rest) != 1 or not rest[0].startswith("experiment=")):
        p.error("--write-reference: gem plan composes the reference experiment as shipped, so the only override "
                f"allowed is experiment=NAME (got {rest or 'none'})")
    for o in rest:
        key = o.split("=", 1)[0].lstrip("+~")
        if key in OWNED:
            p.error(f"{key} is set by the benchmark; drop that override")
    return args, rest
