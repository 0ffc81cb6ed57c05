"""Training throughput and MFU of one experiment, measured through the real trainer (gem.train.Trainer).

    python scripts/bench_train.py [--warmup 10] [--steps 30] [--json out.json] [HYDRA OVERRIDES...]
    python scripts/bench_train.py --warmup 10 --steps 20 --profile-steps 5 [--profile-dir traces/] experiment=gpu_base
    torchrun --nproc_per_node=2 scripts/bench_train.py --single-gpu-json one_gpu.json experiment=gpu_base ...

The config is composed as `python -m gem.train` composes it (configs/, same overrides). The trainer runs
`warmup + steps` steps (a `train.steps=N` override sets that total instead); evaluation and checkpoints are
switched off. Each step's end is marked with a CUDA event on the compute stream (no host sync), so the timed
steps' time is the GPU timeline between the last warmup step and the last step, idle gaps included. Model FLOPs
come from the model's own accounting (`GEMModel.flops`) on the very batches the trainer consumed (the data stream
is deterministic per rank and is replayed afterwards; the trainer's own window figures cross-check it).

Printed: step ms, samples/s, tokens/s, model TFLOP/s per device, E2E MFU vs the vendor bf16 peak and vs a bf16
matmul measured in this run (8192^3 by default), local MFU and the scaling ratio (E2E / local; local leaves out the
exposed communication, measured by profiling the last `--comm-probe-steps` warmup steps on N > 1 ranks), the
step-time breakdown (input, forward, backward, optimizer, exposed communication), peak memory per rank and, with
`--single-gpu-tflops` or a 1-GPU run's `--single-gpu-json`, the weak-scaling efficiency against that run.

`--profile-steps K` runs the last K steps under torch.profiler (CPU, plus CUDA when present) and prints, per rank,
the top ops by self device time (self CPU time without CUDA) and the device time grouped into matmul / attention /
communication / embedding / other. Those steps stay in the timing (the profiler slows them; the report compares
them with the other timed steps). `--profile-dir DIR` also writes each rank's chrome trace there.
`--profile-sources 'aten::copy_,...'` also splits those ops' time by the gem source lines that called them.

`--processes N` runs all of that in N fresh single-rank processes, one after another, and prints min / median / max
per figure; `--baseline CHECKOUT` alternates them with another gem checkout's bench_train (its own code) and prints
the ratio of the two trees' median steps.
"""

from __future__ import annotations

import argparse
import faulthandler
import json
import logging
import math
import os
import platform
import re
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch
import torch.distributed as dist

from gem.train.mfu import COMM_PATTERNS, CommProbe, mfu_report

# Keys the benchmark sets itself; the rest of the config is whatever the overrides compose.
_OWNED = ("train.log_every", "train.eval_every", "data.eval_batches", "train.checkpoint.every",
          "train.stop_at_step", "train.resume", "train.mfu.comm_probe_every")


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
                     help="model TFLOP/s of a 1-GPU run of the same experiment: adds the scaling against it")
    ref.add_argument("--single-gpu-json", default=None, help="read that figure from a 1-GPU run's --json file")
    p.add_argument("--run-dir", default=None, help="give the trainer a run dir (TensorBoard, metrics.jsonl)")
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
    t.mfu.comm_probe_every = 0  # the benchmark probes in its warmup (StepRecorder), away from the timed steps
    if measured_peak:
        t.mfu.measured_peak_flops = float(measured_peak)
    cfg.data.eval_batches = 0


# ---------------------------------------------------------------------------------------------- measuring


class StepRecorder:
    """Hooks the trainer's public per-step and per-window callbacks: an event (CUDA) or a clock reading (CPU) at
    each step's end, and the scalars of each log window (the trainer's own MFU/memory figures). A StepProfiler, when
    given, advances at each step's end, after the mark, so its own work lands in the next step. `probe_steps` > 0:
    a CommProbe records the warmup steps before `warmup` (it ends before that step's mark, so reading it stays out of
    the timed steps)."""

    def __init__(self, trainer, profiler: StepProfiler | None = None, warmup: int = 0, probe_steps: int = 0) -> None:
        self.cuda = trainer.is_cuda
        self.marks: list = []
        self.windows: list[tuple[int, dict]] = []
        self.comm: tuple[float, float] | None = None  # (exposed, all) communication, fractions of the probed steps
        probe = CommProbe(trainer.device) if probe_steps else None
        after_step, scalars = trainer.par.after_step, trainer.logger.scalars

        def on_step(step: int):
            synced = after_step(step)
            if probe is not None and probe.running and step == warmup:
                self.comm = probe.stop()
            if self.cuda:
                ev = torch.cuda.Event(enable_timing=True)
                ev.record()
                self.marks.append(ev)
            else:
                self.marks.append(time.perf_counter())
            if profiler is not None:
                profiler.step()
            if probe is not None and step == warmup - probe_steps:
                probe.start()
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


