"""Dense bytes per rank of the tiny GEM under `parallel:` layouts (one after another in this launch), measured on
the built, parallelized model through one training step: parameters, gradients and AdamW state (distinct local
storages, FSDP padding included), and the peak of FSDP-unsharded parameter bytes (sampled whenever autograd saves or
reads a tensor, i.e. throughout forward and backward). Rank 0 writes {case: [per-rank measurements]} as JSON
(tests/dist/run_trainer.py runs the same cases in its launch).
"""

from __future__ import annotations

import argparse
import json

import torch
import torch.distributed as dist

from tests.dist._common import dataset, finish, model_cfg, slice_batch


def _storage_bytes(tensors) -> int:
    seen = {}
    for t in tensors:
        if t is None:
            continue
        if hasattr(t, "to_local"):
            t = t.to_local()
        st = t.untyped_storage()
        seen[st.data_ptr()] = st.nbytes()
    return sum(seen.values())


class Gathered:
    """Bytes of the FSDP units that are unsharded right now or whose all-gather is in flight (prefetched: its output
    buffer is allocated); `peak` over the samples."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.groups = []
        for m in model.modules():
            state = getattr(m, "_get_fsdp_state", None)
            if state is not None:
                self.groups.extend(state()._fsdp_param_groups)
        self.peak = 0

    def sample(self, *_):
        now = 0
        for g in self.groups:
            if g.is_unsharded or g._all_gather_result is not None:
                for fp in g.fsdp_params:
                    now += fp._orig_size.numel() * (fp.param_dtype or fp.orig_dtype).itemsize
        self.peak = max(self.peak, now)


def measure(case: dict, device, blocks: int) -> dict:
    from gem.model import GEMModel
    from gem.parallel import parallelize
    from gem.train.optim import TrainOptimizer
    from gem.train.step import StepConfig, forward_loss

    rank, world = dist.get_rank(), dist.get_world_size()
    cfg = model_cfg(moe_every=2, num_experts=case.get("num_experts", 4), blocks=blocks)
    torch.manual_seed(0)
    p = parallelize(GEMModel(cfg, embedding_device=device), case["parallel"],
                    ac_cfg=case.get("activation_checkpoint"), sparse_optimizer_cfg={"name": "sgd", "lr": 0.01}, device=device)
    opt = TrainOptimizer(list(p.dense_named_parameters().items()), p.sparse_optimizer, lr=1e-3, total_steps=2)
    dense = p.dense_parameters()
    per = 4
    batch = slice_batch(dataset(per * world).global_batch(0), rank * per, (rank + 1) * per).to(device)
    gathered = Gathered(p.inner)
    step_cfg = StepConfig(tasks=cfg.tasks, task_weights=None)
    with torch.autograd.graph.saved_tensors_hooks(lambda t: (gathered.sample(), t)[1],
                                                  lambda t: (gathered.sample(), t)[1]):
        loss, _ = forward_loss(p.model, batch, step_cfg, 1)
        loss.backward()
    grads = _storage_bytes(q.grad for q in dense)
    opt.step()
    state = [t for s in opt._adamw.state.values() for k, t in s.items() if k != "step"]
    return {"params": _storage_bytes(dense), "grads": grads, "optimizer": _storage_bytes(state),
            "gathered": gathered.peak, "describe": p.dims.describe()}


def measure_cases(cases: dict, blocks: int) -> dict:
    """{case: [per-rank {params, grads, optimizer, gathered}]} on every rank (collective)."""
    from gem.parallel import init_distributed

    device = init_distributed()
    out = {}
    keys = ("params", "grads", "optimizer", "gathered")
    for name, case in cases.items():
        got = measure(case, device, blocks)
        mine = torch.tensor([got[k] for k in keys], dtype=torch.float64)
        every = [torch.zeros_like(mine) for _ in range(dist.get_world_size())]
        dist.all_gather(every, mine)
        out[name] = [dict(zip(keys, map(int, t.tolist()))) for t in every]
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--cases", required=True, help='JSON {name: {"parallel": {...}, '
                    '"activation_checkpoint": {...}, "num_experts": n}}')
    ap.add_argument("--blocks", type=int, default=2)
    a = ap.parse_args()
    finish(a.out, measure_cases(json.loads(a.cases), a.blocks))


if __name__ == "__main__":
    main()
