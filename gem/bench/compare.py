"""Compare two `scripts/bench_train.py --json` results: step time, MFU (E2E, local, scaling), the step-time breakdown,
memory and, where both were profiled, device time per bucket (ms/step), with the change from A to B.

    python scripts/bench_compare.py before.json after.json
"""

from __future__ import annotations

import argparse
import json
import sys

_ROWS = (
    ("step ms (mean)", "step_ms", "{:.2f}"), ("step ms (median)", "step_ms_median", "{:.2f}"),
    ("model TFLOP/s per device", "tflops_per_device", "{:.1f}"), ("E2E MFU vs vendor peak", "mfu_e2e", "{:.1%}"),
    ("local MFU vs vendor peak", "mfu_local", "{:.1%}"), ("scaling ratio (E2E / local)", "scaling_ratio", "{:.3f}"),
    ("E2E MFU vs measured matmul", "mfu_measured", "{:.1%}"),
    ("peak allocated GiB", "peak_allocated_gib_max", "{:.2f}"), ("host ms per batch", "data_ms_per_batch", "{:.1f}"),
    ("TFLOP/s per device vs 1 GPU", "scaling_vs_single_gpu", "{:.3f}"),
    ("input ms", "phase_ms.input", "{:.2f}"), ("forward ms", "phase_ms.forward", "{:.2f}"),
    ("backward ms", "phase_ms.backward", "{:.2f}"), ("optimizer ms", "phase_ms.optimizer", "{:.2f}"),
    ("exposed comm ms", "exposed_comm_ms", "{:.2f}"), ("communication ms, hidden or not", "comm_ms", "{:.2f}"),
)


def _get(agg: dict, key: str):
    for part in key.split("."):
        agg = agg.get(part) if isinstance(agg, dict) else None
    return agg


def _load(path: str) -> dict:
    try:
        with open(path) as f:
            d = json.load(f)
    except (OSError, json.JSONDecodeError) as e:
        raise SystemExit(f"bench_compare: error: {path}: {e}") from None
    if not isinstance(d, dict) or "aggregate" not in d:
        raise SystemExit(f"bench_compare: error: {path}: not a bench_train --json result (no 'aggregate')")
    agg = d["aggregate"]
    if "mfu_vendor" in agg:  # results written before local MFU: their scaling ratio was against a 1-GPU run
        agg["mfu_e2e"] = agg.pop("mfu_vendor")
        agg["scaling_vs_single_gpu"] = agg.pop("scaling_ratio", None)
    return d


def _buckets(d: dict) -> dict[str, float] | None:
    ranks = (d.get("profile") or {}).get("ranks") or []
    if not ranks:
        return None
    out: dict[str, float] = {}
    for r in ranks:  # mean over ranks
        for name, v in r["buckets"].items():
            out[name] = out.get(name, 0.0) + v["ms_per_step"] / len(ranks)
    out["device total"] = sum(r["ms_per_step"] for r in ranks) / len(ranks)
    return out


def _fmt(v, f: str) -> str:
    return "n/a" if v is None else f.format(v)


def compare(a: dict, b: dict) -> list[str]:
    lines = ["| metric | A | B | B - A | B / A |", "|---|---|---|---|---|"]
    for label, key, f in _ROWS:
        va, vb = _get(a["aggregate"], key), _get(b["aggregate"], key)
        delta = ratio = "n/a"
        if va is not None and vb is not None:
            delta = f.format(vb - va)
            ratio = f"{vb / va:.3f}" if va else "n/a"
        lines.append(f"| {label} | {_fmt(va, f)} | {_fmt(vb, f)} | {delta} | {ratio} |")
    ba, bb = _buckets(a), _buckets(b)
    if ba and bb:
        lines += ["", "| device ms/step | A | B | B - A |", "|---|---|---|---|"]
        for name in ba:
            lines.append(f"| {name} | {ba[name]:.2f} | {bb.get(name, 0.0):.2f} | {bb.get(name, 0.0) - ba[name]:+.2f} |")
        for name, label in (("device total", "GPU idle (step - device)"),):
            ia = a["aggregate"]["step_ms"] - ba[name]
            ib = b["aggregate"]["step_ms"] - bb[name]
            lines.append(f"| {label} | {ia:.2f} | {ib:.2f} | {ib - ia:+.2f} |")
    elif ba or bb:
        lines.append("\n(only one of the two was run with --profile-steps: no bucket comparison)")
    return lines


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("a", help="the first --json result (before)")
    p.add_argument("b", help="the second --json result (after)")
    args = p.parse_args(argv)
    print("\n".join(compare(_load(args.a), _load(args.b))))
    return 0


if __name__ == "__main__":
    sys.exit(main())
