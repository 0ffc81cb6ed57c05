"""Fold tuning-cache files (GEM_TUNE_CACHE=DIR after a benchmark run on a GPU) into the shipped defaults,
gem/ops/tuned/defaults.json, so fresh processes on that GPU and software stack tune nothing.

    python tools/ship_tuned.py DIR [--out gem/ops/tuned/defaults.json]

An entry replaces the shipped one with the same op and environment; other entries are kept.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from gem.ops._tune import FORMAT, SHIPPED, _valid


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("cache_dir", type=Path)
    ap.add_argument("--out", type=Path, default=SHIPPED)
    args = ap.parse_args(argv)
    files = sorted(args.cache_dir.rglob("*.json"))
    if not files:
        print(f"ship_tuned: error: {args.cache_dir}: no tuning files", file=sys.stderr)
        return 2
    shipped = json.loads(args.out.read_text()) if args.out.exists() else {"format": FORMAT, "entries": []}
    entries = {(json.dumps(e["env"], sort_keys=True), e["op"]): e for e in shipped["entries"]}
    for f in files:
        body = json.loads(f.read_text())
        if not (_valid(body) and body.get("format") == FORMAT):
            print(f"ship_tuned: error: {f}: not a tuning file of format {FORMAT}", file=sys.stderr)
            return 2
        entries[(json.dumps(body["env"], sort_keys=True), body["op"])] = {
            "env": body["env"], "op": body["op"], "configs": body["configs"]}
    out = {"format": FORMAT, "entries": [entries[k] for k in sorted(entries)]}
    args.out.write_text(json.dumps(out, indent=1, sort_keys=True) + "\n")
    print(f"ship_tuned: {len(files)} files -> {args.out} ({len(out['entries'])} entries)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
