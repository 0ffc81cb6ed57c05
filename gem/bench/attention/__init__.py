"""Attention benchmark: our Triton kernels beside the alternatives (docs/PERF.md), on one GPU.

    python scripts/bench_attention.py [--sections jfa,swa,gdpa,block] [--quick] [--json out.json] [--plot out.png]
                                      [--jfa-anchors all|none|varlen_attn,...] [--processes N]

Prints the measured bf16 matmul peak, then one markdown table per section. A section whose module is missing
or fails is reported and skipped; inside a section each competitor that cannot run says why in its notes.
--processes N runs the whole benchmark in N fresh processes, one after another, and prints min / median / max
per row over them, with each row's process-to-process spread.
"""

from __future__ import annotations

import argparse
import importlib
import math
import os
import re
import subprocess
import sys
import tempfile
import time
import traceback

import torch

from gem.bench.kernels import (
    aggregate_rows,
    dump_json,
    largest_spread,
    load_json,
    matmul_peak_tflops,
    medians,
    print_spread,
    print_table,
)
from gem.bench.processes import stderr_tail, strip_options

# section -> (module of gem.bench.attention, function returning list[Row])
SECTIONS = {
    "jfa": ("jfa", "run_jfa"),
    "swa": ("jfa", "run_swa"),
    "gdpa": ("gdpa", "run"),
    "block": ("block", "run"),
}


