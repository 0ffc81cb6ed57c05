"""Two ranks whose background save ends between different steps: rank 1 sees it end at its first `poll`, rank 0
only at its second. A training collective runs between the polls; it must pair with the peer's (a barrier inside
`poll` would pair with it instead), and `wait` then publishes the checkpoint on every rank."""

from __future__ import annotations

import argparse
import os
from concurrent.futures import Future
from datetime import timedelta

import torch
import torch.distributed as dist

from gem.train import checkpoint
from tests.dist._common import finish

if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--dir", required=True)
    a = ap.parse_args()
    dist.init_process_group("gloo", timeout=timedelta(seconds=30))  # a mismatched collective fails, not hangs
    rank = dist.get_rank()
    future: Future = Future()

    def async_save(state, checkpoint_id, **_):
        if rank == 0:  # stands for DCP's write: the shards directory exists once the save ends
            os.makedirs(checkpoint_id, exist_ok=True)
        else:
            future.set_result(None)  # this rank's part ends at once
        return future

    checkpoint.dcp.async_save = async_save
    c = checkpoint.Checkpointer(a.dir, async_save=True)
    c.save(1, {"w": torch.zeros(2)})
    seen = [c.poll() is None and c._pending is None]  # rank 1: ended and taken; rank 0: still running
    if rank == 0:
        future.set_result(None)
    x = torch.tensor([float(rank + 1)])
    dist.all_reduce(x)  # the next step's collective
    seen.append(c.poll() is None and c._pending is None)
    failure = c.wait()
    published = sorted(p.name for p in checkpoint.Path(a.dir).iterdir())
    got = [None, None]
    dist.all_gather_object(got, {"seen": seen, "sum": x.item(), "failure": failure, "published": published})
    c.close()
    finish(a.out, {"ranks": got})
