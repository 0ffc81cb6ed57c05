"""`python -m gem.bench [options] [overrides]`: the training benchmark (the same as gem-bench)."""

import sys

from gem.bench.runner import main

sys.exit(main())
