"""`gem-train`: the console script; the same as `python -m gem.train` (Hydra overrides as arguments)."""

from __future__ import annotations

import sys


def main(argv: list[str] | None = None) -> None:
    from gem.train.__main__ import main as train_main

    code = train_main(argv)
    try:
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            dist.destroy_process_group()
    finally:
        sys.exit(code)


if __name__ == "__main__":
    main()
