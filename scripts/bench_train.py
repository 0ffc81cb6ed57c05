"""Training throughput and MFU of one experiment, measured through the real trainer (gem.train.Trainer).

    python scripts/bench_train.py [--warmup 10] [--steps 30] [--json out.json] [HYDRA OVERRIDES...]
    torchrun --nproc_per_node=2 scripts/bench_train.py --single-gpu-json one_gpu.json experiment=gpu_base ...

The config is composed as `python -m gem.train` composes it (configs/, same overrides). The trainer runs
`warmup + steps` steps (a `train.steps=N` override sets that total instead); evaluation and checkpoints are
switched off. Each step's end is marked with a CUDA event on the compute stream (no host sync), so the timed
steps' time is the GPU timeline between the last warmup step and the last step, idle gaps included. Model FLOPs
come from the model's own accounting (`GEMModel.flops`) on the very batches the trainer consumed (the data stream
is deterministic per rank and is replayed afterwards; the trainer's own window figures cross-check it).

Printed: step ms, samples/s, tokens/s, model TFLOP/s per device, MFU vs the vendor bf16 peak and vs a bf16 matmul
measured in this run (8192^3 by default), peak memory per rank and, with N > 1 ranks, the scaling ratio
(TFLOP/s per device at N / at 1) against `--single-gpu-tflops` or a 1-GPU run's `--single-gpu-json`.
"""

from __future__ import annotations

import argparse
import faulthandler
import json
import logging
import math
import os
import platform
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch
import torch.distributed as dist

# Keys the benchmark sets itself; the rest of the config is whatever the overrides compose.
_OWNED = ("train.log_every", "train.eval_every", "data.eval_batches", "train.checkpoint.every",
          "train.stop_at_step", "train.resume")


class BenchError(ValueError):
    """A bad argument or config; printed as one line."""


def parse_args(argv: list[str] | None) -> tuple[argparse.Namespace, list[str]]:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0],
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
                     help="model TFLOP/s of a 1-GPU run of the same experiment: enables the scaling ratio")
    ref.add_argument("--single-gpu-json", default=None, help="read that figure from a 1-GPU run's --json file")
    p.add_argument("--run-dir", default=None, help="give the trainer a run dir (TensorBoard, metrics.jsonl)")
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
    if args.single_gpu_tflops is not None and not args.single_gpu_tflops > 0:
        p.error(f"--single-gpu-tflops must be > 0, got {args.single_gpu_tflops}")
    for o in rest:
        key = o.split("=", 1)[0].lstrip("+~")
        if key in _OWNED:
            p.error(f"{key} is set by the benchmark; drop that override")
    return args, rest


# ---------------------------------------------------------------------------------------------- config


def compose(overrides: list[str], world_size: int):
    """The composed config (as `python -m gem.train` composes it), or BenchError with gem.train's one-line message."""
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    from gem.train.__main__ import CONFIG_DIR, preflight

    try:
        GlobalHydra.instance().clear()
        with initialize_config_dir(version_base="1.3", config_dir=CONFIG_DIR, job_name="gem_bench"):
            return hydra_compose(config_name="config", overrides=overrides)
    except Exception as e:  # noqa: BLE001 - preflight words composition errors the way the CLI does
        raise BenchError(preflight(overrides, world_size) or f"{type(e).__name__}: {e}") from None
    finally:
        GlobalHydra.instance().clear()


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
    if measured_peak:
        t.mfu.measured_peak_flops = float(measured_peak)
    cfg.data.eval_batches = 0


# ---------------------------------------------------------------------------------------------- measuring


class StepRecorder:
    """Hooks the trainer's public per-step and per-window callbacks: an event (CUDA) or a clock reading (CPU) at
    each step's end, and the scalars of each log window (the trainer's own MFU/memory figures)."""

    def __init__(self, trainer) -> None:
        self.cuda = trainer.is_cuda
        self.marks: list = []
        self.windows: list[tuple[int, dict]] = []
        after_step, scalars = trainer.par.after_step, trainer.logger.scalars

        def on_step(step: int):
            synced = after_step(step)
            if self.cuda:
                ev = torch.cuda.Event(enable_timing=True)
                ev.record()
                self.marks.append(ev)
            else:
                self.marks.append(time.perf_counter())
            return synced

        def on_scalars(values, step):
            self.windows.append((int(step), dict(values)))
            return scalars(values, step)

        trainer.par.after_step = on_step
        trainer.logger.scalars = on_scalars

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

    ds = build_dataset(trainer.cfgs.data, trainer.rank, trainer.world_size, split="train")
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


