"""Compare two `scripts/bench_train.py --json` results: step time, MFU, memory and, where both were profiled, device
time per bucket (ms/step), with the change from A to B.

    python scripts/bench_compare.py before.json after.json
"""

from __future__ import annotations

import argparse
import json
import sys

_ROWS = (("step ms (mean)", "step_ms", "{:.2f}"), ("step ms (median)", "step_ms_median", "{:.2f}"),
         ("model TFLOP/s per device", "tflops_per_device", "{:.1f}"), ("local MFU vs vendor peak", "mfu_vendor", "{:.1%}"),
         ("MFU vs measured matmul", "mfu_measured", "{:.1%}"), ("peak allocated GiB", "peak_allocated_gib_max", "{:.2f}"),
         ("host ms per batch", "data_ms_per_batch", "{:.1f}"), ("scaling ratio", "scaling_ratio", "{:.3f}"))


def _load(path: str) -> dict:
    try:
        with open(path) as f:
            d = json.load(f)
    except (OSError, json.JSONDecodeError) as e:
        raise SystemExit(f"bench_compare: error: {path}: {e}") from None
    if not isinstance(d, dict) or "aggregate" not in d:
        raise SystemExit(f"bench_compare: error: {path}: not a bench_train --json result (no 'aggregate')")
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
        va, vb = a["aggregate"].get(key), b["aggregate"].get(key)
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