def rank_result(trainer, rec: StepRecorder, per_step: list[dict], warmup: int, total: int, losses: list[float],
                measured_peak: float | None, profiled: int = 0) -> dict:
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
    phases = {}  # the trainer's step-time split, mean over the timed windows
    for name in ("input", "forward", "backward", "optimizer"):
        v = [s[f"time/{name}_ms"] for step, s in rec.windows if step > warmup and f"time/{name}_ms" in s]
        if v:
            phases[name] = statistics.fmean(v)
    exposed, comm = (0.0, 0.0) if trainer.world_size == 1 else (rec.comm or (None, None))
    out = {
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
        "phase_ms": phases,
        "exposed_comm_fraction": exposed,  # of the step; None: not measured
        "comm_fraction": comm,
        "loss_finite": all(math.isfinite(x) for x in losses),
        "loop": getattr(trainer, "loop", None),  # plain | sparse_dist (torchrec's pipeline)
        "notes": [f"pipeline fell back to the plain loop: {trainer.pipeline_fallback}"]
        if getattr(trainer, "pipeline_fallback", None) else [],
    }
    if profiled:
        # The recorded steps against the timed steps before the profiler's warmup step: its overhead.
        rest = timed_steps_ms[:-profiled - 1]
        out["step_ms_profiled_mean"] = statistics.fmean(timed_steps_ms[-profiled:])
        out["step_ms_unprofiled_mean"] = statistics.fmean(rest) if rest else None
    return out


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
    fr = [r["exposed_comm_fraction"] for r in ranks]
    cf = [r["comm_fraction"] for r in ranks]
    mfu = mfu_report(per_dev * wall / steps, wall / steps, vendor_peak, measured,  # per device and step
                     statistics.fmean(fr) if None not in fr else None, statistics.fmean(cf) if None not in cf else None)
    names = [n for n in ("input", "forward", "backward", "optimizer") if all(n in r["phase_ms"] for r in ranks)]
    return {
        "timed_steps": steps,
        "step_ms": 1e3 * wall / steps,
        "step_ms_median": max(r["step_ms_median"] for r in ranks),
        "samples_per_s": sum(r["samples"] for r in ranks) / wall,
        "tokens_per_s": sum(r["tokens"] for r in ranks) / wall,
        "tflops_per_device": per_dev / 1e12,
        "tflops_total": per_dev * world / 1e12,
        "mfu_e2e": mfu.mfu_e2e,
        "mfu_local": mfu.mfu_local,
        "scaling_ratio": mfu.scaling_ratio,  # E2E / local
        "phase_ms": {n: statistics.fmean(r["phase_ms"][n] for r in ranks) for n in names},
        "exposed_comm_ms": 1e3 * mfu.exposed_comm_s if mfu.exposed_comm_s is not None else None,
        "comm_ms": 1e3 * mfu.comm_s if mfu.comm_s is not None else None,
        "vendor_peak_tflops": vendor_peak / 1e12 if vendor_peak else None,
        "mfu_measured": mfu.mfu_measured_peak,
        "measured_peak_tflops": measured / 1e12 if measured else None,
        "peak_allocated_gib_max": max(mem) if mem else None,
        "data_ms_per_batch": max(r["data_ms_per_batch"] for r in ranks),
        "single_gpu_tflops": ref_tflops,
        "scaling_vs_single_gpu": per_dev / 1e12 / ref_tflops if (ref_tflops and world > 1) else None,
        "flops_check_rel_err": max((r["flops_check_rel_err"] for r in ranks if r["flops_check_rel_err"] is not None),
                                   default=None),
        "loss_finite": all(r["loss_finite"] for r in ranks),
    }


# ---------------------------------------------------------------------------------------------- profiling

