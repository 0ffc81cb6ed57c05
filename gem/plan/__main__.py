"""`python -m gem.plan`: the same as `gem-plan` (gem/cli/plan.py)."""

from gem.cli.plan import run

run()
