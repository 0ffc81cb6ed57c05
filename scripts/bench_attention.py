"""Attention benchmark: our Triton kernels beside the alternatives (docs/PERF.md), on one GPU.

    python scripts/bench_attention.py [--sections jfa,swa,gdpa,block] [--quick] [--json out.json] [--plot out.png]
                                      [--jfa-anchors all|none|varlen_attn,...]

Prints the measured bf16 matmul peak, then one markdown table per section. A section whose module is missing
or fails is reported and skipped; inside a section each competitor that cannot run says why in its notes.
"""

from __future__ import annotations

import argparse
import importlib
import math
import os
import sys
import time
import traceback

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch

from scripts.bench.common import dump_json, matmul_peak_tflops, print_table

# section -> (module under scripts/bench, function returning list[Row])
SECTIONS = {
    "jfa": ("jfa_section", "run_jfa"),
    "swa": ("jfa_section", "run_swa"),
    "gdpa": ("gdpa_section", "run"),
    "block": ("block_section", "run"),
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


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sections", default=",".join(SECTIONS), help="comma list of " + ",".join(SECTIONS))
    p.add_argument("--quick", action="store_true", help="fewer shapes and repetitions (< 3 minutes)")
    p.add_argument("--json", default=None, help="write every row to this JSON file")
    p.add_argument("--plot", default=None, help="write a PNG of TFLOP/s vs N per implementation")
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
    args = p.parse_args(argv)

    if not torch.cuda.is_available():
        sys.exit("the attention benchmark needs a CUDA device")
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
            mod = importlib.import_module(f"scripts.bench.{module}")
            run = getattr(mod, fn)
        except Exception as e:  # noqa: BLE001
            print(f"\n## {name}: skipped, scripts/bench/{module}.py not usable ({type(e).__name__}: {e})")
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


if __name__ == "__main__":
    main()