def rank_result(trainer, rec: StepRecorder, per_step: list[dict], warmup: int, total: int, losses: list[float],
                measured_peak: float | None) -> dict:
    ms = rec.step_ms()  # ms[i] = step i + 2
    timed_steps_ms = ms[warmup - 1:]  # steps warmup+1 .. total
    if len(timed_steps_ms) != total - warmup:
        raise RuntimeError(f"recorded {len(ms) + 1} step marks for {total} steps")
    timed = per_step[warmup:]
    t_s = sum(timed_steps_ms) / 1e3
    win_ms = [1e3 * s["perf/step_time_s"] for step, s in rec.windows if step > warmup and "perf/step_time_s" in s]
    mem = [s.get("memory/peak_allocated_gib") for _, s in rec.windows if "memory/peak_allocated_gib" in s]
    res = [s.get("memory/peak_reserved_gib") for _, s in rec.windows if "memory/peak_reserved_gib" in s]
    tail = losses[warmup:] or losses
    return {
        "rank": trainer.rank,
        "device": torch.cuda.get_device_name(trainer.device) if trainer.is_cuda else platform.processor() or "cpu",
        "timed_s": t_s,
        "timed_steps": len(timed),
        "step_ms_mean": 1e3 * t_s / len(timed),
        "step_ms_median": statistics.median(timed_steps_ms),
        "step_ms_min": min(timed_steps_ms),
        "step_ms_max": max(timed_steps_ms),
        "step_ms_trainer_windows": statistics.fmean(win_ms) if win_ms else None,
        "samples": sum(b["samples"] for b in timed),
        "tokens": sum(b["tokens"] for b in timed),
        "flops": sum(b["flops"] for b in timed),
        "tflops": sum(b["flops"] for b in timed) / t_s / 1e12,
        "peak_allocated_gib": max(mem) if mem else None,
        "peak_reserved_gib": max(res) if res else None,
        "matmul_peak_tflops": measured_peak / 1e12 if measured_peak else None,
        "flops_check_rel_err": window_check(rec.windows, per_step),
        "loss_timed_mean": statistics.fmean(tail) if tail else None,
        "loss_finite": all(math.isfinite(x) for x in losses),
        "loop": getattr(trainer, "loop", None),  # plain | sparse_dist (torchrec's pipeline)
        "notes": [f"pipeline fell back to the plain loop: {trainer.pipeline_fallback}"]
        if getattr(trainer, "pipeline_fallback", None) else [],
    }


def single_gpu_reference(args, model_name: str, data_cfg) -> tuple[float | None, str | None]:
    if args.single_gpu_tflops is not None:
        return args.single_gpu_tflops, "--single-gpu-tflops"
    if args.single_gpu_json is None:
        return None, None
    try:
        ref = json.loads(Path(args.single_gpu_json).read_text())
        agg, conf = ref["aggregate"], ref["config"]
        tf = float(agg["tflops_per_device"])
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise BenchError(f"--single-gpu-json {args.single_gpu_json}: not a bench_train result ({e})") from None
    if int(conf.get("world_size", 0)) != 1:
        raise BenchError(f"--single-gpu-json {args.single_gpu_json}: a run on {conf.get('world_size')} ranks, not 1")
    mine = {"model": model_name, "batch_size": data_cfg.batch_size, "max_len": data_cfg.schema.history.max_len}
    theirs = {k: conf.get(k) for k in mine}
    if mine != theirs:
        print(f"warning: the 1-GPU reference ran {theirs}, this run {mine}: the scaling ratio compares different work",
              flush=True)
    return tf, args.single_gpu_json