def _plot(rows, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    groups = {}
    for r in rows:
        n = r.extra.get("N")
        if n is None:
            continue
        kind = r.case.split(" N=")[0]
        groups.setdefault((r.section, kind), {}).setdefault(r.impl, []).append((n, r.fwd_tflops, r.bwd_tflops))
    if not groups:
        print(f"nothing to plot (no rows carry N); {path} not written")
        return
    fig, axes = plt.subplots(len(groups), 2, figsize=(12, 3.6 * len(groups)), squeeze=False)
    for ax_row, ((section, kind), impls) in zip(axes, sorted(groups.items())):
        for col, label in enumerate(("fwd", "bwd")):
            ax = ax_row[col]
            for impl, pts in impls.items():
                pts = sorted(p for p in pts if not math.isnan(p[1 + col]))
                if pts:
                    ax.plot([p[0] for p in pts], [p[1 + col] for p in pts], marker="o", label=impl)
            ax.set_xscale("log", base=2)
            ax.set_title(f"{section} {kind} {label}")
            ax.set_xlabel("N (max length)")
            ax.set_ylabel("effective TFLOP/s")
            ax.grid(alpha=0.3)
            ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print(f"plot written to {path}")


# the parent's own options: a child gets every other argument as given
PARENT_OPTIONS = ("--processes", "--json", "--plot")


def child_argv(argv: list[str]) -> list[str]:
    """argv without the parent's own options and their values."""
    return strip_options(argv, PARENT_OPTIONS)


def _run_processes(args, argv: list[str]) -> None:
    """The benchmark in args.processes fresh processes in sequence (they share one GPU), then the summary."""
    n, forwarded = args.processes, child_argv(argv)
    print(f"# attention benchmark in {n} fresh processes, one after another: {' '.join(forwarded) or '(defaults)'}")
    runs, record = [], []
    with tempfile.TemporaryDirectory(prefix="bench_attention.") as tmp:
        for i in range(1, n + 1):
            out = os.path.join(tmp, f"process{i}.json")
            t0 = time.time()
            proc = subprocess.run([sys.executable, "-m", "gem.bench.attention", *forwarded, "--json", out],
                                  check=False, capture_output=True, text=True)
            took = time.time() - t0
            if proc.returncode == 0 and os.path.exists(out):
                rows = load_json(out)
                runs.append(rows)
                record.append({"process": i, "status": "ok", "rows": rows})
                print(f"process {i}/{n}: {len(rows)} rows in {took:.0f} s")
                for line in proc.stdout.splitlines():  # its GPU and peak, and any section it skipped
                    if line.startswith(("# attention benchmark", "measured bf16")) or re.match(r"## \S+: ", line):
                        print(f"  {line}")
            else:
                rc = proc.returncode
                status = f"exit status {rc}" if rc >= 0 else f"killed by signal {-rc}"
                record.append({"process": i, "status": status, "stderr_tail": stderr_tail(proc.stderr), "rows": []})
                print(f"process {i}/{n}: failed ({status}, {took:.0f} s): {stderr_tail(proc.stderr)}")
            sys.stdout.flush()
    if not runs:
        sys.exit(f"bench_attention: error: all {n} processes failed")
    failed = f" ({n - len(runs)} of {n} failed)" if len(runs) < n else ""
    agg = aggregate_rows(runs)
    for section in dict.fromkeys(r.section for r in agg):
        rows = [r for r in agg if r.section == section]
        print_table(rows, f"{section}: min / median / max over {len(runs)} processes{failed}")
        print_spread(rows, f"{section}: process-to-process spread, (max - min) / median")
    pct, row, part = largest_spread(agg)
    if row is None:
        print("\nlargest process-to-process spread: none (no row was timed in 2 or more processes)")
    else:
        print(f"\nlargest process-to-process spread: {pct:.1f}% ({row.section} | {row.case} | {row.impl}, {part})")
    if args.json:
        dump_json({"processes": record, "aggregate": agg}, args.json)
        print(f"rows written to {args.json}")
    if args.plot:
        try:
            _plot(medians(agg), args.plot)
        except Exception as e:  # noqa: BLE001
            print(f"plot skipped: {type(e).__name__}: {e}")


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sections", default=",".join(SECTIONS), help="comma list of " + ",".join(SECTIONS))
    p.add_argument("--quick", action="store_true", help="fewer shapes and repetitions (< 3 minutes)")
    p.add_argument("--json", default=None, help="write every row to this JSON file (with --processes: each "
                   "process's rows and the summary)")
    p.add_argument("--plot", default=None, help="write a PNG of TFLOP/s vs N per implementation (with --processes: "
                   "the medians)")
    p.add_argument("--processes", type=int, default=1,
                   help="run the benchmark in this many fresh processes, one after another, and print min / median "
                        "/ max per row and the process-to-process spread")
    p.add_argument("--verbose", action="store_true", help="print tracebacks of skipped competitors")
    p.add_argument("--jfa-anchors", default="all",
                   help="competitors timed in the jfa/swa sections: 'all', 'none' or a comma list of row names")
    p.add_argument("--block-lengths", default=None,
                   help="block section: a comma list of sequence lengths at block 512 only (default: 1K-64K, then "
                        "blocks 64/128/256 at 16K)")
    p.add_argument("--gdpa-cases", default=None,
                   help="gdpa section: only cases whose name holds one of these (comma list, e.g. 'fixed,M=64')")
    p.add_argument("--block-impls", default=None,
                   help="block section: only the rows whose name holds one of these comma-separated texts (e.g. "
                        "'no RoPE,flex'; the fused row always runs, as the ratios' base)")
    argv = sys.argv[1:] if argv is None else list(argv)
    args = p.parse_args(argv)
    if args.processes < 1:
        p.error(f"--processes: must be at least 1 (got {args.processes})")

    if not torch.cuda.is_available():
        sys.exit("the attention benchmark needs a CUDA device")
    if args.processes > 1:
        _run_processes(args, argv)
        return
    print(f"# attention benchmark: {torch.cuda.get_device_name()} torch {torch.__version__}", end="")
    try:
        import triton

        print(f" triton {triton.__version__}")
    except ImportError:
        print()
    print(f"measured bf16 matmul peak: {matmul_peak_tflops():.0f} TFLOP/s")

    rows = []
    for name in [s.strip() for s in args.sections.split(",") if s.strip()]:
        if name not in SECTIONS:
            print(f"\n## {name}: unknown section (known: {', '.join(SECTIONS)}), skipped")
            continue
        module, fn = SECTIONS[name]
        try:
            mod = importlib.import_module(f"gem.bench.attention.{module}")
            run = getattr(mod, fn)
        except Exception as e:  # noqa: BLE001
            print(f"\n## {name}: skipped, gem/bench/attention/{module}.py not usable ({type(e).__name__}: {e})")
            continue
        t0 = time.time()
        try:
            section_rows = run(args)
        except Exception as e:  # noqa: BLE001
            print(f"\n## {name}: failed ({type(e).__name__}: {e})")
            traceback.print_exc()
            continue
        print_table(section_rows, f"{name} ({time.time() - t0:.0f} s)")
        rows += section_rows
        sys.stdout.flush()

    if args.json:
        dump_json(rows, args.json)
        print(f"rows written to {args.json}")
    if args.plot:
        try:
            _plot(rows, args.plot)
        except Exception as e:  # noqa: BLE001
            print(f"plot skipped: {type(e).__name__}: {e}")

