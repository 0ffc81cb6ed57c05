"""Benchmarks in fresh processes, one after another: min / median / max per figure over the processes, and A/B
runs that alternate this gem with another checkout's (its own code). Also the argv and stderr helpers that the
kernel benchmarks' own fresh-process runs share."""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

import gem
from gem.bench.options import BenchError
from gem.bench.report import fmt_value
from gem.bench.tuned import save_reference


def strip_options(argv: list[str], options: tuple[str, ...]) -> list[str]:
    """argv without `options` and their values (also as --opt=value or an abbreviation argparse accepted: the
    parse already rejected ambiguous ones): what a parent passes on to its children."""
    out, i = [], 0
    while i < len(argv):
        name = argv[i].split("=", 1)[0]
        if name.startswith("--") and len(name) > 2 and any(o.startswith(name) for o in options):
            i += 1 if "=" in argv[i] else 2
            continue
        out.append(argv[i])
        i += 1
    return out


_CAUSE = re.compile(r"Error|error:|what\(\):|Assertion|terminate called")


def stderr_tail(text: str, chars: int = 300) -> str:
    """A failed child's stderr on one line: the last line that names an error (a C++ abort ends in stack frames,
    after its `what():` line), then the last lines."""
    lines = [ln.strip() for ln in text.strip().splitlines() if ln.strip()]
    if not lines:
        return "no stderr"
    tail = " / ".join(lines[-3:])[-chars:]
    cause = next((ln for ln in reversed(lines[:-3]) if _CAUSE.search(ln)), None)
    return tail if cause is None else f"{cause[:chars]} ... {tail}"


def this_tree() -> tuple[list[str], Path]:
    """The command that runs this gem's training benchmark in a child, and the folder that holds this gem package
    (first on the child's PYTHONPATH, so the child imports the same code)."""
    return [sys.executable, "-m", "gem.bench"], Path(gem.__file__).resolve().parents[1]


def checkout_tree(checkout: str) -> tuple[list[str], Path]:
    """Another gem checkout's training benchmark (scripts/bench_train.py, its own code)."""
    root = Path(checkout).resolve()
    return [sys.executable, str(root / "scripts" / "bench_train.py")], root


_PARENT_OPTIONS = ("--processes", "--baseline", "--json", "--write-reference")
# per-process figures the summary gathers: (label, aggregate key, scale, format)
_PROCESS_FIGURES = (("step ms mean", "step_ms", 1.0, "{:.1f}"), ("step ms median", "step_ms_median", 1.0, "{:.1f}"),
                    ("TFLOP/s per GPU", "tflops_per_device", 1.0, "{:.1f}"),
                    ("local MFU %", "mfu_local", 100.0, "{:.1f}"),
                    ("peak GiB", "peak_allocated_gib_max", 1.0, "{:.1f}"))


def _triple(values: list[float], fmt: str) -> str:
    if not values:
        return "n/a"
    return " / ".join(fmt.format(v) for v in (min(values), statistics.median(values), max(values)))


def run_processes(args: argparse.Namespace, argv: list[str]) -> int:
    """The benchmark in args.processes fresh single-rank processes, one after another, alternating with a baseline
    checkout's benchmark when given; then min / median / max of each process's figures, per tree."""
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        raise BenchError("--processes / --baseline start single-rank processes: run them without torchrun")
    forwarded = strip_options(argv, _PARENT_OPTIONS)
    trees = [("this", this_tree())]
    if args.baseline:
        trees.append(("baseline", checkout_tree(args.baseline)))
    n = args.processes
    print(f"# bench_train in {n} fresh process(es) per tree, one after another"
          f"{', alternating with ' + str(trees[1][1][1]) if args.baseline else ''}: "
          f"{' '.join(forwarded) or '(defaults)'}", flush=True)
    if args.write_reference and not torch.cuda.is_available():
        raise BenchError("--write-reference: the reference step is a GPU's; there is no CUDA device here")
    record, figures, confs = [], {name: [] for name, _ in trees}, {name: [] for name, _ in trees}
    with tempfile.TemporaryDirectory(prefix="bench_train.") as tmp:
        for i in range(1, n + 1):
            for name, (cmd, root) in trees:
                out = os.path.join(tmp, f"{name}{i}.json")
                t0 = time.time()
                # the tree's root first on the path: `import gem` in the child takes that tree's code
                paths = [str(root)] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
                env = dict(os.environ, PYTHONPATH=os.pathsep.join(paths))
                proc = subprocess.run([*cmd, *forwarded, "--json", out], check=False, capture_output=True, text=True,
                                      env=env)
                took = time.time() - t0
                summary = [ln for ln in proc.stdout.splitlines() if ln.startswith("bench_train summary:")]
                if proc.returncode == 0 and os.path.exists(out):
                    body = json.loads(Path(out).read_text())
                    agg = body["aggregate"]
                    figures[name].append(agg)
                    confs[name].append(body.get("config"))
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
        print(f"| {name} | {len(aggs)} of {n} | {cells} | {fmt_value(spread and 100 * spread, '{:.1f}%')} |")
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
    if args.write_reference:
        steps = summary["this"]["step_ms"]
        save_reference(args.write_reference, statistics.median(steps), confs["this"][0], len(steps),
                       "median over the processes of each process's mean step", argv)
    return 0

