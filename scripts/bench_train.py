"""Training throughput and MFU of one experiment, measured through the real trainer: gem.bench (see its docstring,
or --help). The same as `gem-bench` and `python -m gem.bench`; needs gem importable (pip install -e ., or
PYTHONPATH=<checkout>)."""

import sys

from gem.bench.runner import main

if __name__ == "__main__":
    sys.exit(main())
