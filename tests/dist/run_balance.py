"""Training with data.balance=cost on W ranks against one rank on the same global batches.

Under torchrun (W ranks): 20 steps on synthetic data, and on Parquet files a run stopped at step 10 with a
checkpoint and resumed to 20; rank 0 writes each run's per-step loss (mean over ranks = the global mean, every
rank holding the same number of examples) and the logged perf/rank_imbalance. Without torchrun (`--reference W`): one rank trains on the
whole global batch of each step: for Parquet through the config alone (batch_size W x B reads the same rows),
for synthetic data on the W per-rank draws of the step, concatenated.
"""

from __future__ import annotations

import argparse
import json
import os

import torch
import torch.distributed as dist

from gem.data.balance import BalancedDataset
from tests.train._util import compose

STEPS = 20
GLOBAL_BATCH = 16


def overrides(batch: int, run_dir: str, extra: list[str]) -> list[str]:
    return [
        "model.kernel=reference",
        "model.moe.aux_loss_coef=0",  # MoE's load-balancing loss is a per-rank statistic, not a mean over examples
        f"data.batch_size={batch}",
        "data.eval_batches=0",
        "data.histories.events.max_len=32",
        "data.histories.events.distribution=zipf",
        f"train.steps={STEPS}",
        "train.warmup_steps=2",
        "train.log_every=5",
        "train.eval_every=0",
        "train.tensorboard=false",
        "train.mfu.comm_probe_every=0",  # no torch.profiler windows: this run checks losses, not communication
        f"train.checkpoint.dir={run_dir}/ckpt",
        *extra,
    ]


def train(batch: int, run_dir: str, extra: list[str], whole_steps_of: int | None = None,
          resume: bool = False) -> list[float]:
    """Per-step losses, averaged over ranks. `whole_steps_of`: (one rank) train on the concatenated draws of a
    world of that size instead of this world's."""
    from gem.data import SyntheticDataset
    from gem.model.flops import example_cost
    from gem.train.trainer import Trainer

    t = Trainer(compose(overrides(batch, run_dir, [*extra, f"train.resume={str(resume).lower()}"])), run_dir=run_dir)
    try:
        if whole_steps_of:
            d = t.cfgs.data
            src = SyntheticDataset(d.schema, d.seed, d.batch_size, rank=0, world_size=whole_steps_of)
            t.train_data = WholeSteps(src, example_cost(t.cfgs.model))
        elif dist.get_world_size() > 1:
            assert isinstance(t.train_data, BalancedDataset), type(t.train_data)
        losses = torch.tensor(t.fit().losses, dtype=torch.float64)
    finally:
        t.close()
    if dist.get_world_size() > 1:
        dist.all_reduce(losses)
        losses /= dist.get_world_size()
    return losses.tolist()


class WholeSteps(BalancedDataset):
    """Global batch i of a world's source: every rank's draw of step i (the reference's stream)."""

    def batch(self, index: int):
        return self.split(index)[0]


def expected_imbalance(batch: int, run_dir: str) -> list[float]:
    """perf/rank_imbalance recomputed from the data: per step max / mean of the shares' summed example FLOPs,
    averaged over each log window of 5 steps."""
    import numpy as np

    from gem.data import build_dataset
    from gem.data.balance import imbalance
    from gem.model.flops import example_cost
    from gem.train.trainer import build_configs

    cfgs = build_configs(compose(overrides(batch, run_dir, [])))
    w = dist.get_world_size()
    ds = build_dataset(cfgs.data, 0, w, cost=example_cost(cfgs.model))
    steps = [imbalance(costs, part, w) for _, part, costs in map(ds.split, range(STEPS))]
    return np.asarray(steps).reshape(-1, 5).mean(1).tolist()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--dir", required=True)
    ap.add_argument("--parquet", required=True, help="training file")
    ap.add_argument("--reference", type=int, nargs="*", default=None, help="one rank: the worlds to mirror")
    a = ap.parse_args()
    pq = ["data=parquet", f"data.paths=[{a.parquet}]", f"data.eval_paths=[{a.parquet}]"]
    out: dict = {}
    if a.reference is not None:
        out["parquet"] = train(GLOBAL_BATCH, f"{a.dir}/ref_pq", pq)
        for w in a.reference:
            out[f"synthetic_{w}"] = train(GLOBAL_BATCH // w, f"{a.dir}/ref_syn{w}", [], whole_steps_of=w)
    else:
        b = GLOBAL_BATCH // int(os.environ["WORLD_SIZE"])
        out["synthetic"] = train(b, f"{a.dir}/syn", [])
        first = train(b, f"{a.dir}/pq_resume", [*pq, "train.stop_at_step=10", "train.checkpoint.every=10"])
        second = train(b, f"{a.dir}/pq_resume", pq, resume=True)
        out["parquet_resumed"] = first + second
        if dist.get_rank() == 0:
            with open(f"{a.dir}/syn/metrics.jsonl") as f:
                out["imbalance"] = [r["perf/rank_imbalance"] for r in map(json.loads, f) if "perf/rank_imbalance" in r]
            out["imbalance_expected"] = expected_imbalance(b, f"{a.dir}/syn")
    if not dist.is_initialized() or dist.get_rank() == 0:
        with open(a.out, "w") as f:
            json.dump(out, f)
    if dist.is_initialized():  # every rank leaves the group together: a group torn down at exit can abort a rank
        dist.barrier()
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
