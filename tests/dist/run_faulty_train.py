"""`python -m gem.train` with a fault: `--fault-rank` exits hard right after step `--fault-step`, on the first
attempt only (so a torchrun restart can succeed). The other arguments go to gem.train."""

from __future__ import annotations

import argparse
import os
import sys

import torch.distributed as dist

from gem.train.__main__ import main
from gem.train.checkpoint import restart_count


def exit_after(step: int, rank: int):
    def hook(trainer) -> None:
        if trainer.step == step and trainer.rank == rank and restart_count() == 0:
            print(f"rank {rank} exits after step {step} (injected fault)", file=sys.stderr, flush=True)
            os._exit(1)

    return hook


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--fault-step", type=int, required=True)
    ap.add_argument("--fault-rank", type=int, default=0)
    a, rest = ap.parse_known_args()
    code = main(rest, hooks=(exit_after(a.fault_step, a.fault_rank),))
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
    sys.exit(code)
