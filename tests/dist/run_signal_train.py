"""`python -m gem.train` that signals itself after step `--send-step` (first attempt, rank 0 only):
`--to agent`: the torchrun agent (as SLURM, Kubernetes or a terminal's Ctrl-C signal the launcher; it forwards the
signal to every rank); `--to self`: this process.
`--again SIG`: a second signal to this process while the stop's checkpoint is being written.
The other arguments go to gem.train."""

from __future__ import annotations

import argparse
import os
import signal
import sys
import time

import torch.distributed as dist

from gem.cli.train import main
from gem.train import checkpoint
from gem.train.checkpoint import restart_count

_sent = []


def signal_after(step: int, sig: signal.Signals, to: str):
    def hook(trainer) -> None:
        if trainer.step == step and trainer.rank == 0 and restart_count() == 0:
            _sent.append(sig)
            if to == "agent":
                os.kill(os.getppid(), sig)
            else:
                os.kill(os.getpid(), sig)

    return hook


def signal_during_save(sig: signal.Signals) -> None:
    """Once the first signal is sent, the next save is signalled again after its shards are written, before the
    rename that would make it a checkpoint."""
    real = checkpoint.dcp.save

    def save(state, checkpoint_id):
        out = real(state, checkpoint_id=checkpoint_id)
        if _sent:
            os.kill(os.getpid(), sig)
            time.sleep(10)  # the watcher thread ends the process meanwhile
        return out

    checkpoint.dcp.save = save


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--send-step", type=int, required=True)
    ap.add_argument("--send", default="SIGTERM")
    ap.add_argument("--to", choices=("agent", "self"), default="agent")
    ap.add_argument("--again", default=None)
    a, rest = ap.parse_known_args()
    if a.again:
        signal_during_save(signal.Signals[a.again])
    code = main(rest, hooks=(signal_after(a.send_step, signal.Signals[a.send], a.to),))
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
    sys.exit(code)