def aggregate(ranks: list[dict], world: int, ref_tflops: float | None, vendor_peak: float | None) -> dict:
    wall = max(r["timed_s"] for r in ranks)  # collectives keep ranks in step; the slowest sets the pace
    steps = ranks[0]["timed_steps"]
    per_dev = sum(r["flops"] for r in ranks) / world / wall
    peaks = [r["matmul_peak_tflops"] for r in ranks if r["matmul_peak_tflops"]]
    measured = min(peaks) * 1e12 if peaks else None
    mem = [r["peak_allocated_gib"] for r in ranks if r["peak_allocated_gib"] is not None]
    return {
        "timed_steps": steps,
        "step_ms": 1e3 * wall / steps,
        "step_ms_median": max(r["step_ms_median"] for r in ranks),
        "samples_per_s": sum(r["samples"] for r in ranks) / wall,
        "tokens_per_s": sum(r["tokens"] for r in ranks) / wall,
        "tflops_per_device": per_dev / 1e12,
        "tflops_total": per_dev * world / 1e12,
        "mfu_vendor": per_dev / vendor_peak if vendor_peak else None,
        "vendor_peak_tflops": vendor_peak / 1e12 if vendor_peak else None,
        "mfu_measured": per_dev / measured if measured else None,
        "measured_peak_tflops": measured / 1e12 if measured else None,
        "peak_allocated_gib_max": max(mem) if mem else None,
        "data_ms_per_batch": max(r["data_ms_per_batch"] for r in ranks),
        "single_gpu_tflops": ref_tflops,
        "scaling_ratio": per_dev / 1e12 / ref_tflops if (ref_tflops and world > 1) else None,
        "flops_check_rel_err": max((r["flops_check_rel_err"] for r in ranks if r["flops_check_rel_err"] is not None),
                                   default=None),
        "loss_finite": all(r["loss_finite"] for r in ranks),
    }


# ---------------------------------------------------------------------------------------------- output


def _f(x, fmt="{:.1f}", na="n/a") -> str:
    return na if x is None else fmt.format(x)


