import sys

from gem.plan.cli import main

sys.exit(main())
