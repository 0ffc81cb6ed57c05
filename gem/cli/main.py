"""`gem COMMAND ...`: one entry point for the three tools (the same as gem-train, gem-plan, gem-bench)."""

from __future__ import annotations

import sys

USAGE = """usage: gem {train,plan,bench} [ARGS ...]
  train   train a model (python -m gem.train; KEY=VALUE Hydra overrides, --check, --help)
  plan    memory, communication and step time of a config on a cluster (python -m gem.plan; --search, --help)
  bench   training throughput and MFU through the real trainer (python -m gem.bench; --help)
"""


def main(argv: list[str] | None = None) -> None:
    args = list(sys.argv[1:] if argv is None else argv)
    if not args or args[0] in ("-h", "--help"):
        print(USAGE, end="")
        sys.exit(0 if args else 2)
    command, rest = args[0], args[1:]
    if command == "train":
        from gem.cli.train import run
    elif command == "bench":
        from gem.cli.bench import main as run
    elif command == "plan":
        from gem.cli.plan import run
    else:
        print(f"gem: error: unknown command {command!r} (expected train, plan or bench)", file=sys.stderr)
        sys.exit(2)
    run(rest)


if __name__ == "__main__":
    main()