BUCKETS = ("matmul/gemm", "attention", "nccl/comm", "embedding", "elementwise/other")
# Substrings of op and kernel names (lower case). Our attention ops are gem::jfa_*, gem::gdpa_*,
# gem::block_attention_*, gem::rope; their Triton kernels have generic names (_fwd_kernel), so a kernel also takes
# the bucket of the op that launched it. "block" alone would catch CUB kernels (BLOCK_LOAD_* template arguments).
_EMB = ("fbgemm", "embedding", "tbe")
_ATTN = ("jfa", "gdpa", "block_attention", "blockattention", "attn", "attention", "gem::rope", "ropefn")
# fbgemm holds "gemm": before mm
_OP_BUCKETS = (("nccl/comm", COMM_PATTERNS), ("embedding", _EMB), ("attention", _ATTN))
_MM = re.compile(r"gemm|matmul|cutlass|nvjet|sm90|xmma|cublas|(?<![a-z])(?:add|addb|baddb|b|_scaled_)?mm(?![a-z])")
# Inductor's pointwise / reduction kernels are named after the ops they fuse ("triton_poi_fused__grouped_mm_mul_silu"):
# never matmul, whatever their names hold.
_FUSED_ELEMENTWISE = re.compile(r"^triton_(?:poi|per|red)_")


def _self_device_us(e) -> float:
    v = getattr(e, "self_device_time_total", None)  # torch >= 2.4; self_cuda_time_total before
    return float(v if v is not None else getattr(e, "self_cuda_time_total", 0) or 0)


def _name_bucket(name: str, table) -> str | None:
    n = name.lower()
    return next((b for b, pats in table if any(p in n for p in pats)), None)


def _op_bucket(e, memo: dict) -> str | None:
    """Communication / embedding / attention from the op or its nearest ancestor op that names one."""
    key = id(e)
    if key not in memo:
        b = _name_bucket(e.name, _OP_BUCKETS)
        parent = getattr(e, "cpu_parent", None)
        memo[key] = b if b is not None or parent is None else _op_bucket(parent, memo)
    return memo[key]


def _bucket(kernel: str | None, op, memo: dict) -> str:
    """The bucket of a kernel launched by `op` (None: not launched inside any op), or of op's own CPU time."""
    if kernel is not None and _name_bucket(kernel, _OP_BUCKETS[:1]):
        return "nccl/comm"
    b = _op_bucket(op, memo) if op is not None else None
    if b is None and any(_FUSED_ELEMENTWISE.match(n) for n in (kernel, getattr(op, "name", None)) if n):
        return "elementwise/other"
    if b is None and kernel is not None:
        b = _name_bucket(kernel, _OP_BUCKETS[1:]) or ("matmul/gemm" if _MM.search(kernel.lower()) else None)
    if b is None and op is not None and _MM.search(op.name.lower()):
        b = "matmul/gemm"
    return b or "elementwise/other"


TOP_ROWS = 25  # rows of the profile tables (ops and kernels: --profile-top; call sites: always)
_GEM_FRAME = re.compile(r"(?:^|/)(gem/[\w/]+\.py\(\d+\): \w+)")  # a profiler frame inside the gem package


def _gem_frames(e) -> str:
    """The innermost gem frames (up to 3) of a profiler event's Python stack, "a < b < c", or ""."""
    frames = list(getattr(e, "stack", None) or ())
    if not frames:  # newer torch records the stack as python_function events: the op's ancestors
        q = e.cpu_parent
        while q is not None and len(frames) < 3:
            if _GEM_FRAME.search(q.name):
                frames.append(q.name)
            q = q.cpu_parent
    return " < ".join([m.group(1) for m in map(_GEM_FRAME.search, frames) if m][:3])


_PY_FRAME = re.compile(r"([\w.-]+/[\w/.-]+\.py\(\d+\): [\w<>]+)$")  # a python_function event: "path.py(line): fn"


def _outer_frames(e, n: int = 2) -> str:
    """The innermost n Python frames above an op outside gem (torch, torchrec, ...), as "pkg/file.py(line): fn",
    for ops called from library code: which library and where."""
    frames, q = [], e.cpu_parent
    while q is not None and len(frames) < n:
        m = _PY_FRAME.search(q.name)
        if m:
            path = m.group(1)
            frames.append(path.split("site-packages/")[-1])
        q = q.cpu_parent
    return " < ".join(frames)


