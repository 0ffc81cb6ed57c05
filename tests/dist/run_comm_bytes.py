"""A few training steps of the tiny GEM model; every collective of the counted steps is recorded per rank.

Collectives are seen as the dispatcher ops torch.distributed, its functional collectives and torchrec all end
in (c10d::*, _c10d_functional::*), so FSDP2, DTensor, torchrec and our own calls are caught alike. Each call is
filed under (op, mesh dim of its process group) with the bytes of its full buffer (gem.plan.comm's convention).
Rank 0 writes every rank's totals, the history tokens / ids per rank and the embedding plan.
"""

from __future__ import annotations

import argparse
import contextlib
from collections import defaultdict

import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode

from tests.dist._common import dataset, finish, sharded_tiny_model, slice_batch

_OPS = {  # op name -> (kind, which argument holds the full buffer, index of the group argument)
    "c10d._allgather_base_": ("all_gather", 0, 2),
    "c10d._reduce_scatter_base_": ("reduce_scatter", 1, 2),
    "c10d.allreduce_": ("all_reduce", 0, 1),
    "c10d.alltoall_base_": ("all_to_all", 1, 2),
    "_c10d_functional.all_to_all_single": ("all_to_all", 0, 3),
    "_c10d_functional.all_reduce": ("all_reduce", 0, 2),
    "_c10d_functional.reduce_scatter_tensor": ("reduce_scatter", 0, 3),
}


def _nbytes(x) -> int:
    if isinstance(x, torch.Tensor):
        return x.numel() * x.element_size()
    return sum(_nbytes(t) for t in x)


class CountCollectives(TorchDispatchMode):
    def __init__(self, names: dict[str, str]):
        super().__init__()
        self.names = names  # process group name -> mesh dim
        self.bytes: dict[str, float] = defaultdict(float)
        self.calls: dict[str, int] = defaultdict(int)
        self.log: list[tuple[str, int]] = []  # (key, bytes) of every call, for failure messages

    def _group(self, g) -> str:
        if not isinstance(g, str):
            g = dist.ProcessGroup.unbox(g).group_name
        return self.names.get(g, f"other:{g}")

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = f"{func.namespace}.{func._opname}"
        if name in _OPS:
            kind, buf, grp = _OPS[name]
            n = _nbytes(args[buf])
            if name == "_c10d_functional.all_gather_into_tensor":
                n *= args[1]
            key = f"{kind}/{self._group(args[grp])}"
            self.bytes[key] += n
            self.calls[key] += 1
            self.log.append((key, n))
        elif func.namespace in ("c10d", "_c10d_functional") and func._opname not in ("wait_tensor", "barrier",
                                                                                        "_wrap_tensor_autograd"):
            self.calls[f"uncounted/{name}"] += 1
        return func(*args, **kwargs)


def group_names(dims) -> dict[str, str]:
    out = {}
    pairs = [("emb_shard", dims.emb_shard_pg), ("emb_replicate", dims.emb_replica_pg), ("ep", dims.ep_pg),
             ("dp_shard", dims.dense_mesh.get_group("dp_shard")),
             ("dp_replicate", dims.dense_mesh.get_group("dp_replicate"))]
    if dims.expert_mesh is not None:  # HSDP of the expert weights has its own replicate group
        pairs += [("dp_shard_mod_ep", dims.expert_mesh.get_group("dp_shard_mod_ep")),
                  ("dp_replicate", dims.expert_mesh.get_group("dp_replicate"))]
    for dim, pg in pairs:
        if pg is not None and dist.get_world_size(pg) > 1:
            out.setdefault(pg.group_name, dim)
    out.setdefault(dist.group.WORLD.group_name, "world")
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--parallel", required=True)
    ap.add_argument("--param-dtype", default="fp32")
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--global-batch", type=int, default=16)
    a = ap.parse_args()

    from gem.model import multitask_loss

    device, rank, world, p, opt = sharded_tiny_model(a.parallel, param_dtype=a.param_dtype)
    counter = CountCollectives(group_names(p.dims))
    ds = dataset(a.global_batch)
    per = a.global_batch // world
    tokens, ids = 0, defaultdict(int)
    for step in range(a.warmup + a.steps):
        b = slice_batch(ds.global_batch(step), rank * per, (rank + 1) * per).to(device)
        counted = step >= a.warmup
        if counted:
            tokens += int(b.seq_offsets[-1])
            for kjt in (b.sequence, b.sparse):
                for k in kjt.keys():  # noqa: SIM118 - iterating a KJT does not give its keys
                    ids[k] += int(kjt[k].values().numel())
        with counter if counted else contextlib.nullcontext():
            out = p.model(b)
            loss, _ = multitask_loss(out.logits, b.labels)
            (loss + out.aux_loss).backward()
            opt.step()
            opt.zero_grad()
            p.after_step(step + 1)
    mine = {"bytes": dict(counter.bytes), "calls": dict(counter.calls), "log": counter.log, "tokens": tokens, "ids": dict(ids),
            "batch": per}
    every: list = [None] * world
    dist.all_gather_object(every, mine)
    plan = {mod: {t: {"sharding_type": ps.sharding_type,
                      "shards": [[s.placement.rank(), s.shard_sizes[0],
                                  s.shard_sizes[1]] for s in ps.sharding_spec.shards]}
                  for t, ps in mp.items()} for mod, mp in p.model.plan.plan.items()}
    finish(a.out, {"ranks": every, "plan": plan})


if __name__ == "__main__":
    main()
