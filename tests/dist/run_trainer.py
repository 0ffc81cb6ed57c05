"""The real Trainer (AdamW, clipping, warmup + cosine decay, bf16 autocast, fused sparse optimizer) under several
`parallel:` layouts, one after another in this launch; rank 0 saves per layout the per-step global losses and the
full trained parameters (tables gathered, FSDP DTensors materialised) to --out (torch.save); then, in the same
launch, the dense memory of the --memory-cases (tests/dist/run_memory.py).

Data: one Parquet file; rank r of W takes global batches r, r + W, ... of data.batch_size rows, so W ranks with
batch B read, step by step, the rows one rank reads with batch W * B.
"""

from __future__ import annotations

import argparse
import json

import torch
import torch.distributed as dist


def full_state(p) -> dict[str, torch.Tensor]:
    """{canonical name: full tensor} of the model's parameters on rank 0 (empty elsewhere); collective."""
    from torch.distributed._shard.sharded_tensor import ShardedTensor
    from torch.distributed.tensor import DTensor

    out = {}
    for name, v in p.model.state_dict().items():
        if isinstance(v, ShardedTensor):
            full = torch.zeros(v.size(), dtype=v.dtype) if dist.get_rank() == 0 else None
            v.gather(dst=0, out=full)
        elif isinstance(v, DTensor):
            full = v.full_tensor()
        else:
            full = v
        for wrapper in ("_dmp_wrapped_module.", "module.", "_checkpoint_wrapped_module.", "_orig_mod."):
            name = name.replace(wrapper, "")
        if dist.get_rank() == 0:
            out[name] = full.detach().float().cpu().clone()
    return out


def train_layouts(common: list[str], layouts: dict[str, list[str]], global_batch: int) -> dict:
    """Train each layout in turn (collective); rank 0 gets {layout: results}."""
    from gem.parallel.dims import init_distributed
    from gem.train.trainer import Trainer
    from tests.train._util import compose

    init_distributed()
    world = dist.get_world_size()
    results = {}
    for name, overrides in layouts.items():
        cfg = compose(common + [f"data.batch_size={global_batch // world}"] + overrides)
        t = Trainer(cfg)
        try:
            initial = full_state(t.par)
            norms = []
            t.hooks.append(lambda tr, norms=norms: norms.append(float(tr.optimizer.last_grad_norm)))
            res = t.fit()
        finally:
            t.close()
        losses = torch.tensor(res.losses, dtype=torch.float64)
        dist.all_reduce(losses)  # rank-local means of equal batches: their mean is the global batch's mean
        results[name] = {"losses": (losses / world).tolist(), "grad_norms": norms,
                         "lrs": [t.optimizer.schedule(s) for s in range(res.steps)],
                         "params": full_state(t.par), "initial": initial, "describe": t.par.dims.describe()}
    return results


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--common", required=True, help="JSON list of Hydra overrides for every layout")
    ap.add_argument("--layouts", required=True, help="JSON {name: [overrides]}")
    ap.add_argument("--global-batch", type=int, required=True)
    ap.add_argument("--memory-cases", default="{}", help="JSON cases of tests/dist/run_memory.py, measured after")
    ap.add_argument("--memory-blocks", type=int, default=2)
    a = ap.parse_args()
    from tests.dist.run_memory import measure_cases

    results = {"train": train_layouts(json.loads(a.common), json.loads(a.layouts), a.global_batch),
               "memory": measure_cases(json.loads(a.memory_cases), a.memory_blocks)}
    if dist.get_rank() == 0:
        torch.save(results, a.out)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