def _inputs_of(e, n: int = 2) -> str:
    """The first n tensor inputs' shapes and dtypes ("[65536, 1024] bf16, [65536, 1024] f32"), as the profiler
    records them; "" when it recorded none."""
    shapes = list(getattr(e, "input_shapes", None) or ())
    dtypes = list(getattr(e, "input_dtypes", None) or ())
    short = {"c10::BFloat16": "bf16", "float": "f32", "c10::Half": "f16", "long int": "i64", "int": "i32"}
    out = [f"{list(sh)} {short.get(dt, dt)}" for sh, dt in zip(shapes, dtypes + [""] * len(shapes)) if sh][:n]
    return ", ".join(out)


class StepProfiler:
    """torch.profiler over the last `k` of `total` trainer steps, advanced by StepRecorder at each step's end.

    Step total-k runs under the profiler's warmup (tracer started, events dropped) so that the start-up cost stays
    out of the recorded steps total-k+1 .. total."""

    def __init__(self, total: int, k: int, cuda: bool, sources: tuple[str, ...] = ()) -> None:
        from torch.profiler import ProfilerActivity, profile, schedule

        self.first, self.last, self.k, self.cuda, self.sources = total - k + 1, total, k, cuda, tuple(sources)
        acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
        self.activities = [a.name for a in acts]
        # schedule(n) is the action during trainer step n (start() takes one step first)
        self.prof = profile(activities=acts, schedule=schedule(wait=total - k, warmup=1, active=k, repeat=1),
                            record_shapes=bool(self.sources), with_stack=bool(self.sources), profile_memory=False)
        self.running = False

    def start(self) -> None:
        self.prof.start()
        self.prof.step()  # so the trace's ProfilerStep#n is trainer step n
        self.running = True

    def step(self) -> None:
        self.prof.step()

    def stop(self) -> None:
        if self.running:
            self.running = False
            self.prof.stop()

    def recorded(self) -> bool:
        return getattr(self.prof, "profiler", None) is not None

    def export(self, out_dir: str, rank: int) -> str:
        d = Path(out_dir)
        d.mkdir(parents=True, exist_ok=True)
        final, tmp = d / f"trace_rank{rank}.json", d / f".trace_rank{rank}.json.{os.getpid()}.tmp"
        try:
            self.prof.export_chrome_trace(str(tmp))
            os.replace(tmp, final)  # readers never see a half-written trace
        finally:
            tmp.unlink(missing_ok=True)
        return str(final)

    def summary(self, rank: int, top: int = TOP_ROWS) -> dict:
        """Per step of the recorded steps: the top ops by self device time (self CPU time without CUDA), device time
        per bucket and, with CUDA, the top kernels. An op's self device time is the kernels it launched itself."""
        from torch.autograd import DeviceType

        n, memo = self.k, {}
        events = self.prof.events()
        buckets = dict.fromkeys(BUCKETS, 0.0)
        cpu_us = sum(e.self_cpu_time_total for e in events if e.device_type == DeviceType.CPU)
        kernels: dict[str, list] = {}  # name -> [us, count], device side (user annotations are ranges, not work)
        orphans: list[dict] = []
        if self.cuda:
            for e in events:
                if e.device_type != DeviceType.CPU and not getattr(e, "is_user_annotation", False):
                    acc = kernels.setdefault(e.name, [0.0, 0])
                    acc[0] += _self_device_us(e)
                    acc[1] += 1
            launched: dict[str, list] = {}
            for e in events:
                if e.device_type == DeviceType.CPU:
                    for k in getattr(e, "kernels", None) or ():
                        buckets[_bucket(k.name, e, memo)] += k.duration
                        acc = launched.setdefault(k.name, [0.0, 0])
                        acc[0] += k.duration
                        acc[1] += 1
            for name, (us, cnt) in kernels.items():  # device work no op launched (kept so the totals add up)
                us_left = us - launched.get(name, [0.0, 0])[0]
                if us_left > 0.5:
                    buckets[_bucket(name, None, memo)] += us_left
                    orphans.append({"name": f"[no op] {name}", "calls": cnt - launched.get(name, [0.0, 0])[1],
                                    "dev_us": us_left, "cpu_us": 0.0})
            total = sum(v[0] for v in kernels.values())
        else:
            for e in events:
                if e.device_type == DeviceType.CPU:
                    buckets[_bucket(None, e, memo)] += e.self_cpu_time_total
            total = cpu_us
        ops = [{"name": a.key, "calls": a.count, "dev_us": _self_device_us(a), "cpu_us": a.self_cpu_time_total}
               for a in self.prof.key_averages() if a.device_type == DeviceType.CPU]
        key = (lambda r: (r["dev_us"], r["cpu_us"])) if self.cuda else (lambda r: r["cpu_us"])
        rows = sorted(ops + orphans, key=key, reverse=True)[:top]
        pct = (lambda us: us / total) if total > 0 else (lambda us: None)
        return {
            "rank": rank,
            "unit": "device" if self.cuda else "cpu",
            "recorded_steps": [self.first, self.last],
            "ms_per_step": total / 1e3 / n,  # the unit's total: device kernel time, or self CPU time (all threads)
            "cpu_ms_per_step": cpu_us / 1e3 / n,
            "rows": [{"name": r["name"][:300], "calls_per_step": r["calls"] / n,
                      "self_device_ms_per_step": r["dev_us"] / 1e3 / n if self.cuda else None,
                      "pct": pct(r["dev_us"] if self.cuda else r["cpu_us"]),
                      "self_cpu_ms_per_step": r["cpu_us"] / 1e3 / n} for r in rows],
            "buckets": {b: {"ms_per_step": us / 1e3 / n, "pct": pct(us)} for b, us in buckets.items()},
            "kernels": [{"name": name[:300], "calls_per_step": c / n, "ms_per_step": us / 1e3 / n, "pct": pct(us)}
                        for name, (us, c) in sorted(kernels.items(), key=lambda kv: -kv[1][0])[:top]],
            "sources": self._sources(events, TOP_ROWS),
        }

    def _sources(self, events, top: int) -> list[dict]:
        """For each op named in `sources`: its time (the kernels it launched, or self CPU time without CUDA) per
        calling site, the innermost gem frames of its Python stack. An op that autograd's backward runs is put at
        the forward site of the node it runs for ("backward of ..."): the engine's evaluate_function event and the
        forward op that recorded the node share a sequence number (on CUDA the engine's thread has no Python
        stack at all)."""
        from torch.autograd import DeviceType

        if not self.sources:
            return []
        forward_site: dict[int, str] = {}  # sequence number -> the gem frames of the forward op that recorded it
        for e in events:
            seq = getattr(e, "sequence_nr", -1)
            if e.device_type == DeviceType.CPU and seq >= 0 and seq not in forward_site \
                    and not e.name.startswith("autograd::engine"):
                site = _gem_frames(e)
                if site:
                    forward_site[seq] = site
        sites: dict[tuple[str, str], list] = {}
        for e in events:
            if e.device_type != DeviceType.CPU or e.name not in self.sources:
                continue
            node = e.cpu_parent
            while node is not None and not node.name.startswith("autograd::engine::evaluate_function: "):
                node = node.cpu_parent
            if node is not None:
                grad_fn = node.name.split(": ", 1)[1]
                fwd = forward_site.get(getattr(node, "sequence_nr", -1))
                site = f"backward of {fwd} ({grad_fn})" if fwd else f"backward ({grad_fn}, no gem frame)"
            else:
                site = _gem_frames(e) or f"(no gem frame) {_outer_frames(e) or 'torch internals'}"
            us = sum(k.duration for k in (getattr(e, "kernels", None) or ())) if self.cuda else e.self_cpu_time_total
            acc = sites.setdefault((e.name, site, _inputs_of(e)), [0.0, 0])
            acc[0] += us
            acc[1] += 1
        rows = sorted(sites.items(), key=lambda kv: -kv[1][0])[:top]
        return [{"op": op, "site": site, "inputs": inputs, "calls_per_step": c / self.k, "ms_per_step": us / 1e3 / self.k}
                for (op, site, inputs), (us, c) in rows]


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
        (f"E2E MFU vs {_f(agg['vendor_peak_tflops'], '{:.0f}')} TFLOP/s bf16", _f(agg["mfu_e2e"], pct)),
        ("local MFU (exposed communication left out)", _f(agg["mfu_local"], pct)),
        ("scaling ratio (E2E / local)", _f(agg["scaling_ratio"], "{:.3f}", "n/a (no communication probe)")),
        (f"E2E MFU vs measured matmul {_f(agg['measured_peak_tflops'], '{:.0f}')} TFLOP/s",
         _f(agg["mfu_measured"], pct)),
        ("peak allocated GiB (max over ranks)", _f(agg["peak_allocated_gib_max"], "{:.2f}")),
        ("host ms to make one batch (data stream)", f"{agg['data_ms_per_batch']:.1f}"),
    ]
    if conf["world_size"] > 1:
        rows.append((f"TFLOP/s per device vs 1 GPU ({_f(agg['single_gpu_tflops'], '{:.4g}')} TFLOP/s)",
                     _f(agg["scaling_vs_single_gpu"], "{:.3f}", "n/a (pass --single-gpu-tflops or --single-gpu-json)")))
    rows.append(("FLOPs cross-check vs trainer windows", _f(agg["flops_check_rel_err"], "rel err {:.1e}")))
    print("| metric | value |\n|---|---|")
    for k, v in rows:
        print(f"| {k} | {v} |")
    print_breakdown(agg)
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
    if agg["step_ms"] > 1.2 * agg["step_ms_median"]:
        print(f"warning: the mean step ({agg['step_ms']:.0f} ms) is {agg['step_ms'] / agg['step_ms_median']:.1f}x the "
              f"median ({agg['step_ms_median']:.0f} ms): some timed steps carried one-off work (a recompile, or kernel "
              "tuning for a new length bucket); raise --warmup, or read the median")
    line = [f"{agg['tflops_per_device']:.4g} TFLOP/s/device", f"MFU {_f(agg['mfu_e2e'], pct)}",
            f"local {_f(agg['mfu_local'], pct)}", f"scaling {_f(agg['scaling_ratio'], '{:.3f}')}"]
    line += [f"vs measured {_f(agg['mfu_measured'], pct)}",
             f"{agg['step_ms']:.1f} ms/step (median {agg['step_ms_median']:.1f})",
             f"{agg['samples_per_s']:,.0f} samples/s", f"peak {_f(agg['peak_allocated_gib_max'], '{:.1f}')} GiB"]
    print("bench_train summary: " + " | ".join(line))
    sys.stdout.flush()


