"""`gem-bench`: the training benchmark (scripts/bench_train.py; the package ships it as gem/cli/_bench_train.py,
a link to that file, so a pip-installed gem runs the same code). Arguments as for scripts/bench_train.py."""

from __future__ import annotations

import importlib
import sys


def main(argv: list[str] | None = None) -> None:
    saved = list(sys.path)
    try:  # the script puts its checkout on sys.path for `import gem`; the package is importable already
        bench = importlib.import_module("gem.cli._bench_train")
    finally:
        sys.path[:] = saved
    sys.exit(bench.main(argv))


if __name__ == "__main__":
    main()
