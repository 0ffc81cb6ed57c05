"""`gem-bench`: the training benchmark (gem.bench; the same as scripts/bench_train.py and `python -m gem.bench`)."""

from __future__ import annotations

import sys


def main(argv: list[str] | None = None) -> None:
    from gem.bench.runner import main as bench_main

    sys.exit(bench_main(argv))


if __name__ == "__main__":
    main()
