"""Simulated rank imbalance with and without data.balance=cost, on the host (gem.bench.balance; --help). Needs gem
importable (pip install -e ., or PYTHONPATH=<checkout>)."""

import sys

from gem.bench.balance import simulate_main

if __name__ == "__main__":
    sys.exit(simulate_main())