def print_breakdown(agg: dict) -> None:
    """The step-time split (mean over ranks): the trainer's phases, and the exposed communication inside them."""
    step = agg["step_ms"]
    print("\n| step-time breakdown | ms/step | % of step |\n|---|---|---|")
    for name, ms in agg["phase_ms"].items():
        print(f"| {name} | {ms:.2f} | {ms / step:.1%} |")
    ex = agg["exposed_comm_ms"]
    print(f"| exposed comm (inside the phases above) | {_f(ex, '{:.2f}')} | {_f(ex and ex / step, '{:.1%}')} |")
    print(f"| communication, hidden or not | {_f(agg['comm_ms'], '{:.2f}')} | "
          f"{_f(agg['comm_ms'] and agg['comm_ms'] / step, '{:.1%}')} |")
    print(f"| step (wall) | {step:.2f} | 100.0% |")


def _cell(name: str, width: int = 70) -> str:
    name = " ".join(name.split()).replace("|", "\\|")
    return name if len(name) <= width else name[:width - 3] + "..."


def print_profile(profiles: list[dict], ranks: list[dict], warmup: int) -> None:
    for p, r in zip(profiles, ranks):
        first, last = p["recorded_steps"]
        dev, rk = p["unit"] == "device", p["rank"]
        unit = "device" if dev else "CPU"
        print(f"\n## op profile, rank {rk}: steps {first}..{last} recorded (step {first - 1}: profiler warmup, "
              f"{'untimed' if first - 1 <= warmup else 'timed'}), {'CPU + CUDA' if dev else 'CPU only'}; "
              f"top ops by self {unit} time, per step")
        other = r.get("step_ms_unprofiled_mean")
        span = f"{warmup + 1}..{first - 2}" if first - 2 > warmup + 1 else f"{first - 2}"
        vs = f"{other:.2f} for timed steps {span}" if other is not None else "no other timed step"
        print(f"note: steps {max(first - 1, warmup + 1)}..{last} count in the timing above and carry profiler "
              f"overhead: recorded steps {r['step_ms_profiled_mean']:.2f} ms/step vs {vs}")
        print(f"| op | calls/step | self device ms/step | % of profiled {unit} time | self CPU ms/step |")
        print("|---|---|---|---|---|")
        for row in p["rows"]:
            print(f"| {_cell(row['name'])} | {row['calls_per_step']:.4g} | "
                  f"{_f(row['self_device_ms_per_step'], '{:.3f}')} | {_f(row['pct'], '{:.1%}')} | "
                  f"{row['self_cpu_ms_per_step']:.3f} |")
        if p["kernels"]:
            print(f"\n| kernel (rank {rk}) | calls/step | ms/step | % of profiled device time |\n|---|---|---|---|")
            for k in p["kernels"]:
                print(f"| {_cell(k['name'])} | {k['calls_per_step']:.4g} | {k['ms_per_step']:.3f} | "
                      f"{_f(k['pct'], '{:.1%}')} |")
        if p.get("sources"):
            print(f"\n| op (rank {rk}) | called from (innermost gem frames) | inputs | calls/step | {unit} ms/step |\n"
                  "|---|---|---|---|---|")
            for x in p["sources"]:
                print(f"| {x['op']} | {_cell(x['site'], 160)} | {x.get('inputs', '')} | {x['calls_per_step']:.4g} | "
                      f"{x['ms_per_step']:.3f} |")
        wall = r["step_ms_profiled_mean"]
        if dev:  # kernel time against the step's GPU timeline: what is left is idle (or overlapped) time
            print(f"note: rank {rk}: kernels {p['ms_per_step']:.2f} ms/step = {p['ms_per_step'] / wall:.0%} of the "
                  f"recorded steps' {wall:.2f} ms (under 100%: GPU idle, e.g. waiting on the host; streams that "
                  f"overlap can exceed it); host self CPU {p['cpu_ms_per_step']:.2f} ms/step, all threads")
        else:
            print(f"note: rank {rk}: self CPU {p['cpu_ms_per_step']:.2f} ms/step over all threads, recorded steps "
                  f"{wall:.2f} ms wall")
        parts = " | ".join(f"{b} {v['ms_per_step']:.2f} ({_f(v['pct'], '{:.1%}')})" for b, v in p["buckets"].items())
        print(f"bench_train profile buckets (rank {rk}, self {unit} ms/step of {p['ms_per_step']:.2f}): {parts}")
    sys.stdout.flush()


