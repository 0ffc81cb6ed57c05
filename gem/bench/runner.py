"""One training benchmark run (single process or under torchrun), and the entry point that picks it or the
fresh-process runs."""

from __future__ import annotations

import argparse
import faulthandler
import json
import logging
import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

from gem.bench.config import apply_bench_settings, compose, plan_steps
from gem.bench.options import BenchError, parse_args
from gem.bench.processes import run_processes
from gem.bench.profiler import StepProfiler
from gem.bench.recorder import StepRecorder, replay_batches
from gem.bench.report import aggregate, print_profile, print_report, rank_result, single_gpu_reference
from gem.bench.tuned import save_reference


def _setup_logging(rank: int) -> None:
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(name)s: %(message)s", stream=sys.stdout)
    logging.getLogger("gem").setLevel(logging.INFO if rank == 0 else logging.WARNING)
    logging.getLogger("torchrec").setLevel(logging.ERROR)


def run(args: argparse.Namespace, overrides: list[str], argv: list[str] | None = None) -> int:
    from gem.parallel.dims import init_distributed
    from gem.train.mfu import device_peak_flops, measure_matmul_peak
    from gem.train.trainer import Trainer, build_configs

    rank = int(os.environ.get("RANK", "0"))
    world = int(os.environ.get("WORLD_SIZE", "1"))
    _setup_logging(rank)
    cfg = compose(overrides, world)
    total, timed, log_every = plan_steps(cfg, overrides, args.warmup, args.steps, args.window)
    apply_bench_settings(cfg, total, args.warmup, log_every, None)
    try:
        cfgs = build_configs(cfg, world)  # every validator, before any process group or GPU work
    except (ValueError, TypeError, KeyError) as e:
        raise BenchError(str(e).splitlines()[0]) from None
    if args.write_reference and world > 1:
        raise BenchError(f"--write-reference: the reference step is of one GPU; this run has {world} ranks")
    probe_steps = args.comm_probe_steps if world > 1 else 0
    if probe_steps and probe_steps >= args.warmup:
        raise BenchError(f"--comm-probe-steps {probe_steps} needs --warmup > {probe_steps} (got {args.warmup}); "
                         "--comm-probe-steps 0 turns it off")
    if args.profile_steps > timed:
        raise BenchError(f"--profile-steps {args.profile_steps}: more than the {timed} timed steps")
    if probe_steps and args.profile_steps == timed:  # the profiler's warmup step would overlap the probe
        raise BenchError(f"--profile-steps {args.profile_steps}: at most {timed - 1} on {world} ranks (or "
                         "--comm-probe-steps 0)")
    if rank == 0 and log_every < 5:
        print(f"note: warmup {args.warmup} and {timed} timed steps share no divisor >= 5: the trainer syncs the host "
              f"every {log_every} step(s), which can cost throughput", flush=True)

    device = init_distributed(cfgs.comm.timeout_s)
    if args.write_reference and device.type != "cuda":
        raise BenchError("--write-reference: the reference step is a GPU's; this run is on the CPU")
    measured = None
    if device.type == "cuda" and not args.no_matmul:
        measured = measure_matmul_peak(device, n=args.matmul_n)
        apply_bench_settings(cfg, total, args.warmup, log_every, measured)
        torch.cuda.empty_cache()

    trainer = Trainer(cfg, run_dir=args.run_dir)
    sources = tuple(x.strip() for x in args.profile_sources.split(",") if x.strip())
    profiler = StepProfiler(total, args.profile_steps, trainer.is_cuda, sources) if args.profile_steps else None
    try:
        rec = StepRecorder(trainer, profiler, args.warmup, probe_steps)
        t0 = time.perf_counter()
        if profiler is not None:
            profiler.start()
        try:
            result = trainer.fit()
        finally:
            if profiler is not None:
                profiler.stop()
        run_s = time.perf_counter() - t0
        per_step, data_ms = replay_batches(trainer, total)
        mine = rank_result(trainer, rec, per_step, args.warmup, total, result.losses, measured, args.profile_steps)
        mine["data_ms_per_batch"] = data_ms
        if profiler is not None:
            if not profiler.recorded():
                raise RuntimeError("the profiler recorded nothing: the trainer never reached the profiled steps")
            mine["profile"] = profiler.summary(trainer.rank, args.profile_top)
            mine["profile"]["trace"] = profiler.export(args.profile_dir, trainer.rank) if args.profile_dir else None
    finally:
        trainer.close()
    ranks = [mine]
    if trainer.world_size > 1:
        ranks = [None] * trainer.world_size
        dist.all_gather_object(ranks, mine)
    if trainer.rank != 0:
        return 0
    profiles = [r.pop("profile") for r in ranks] if profiler is not None else None

    ref, ref_src = single_gpu_reference(args, trainer.cfgs.model.name, trainer.cfgs.data)
    vendor = device_peak_flops(trainer.device)
    agg = aggregate(ranks, trainer.world_size, ref, vendor)
    conf = {
        "overrides": overrides,
        "model": trainer.cfgs.model.name,
        "world_size": trainer.world_size,
        "local_world_size": int(os.environ.get("LOCAL_WORLD_SIZE", trainer.world_size)),
        "parallel": trainer.par.dims.describe(),
        "batch_size": trainer.cfgs.data.batch_size,
        "max_len": trainer.cfgs.data.schema.max_history_len,
        "kernel": trainer.cfgs.model.kernel,
        "autocast": str(trainer.autocast_dtype),
        "warmup": args.warmup,
        "total_steps": total,
        "log_every": log_every,
        "device": ranks[0]["device"],
        "loop": ranks[0]["loop"],
        "torch": torch.__version__,
        "single_gpu_reference": ref_src,
        "run_seconds": run_s,
    }
    try:
        import triton

        conf["triton"] = triton.__version__
    except ImportError:
        pass
    print_report(conf, agg, ranks)
    out = {"config": conf, "aggregate": agg, "ranks": ranks}
    if profiles is not None:
        print_profile(profiles, ranks, args.warmup)
        out["profile"] = {"recorded_steps": [profiler.first, profiler.last], "profiler_warmup_step": profiler.first - 1,
                          "activities": profiler.activities, "ranks": profiles,
                          "note": "the recorded steps (and the profiler warmup step) count in the timing"}
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(out, indent=1))
        print(f"results written to {args.json}")
    if args.write_reference:
        save_reference(args.write_reference, agg["step_ms"], conf, 1, "mean step of one process",
                       list(sys.argv[1:] if argv is None else argv))
    return 0


def main(argv: list[str] | None = None) -> int:
    args, overrides = parse_args(argv)
    if args.processes > 1 or args.baseline:
        try:
            return run_processes(args, list(sys.argv[1:] if argv is None else argv))
        except BenchError as e:
            print(f"bench_train: error: {e}", file=sys.stderr, flush=True)
            return 2
    if args.dump_stacks_after:  # a hung run shows where each rank waits before it is killed
        faulthandler.dump_traceback_later(args.dump_stacks_after, exit=False)
    try:
        code = run(args, overrides, argv)
    except BenchError as e:
        if int(os.environ.get("RANK", "0")) == 0:
            print(f"bench_train: error: {e}", file=sys.stderr, flush=True)
        code = 2
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
    return code

