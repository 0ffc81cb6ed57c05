"""The training benchmark's figures (per rank, then over ranks) and the markdown it prints."""

from __future__ import annotations

import json
import math
import platform
import statistics
import sys
from pathlib import Path

import torch

from gem.bench.options import BenchError
from gem.bench.recorder import StepRecorder, window_check
from gem.train.mfu import mfu_report


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
    mine = {"model": model_name, "batch_size": data_cfg.batch_size, "max_len": data_cfg.schema.max_history_len}
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


# ---------------------------------------------------------------------------------------------- output


def fmt_value(x, fmt="{:.1f}", na="n/a") -> str:
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
        (f"E2E MFU vs {fmt_value(agg['vendor_peak_tflops'], '{:.0f}')} TFLOP/s bf16", fmt_value(agg["mfu_e2e"], pct)),
        ("local MFU (exposed communication left out)", fmt_value(agg["mfu_local"], pct)),
        ("scaling ratio (E2E / local)", fmt_value(agg["scaling_ratio"], "{:.3f}", "n/a (no communication probe)")),
        (f"E2E MFU vs measured matmul {fmt_value(agg['measured_peak_tflops'], '{:.0f}')} TFLOP/s",
         fmt_value(agg["mfu_measured"], pct)),
        ("peak allocated GiB (max over ranks)", fmt_value(agg["peak_allocated_gib_max"], "{:.2f}")),
        ("host ms to make one batch (data stream)", f"{agg['data_ms_per_batch']:.1f}"),
    ]
    if conf["world_size"] > 1:
        rows.append((f"TFLOP/s per device vs 1 GPU ({fmt_value(agg['single_gpu_tflops'], '{:.4g}')} TFLOP/s)",
                     fmt_value(agg["scaling_vs_single_gpu"], "{:.3f}", "n/a (pass --single-gpu-tflops or --single-gpu-json)")))
    rows.append(("FLOPs cross-check vs trainer windows", fmt_value(agg["flops_check_rel_err"], "rel err {:.1e}")))
    print("| metric | value |\n|---|---|")
    for k, v in rows:
        print(f"| {k} | {v} |")
    print_breakdown(agg)
    print("\n| rank | step ms mean | median | min | max | trainer-window ms | TFLOP/s | peak alloc GiB | "
          "peak reserved GiB | matmul TFLOP/s | loss (timed mean) |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for r in ranks:
        print(f"| {r['rank']} | {r['step_ms_mean']:.2f} | {r['step_ms_median']:.2f} | {r['step_ms_min']:.2f} | "
              f"{r['step_ms_max']:.2f} | {fmt_value(r['step_ms_trainer_windows'], '{:.2f}')} | {r['tflops']:.4g} | "
              f"{fmt_value(r['peak_allocated_gib'], '{:.2f}')} | {fmt_value(r['peak_reserved_gib'], '{:.2f}')} | "
              f"{fmt_value(r['matmul_peak_tflops'], '{:.0f}')} | {fmt_value(r['loss_timed_mean'], '{:.4f}')} |")
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
    line = [f"{agg['tflops_per_device']:.4g} TFLOP/s/device", f"MFU {fmt_value(agg['mfu_e2e'], pct)}",
            f"local {fmt_value(agg['mfu_local'], pct)}", f"scaling {fmt_value(agg['scaling_ratio'], '{:.3f}')}"]
    line += [f"vs measured {fmt_value(agg['mfu_measured'], pct)}",
             f"{agg['step_ms']:.1f} ms/step (median {agg['step_ms_median']:.1f})",
             f"{agg['samples_per_s']:,.0f} samples/s", f"peak {fmt_value(agg['peak_allocated_gib_max'], '{:.1f}')} GiB"]
    print("bench_train summary: " + " | ".join(line))
    sys.stdout.flush()


def print_breakdown(agg: dict) -> None:
    """The step-time split (mean over ranks): the trainer's phases, and the exposed communication inside them."""
    step = agg["step_ms"]
    print("\n| step-time breakdown | ms/step | % of step |\n|---|---|---|")
    for name, ms in agg["phase_ms"].items():
        print(f"| {name} | {ms:.2f} | {ms / step:.1%} |")
    ex = agg["exposed_comm_ms"]
    print(f"| exposed comm (inside the phases above) | {fmt_value(ex, '{:.2f}')} | {fmt_value(ex and ex / step, '{:.1%}')} |")
    print(f"| communication, hidden or not | {fmt_value(agg['comm_ms'], '{:.2f}')} | "
          f"{fmt_value(agg['comm_ms'] and agg['comm_ms'] / step, '{:.1%}')} |")
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
                  f"{fmt_value(row['self_device_ms_per_step'], '{:.3f}')} | {fmt_value(row['pct'], '{:.1%}')} | "
                  f"{row['self_cpu_ms_per_step']:.3f} |")
        if p["kernels"]:
            print(f"\n| kernel (rank {rk}) | calls/step | ms/step | % of profiled device time |\n|---|---|---|---|")
            for k in p["kernels"]:
                print(f"| {_cell(k['name'])} | {k['calls_per_step']:.4g} | {k['ms_per_step']:.3f} | "
                      f"{fmt_value(k['pct'], '{:.1%}')} |")
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
        parts = " | ".join(f"{b} {v['ms_per_step']:.2f} ({fmt_value(v['pct'], '{:.1%}')})" for b, v in p["buckets"].items())
        print(f"bench_train profile buckets (rank {rk}, self {unit} ms/step of {p['ms_per_step']:.2f}): {parts}")
    sys.stdout.flush()