def _setup_logging(rank: int) -> None:
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(name)s: %(message)s", stream=sys.stdout)
    logging.getLogger("gem").setLevel(logging.INFO if rank == 0 else logging.WARNING)
    logging.getLogger("torchrec").setLevel(logging.ERROR)


def run(args: argparse.Namespace, overrides: list[str]) -> int:
    from gem.parallel.dims import ParallelConfig, init_distributed
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

    device = init_distributed(ParallelConfig.from_any(cfg.parallel).timeout_s)
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
    return 0


# ------------------------------------------------------------------------------------ several processes

_PARENT_OPTIONS = ("--processes", "--baseline", "--json")
# per-process figures the summary gathers: (label, aggregate key, scale, format)
_PROCESS_FIGURES = (("step ms mean", "step_ms", 1.0, "{:.1f}"), ("step ms median", "step_ms_median", 1.0, "{:.1f}"),
                    ("TFLOP/s per GPU", "tflops_per_device", 1.0, "{:.1f}"), ("local MFU %", "mfu_local", 100.0,
                                                                              "{:.1f}"),
                    ("peak GiB", "peak_allocated_gib_max", 1.0, "{:.1f}"))


def _triple(values: list[float], fmt: str) -> str:
    if not values:
        return "n/a"
    return " / ".join(fmt.format(v) for v in (min(values), statistics.median(values), max(values)))


