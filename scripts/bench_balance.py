"""One-device rehearsal of data.balance: W ranks' shares of the same global batches trained one after another
(gem.bench.balance; --help). Needs gem importable (pip install -e ., or PYTHONPATH=<checkout>)."""

import sys

from gem.bench.balance import main

if __name__ == "__main__":
    sys.exit(main())
