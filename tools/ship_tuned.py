"""Fold tuning-cache files (GEM_TUNE_CACHE=DIR after a benchmark run on a GPU) into the shipped defaults,
gem/ops/tuned/defaults.json, so fresh processes on that GPU and software stack tune nothing.

    python tools/ship_tuned.py DIR [--out gem/ops/tuned/defaults.json]

An entry replaces the shipped one with the same op and environment; other entries are kept. The writing is
gem.bench.tuned's (the one writer of gem's shipped measurement data).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from gem.bench.tuned import ship_tuned


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("cache_dir", type=Path)
    ap.add_argument("--out", type=Path, default=None, help="default: gem/ops/tuned/defaults.json")
    args = ap.parse_args(argv)
    try:
        files, entries = ship_tuned(args.cache_dir, args.out)
    except ValueError as e:
        print(f"ship_tuned: error: {e}", file=sys.stderr)
        return 2
    print(f"ship_tuned: {files} files -> {args.out or 'gem/ops/tuned/defaults.json'} ({entries} entries)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