def print_report(conf: dict, agg: dict, ranks: list[dict]) -> None:
    print(f"\n## bench_train: {conf['model']} | world {conf['world_size']} | {conf['parallel']}")
    print(f"per-rank batch {conf['batch_size']}, history max_len {conf['max_len']}, warmup {conf['warmup']} + "
          f"timed {agg['timed_steps']} steps (log window {conf['log_every']}), loop {conf['loop']}, {conf['device']}")
    pct = "{:.1%}"
    rows = [
        ("step ms (mean / median)", f"{agg['step_ms']:.2f} / {agg['step_ms_median']:.2f}"),
        ("samples/s (global)", f"{agg['samples_per_s']:,.0f}"),
        ("tokens/s (global, history)", f"{agg['tokens_per_s']:,.0f}"),
        ("model TFLOP/s per device", f"{agg['tflops_per_device']:.4g}"),
        (f"local MFU vs {_f(agg['vendor_peak_tflops'], '{:.0f}')} TFLOP/s bf16", _f(agg["mfu_vendor"], pct)),
        (f"MFU vs measured matmul {_f(agg['measured_peak_tflops'], '{:.0f}')} TFLOP/s", _f(agg["mfu_measured"], pct)),
        ("peak allocated GiB (max over ranks)", _f(agg["peak_allocated_gib_max"], "{:.2f}")),
        ("host ms to make one batch (data stream)", f"{agg['data_ms_per_batch']:.1f}"),
    ]
    if conf["world_size"] > 1:
        rows.append((f"scaling ratio vs 1 GPU ({_f(agg['single_gpu_tflops'], '{:.4g}')} TFLOP/s)",
                     _f(agg["scaling_ratio"], "{:.3f}", "n/a (pass --single-gpu-tflops or --single-gpu-json)")))
    rows.append(("FLOPs cross-check vs trainer windows", _f(agg["flops_check_rel_err"], "rel err {:.1e}")))
    print("| metric | value |\n|---|---|")
    for k, v in rows:
        print(f"| {k} | {v} |")
    print("\n| rank | step ms mean | median | min | max | trainer-window ms | TFLOP/s | peak alloc GiB | "
          "peak reserved GiB | matmul TFLOP/s | loss (timed mean) |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for r in ranks:
        print(f"| {r['rank']} | {r['step_ms_mean']:.2f} | {r['step_ms_median']:.2f} | {r['step_ms_min']:.2f} | "
              f"{r['step_ms_max']:.2f} | {_f(r['step_ms_trainer_windows'], '{:.2f}')} | {r['tflops']:.4g} | "
              f"{_f(r['peak_allocated_gib'], '{:.2f}')} | {_f(r['peak_reserved_gib'], '{:.2f}')} | "
              f"{_f(r['matmul_peak_tflops'], '{:.0f}')} | {_f(r['loss_timed_mean'], '{:.4f}')} |")
    notes = sorted({n for r in ranks for n in r["notes"]})
    for n in notes:
        print(f"note: {n}")
    if agg["flops_check_rel_err"] is not None and agg["flops_check_rel_err"] > 1e-6:
        print("warning: the replayed batches' FLOPs differ from the trainer's window FLOPs: the data stream is not "
              "deterministic, so the FLOP figures above are approximate")
    if agg["data_ms_per_batch"] > 0.8 * agg["step_ms"]:
        print(f"warning: making a batch takes {agg['data_ms_per_batch']:.0f} ms on the host against {agg['step_ms']:.0f} ms "
              "per step: the run is likely bound by data generation, not by the GPU")
    if not agg["loss_finite"]:
        print("warning: a non-finite loss was seen during the run")
    line = [f"{agg['tflops_per_device']:.4g} TFLOP/s/device", f"MFU {_f(agg['mfu_vendor'], pct)}"]
    if conf["world_size"] > 1:
        line.append(f"scaling {_f(agg['scaling_ratio'], '{:.3f}')}")
    line += [f"vs measured {_f(agg['mfu_measured'], pct)}", f"{agg['step_ms']:.1f} ms/step",
             f"{agg['samples_per_s']:,.0f} samples/s", f"peak {_f(agg['peak_allocated_gib_max'], '{:.1f}')} GiB"]
    print("bench_train summary: " + " | ".join(line))
    sys.stdout.flush()


def _setup_logging(rank: int) -> None:
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(name)s: %(message)s", stream=sys.stdout)
    logging.getLogger("gem").setLevel(logging.INFO if rank == 0 else logging.WARNING)
    logging.getLogger("torchrec").setLevel(logging.ERROR)


def run(args: argparse.Namespace, overrides: list[str]) -> int:
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
        build_configs(cfg, world)  # every validator, before any process group or GPU work
    except (ValueError, TypeError, KeyError) as e:
        raise BenchError(str(e).splitlines()[0]) from None
    if rank == 0 and log_every < 5:
        print(f"note: warmup {args.warmup} and {timed} timed steps share no divisor >= 5: the trainer syncs the host "
              f"every {log_every} step(s), which can cost throughput", flush=True)

    device = init_distributed()
    measured = None
    if device.type == "cuda" and not args.no_matmul:
        measured = measure_matmul_peak(device, n=args.matmul_n)
        apply_bench_settings(cfg, total, args.warmup, log_every, measured)
        torch.cuda.empty_cache()

    trainer = Trainer(cfg, run_dir=args.run_dir)
    try:
        rec = StepRecorder(trainer)
        t0 = time.perf_counter()
        result = trainer.fit()
        run_s = time.perf_counter() - t0
        per_step, data_ms = replay_batches(trainer, total)
        mine = rank_result(trainer, rec, per_step, args.warmup, total, result.losses, measured)
        mine["data_ms_per_batch"] = data_ms
    finally:
        trainer.close()
    ranks = [mine]
    if trainer.world_size > 1:
        ranks = [None] * trainer.world_size
        dist.all_gather_object(ranks, mine)
    if trainer.rank != 0:
        return 0

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
        "max_len": trainer.cfgs.data.schema.history.max_len,
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
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps({"config": conf, "aggregate": agg, "ranks": ranks}, indent=1))
        print(f"results written to {args.json}")
    return 0


def main(argv: list[str] | None = None) -> int:
    args, overrides = parse_args(argv)
    if os.environ.get("GEM_DUMP_STACKS_AFTER"):  # a hung run shows where each rank waits before it is killed
        faulthandler.dump_traceback_later(float(os.environ["GEM_DUMP_STACKS_AFTER"]), exit=False)
    try:
        code = run(args, overrides)
    except BenchError as e:
        if int(os.environ.get("RANK", "0")) == 0:
            print(f"bench_train: error: {e}", file=sys.stderr, flush=True)
        code = 2
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
    return code


if __name__ == "__main__":
    sys.exit(main())
