"""Trainer runs (fresh or resumed) on this launch's ranks, one after another; rank 0 writes per job and rank the
rank-local loss of every step and the first dense row of every batch it trained on (JSON).

Also imported by tests/dist/test_resume_world_size.py to run the same jobs in-process on one rank.
"""

from __future__ import annotations

import argparse
import json

import torch.distributed as dist


def run_job(overrides: list[str], run_dir: str) -> dict:
    """{"losses": [...], "rows": [[first dense row of the step's batch], ...], "position": first position}."""
    from gem.train.trainer import Trainer
    from tests.train._util import compose

    t = Trainer(compose(overrides), run_dir=run_dir)
    rows: list[list[float]] = []
    t.inner.register_forward_pre_hook(lambda _m, args: rows.append(args[0].dense[0].tolist()))
    position = t.step + t._data_offset
    try:
        res = t.fit()
    finally:
        t.close()
    return {"losses": list(res.losses), "rows": rows, "position": position, "first_step": res.steps - len(res.losses)}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--jobs", required=True, help='JSON [{"run_dir": ..., "overrides": [...]}]')
    a = ap.parse_args()

    from gem.parallel.dims import init_distributed

    init_distributed()
    out = []
    for job in json.loads(a.jobs):
        mine = run_job(job["overrides"], job["run_dir"])
        every = [None] * dist.get_world_size()
        dist.all_gather_object(every, mine)
        out.append(every)
    if dist.get_rank() == 0:
        with open(a.out, "w") as f:
            json.dump(out, f)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
