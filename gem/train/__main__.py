"""`python -m gem.train`: the same as `gem-train` (gem/cli/train.py)."""

from gem.cli.train import main, run

__all__ = ["main"]

if __name__ == "__main__":
    run()