def run_processes(args: argparse.Namespace, argv: list[str]) -> int:
    """The benchmark in args.processes fresh single-rank processes, one after another, alternating with a baseline
    checkout's benchmark when given; then min / median / max of each process's figures, per tree."""
    import subprocess
    import tempfile

    from gem.cli._children import stderr_tail, strip_options

    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        raise BenchError("--processes / --baseline start single-rank processes: run them without torchrun")
    forwarded = strip_options(argv, _PARENT_OPTIONS)
    trees = [("this", Path(__file__).resolve())]
    if args.baseline:
        trees.append(("baseline", (Path(args.baseline) / "scripts" / "bench_train.py").resolve()))
    n = args.processes
    print(f"# bench_train in {n} fresh process(es) per tree, one after another"
          f"{', alternating with ' + str(trees[1][1].parents[1]) if args.baseline else ''}: "
          f"{' '.join(forwarded) or '(defaults)'}", flush=True)
    record, figures = [], {name: [] for name, _ in trees}
    with tempfile.TemporaryDirectory(prefix="bench_train.") as tmp:
        for i in range(1, n + 1):
            for name, script in trees:
                out = os.path.join(tmp, f"{name}{i}.json")
                t0 = time.time()
                # a checkout's script gets its checkout first on the path (`import gem` takes that tree's code);
                # an installed gem-bench (gem/cli/_bench_train.py) runs the installed package
                paths = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
                if script.parent.name == "scripts":
                    paths.insert(0, str(script.parents[1]))
                env = dict(os.environ, PYTHONPATH=os.pathsep.join(paths))
                proc = subprocess.run([sys.executable, str(script), *forwarded, "--json", out], check=False,
                                      capture_output=True, text=True, env=env)
                took = time.time() - t0
                summary = [ln for ln in proc.stdout.splitlines() if ln.startswith("bench_train summary:")]
                if proc.returncode == 0 and os.path.exists(out):
                    agg = json.loads(Path(out).read_text())["aggregate"]
                    figures[name].append(agg)
                    record.append({"process": i, "tree": name, "status": "ok", "aggregate": agg})
                    print(f"process {i}/{n} ({name}, {took:.0f} s): {summary[-1] if summary else 'no summary'}",
                          flush=True)
                else:
                    rc = proc.returncode
                    status = f"exit status {rc}" if rc >= 0 else f"killed by signal {-rc}"
                    record.append({"process": i, "tree": name, "status": status,
                                   "stderr_tail": stderr_tail(proc.stderr)})
                    print(f"process {i}/{n} ({name}): failed ({status}, {took:.0f} s): {stderr_tail(proc.stderr)}",
                          flush=True)
    summary = {}
    print(f"\n| tree | processes ok | {' | '.join(f'{label}: min / median / max' for label, *_ in _PROCESS_FIGURES)} "
          f"| spread of the mean step |")
    print("|---|---|" + "---|" * len(_PROCESS_FIGURES) + "---|")
    for name, _ in trees:
        aggs = figures[name]
        row = {}
        for label, key, scale, fmt in _PROCESS_FIGURES:
            row[key] = [a[key] * scale for a in aggs if isinstance(a.get(key), (int, float))]
        steps = row["step_ms"]
        spread = (max(steps) - min(steps)) / statistics.median(steps) if len(steps) > 1 else None
        summary[name] = {"processes_ok": len(aggs), **row, "spread": spread}
        cells = " | ".join(_triple(row[key], fmt) for _, key, _, fmt in _PROCESS_FIGURES)
        print(f"| {name} | {len(aggs)} of {n} | {cells} | {_f(spread and 100 * spread, '{:.1f}%')} |")
    line = [f"{name} {_triple(summary[name]['step_ms'], '{:.1f}')} ms" for name, _ in trees]
    if args.baseline and summary["this"]["step_ms"] and summary["baseline"]["step_ms"]:
        ratio = statistics.median(summary["baseline"]["step_ms"]) / statistics.median(summary["this"]["step_ms"])
        summary["speedup_vs_baseline"] = ratio
        line.append(f"this vs baseline {ratio:.3f}x (median of the process means)")
    print("bench_train processes summary: " + " | ".join(line), flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"processes": record, "summary": summary}, f, indent=1)
        print(f"results written to {args.json}")
    if not any(figures.values()) or any(not figures[name] for name, _ in trees):
        print(f"bench_train: error: every process of {', '.join(k for k, v in figures.items() if not v)} failed",
              file=sys.stderr)
        return 2
    return 0


def main(argv: list[str] | None = None) -> int:
    args, overrides = parse_args(argv)
    if args.processes > 1 or args.baseline:
        try:
            return run_processes(args, list(sys.argv[1:] if argv is None else argv))
        except BenchError as e:
            print(f"bench_train: error: {e}", file=sys.stderr, flush=True)
            return 2
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
