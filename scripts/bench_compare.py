"""Compare two training benchmark --json results (gem.bench.compare; --help)."""

import sys

from gem.bench.compare import main

if __name__ == "__main__":
    sys.exit(main())
