"""TorchRec's planner on a Topology of the target cluster, no process group: the tables' placement inside one
embedding sharding group and the HBM / DDR every rank of the group gives them."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

import torch

from gem.model.config import ModelConfig
from gem.plan.topology import ClusterSpec, PlanError


@dataclass
class EmbeddingPlan:
    plan: Any  # torchrec ShardingPlan for ranks 0..group-1 (the same on every group)
    hbm: dict[int, int] = field(default_factory=dict)  # rank in the group -> bytes
    ddr: dict[int, int] = field(default_factory=dict)
    kernels: dict[str, str] = field(default_factory=dict)  # table -> compute kernel
    group: int = 1
    zch: dict[int, int] = field(default_factory=dict)  # rank in the group -> bytes of hash: zch id maps (in hbm)


def zch_bytes_per_row(policy: str) -> int:
    """Persistent managed-collision state per table row: the sorted raw id and its row (int64 each) and the
    eviction policy's int64 counters (distance_lfu: count and last step; lfu: count; lru: last step)."""
    return 8 * (2 + (2 if policy == "distance_lfu" else 1))


def _capture_stats():
    from torchrec.distributed.planner.types import Stats

    class Capture(Stats):
        def __init__(self) -> None:
            self.best_plan: list = []

        def log(self, *args: Any, **kwargs: Any) -> None:
            self.best_plan = kwargs.get("best_plan", args[7] if len(args) > 7 else []) or []

    return Capture()


def plan_embeddings(model_cfg: ModelConfig, cluster: ClusterSpec, group: int, batch_size: int,
                    sharding_types: Any = None, reserve_bytes: int = 0) -> EmbeddingPlan:
    """Plan the tables over one sharding group of `group` ranks of `cluster` (`reserve_bytes` of every GPU's HBM
    are kept for the dense part). Raises PlanError (one line) when they cannot fit."""
    from torchrec.distributed.planner import EmbeddingShardingPlanner, ParameterConstraints, Topology
    from torchrec.distributed.planner.storage_reservations import FixedPercentageStorageReservation

    from gem.model.embeddings import build_embeddings, zch_modules
    from gem.parallel.embedding import resolve_sharding_types, sharders_for

    # the fqns GEMModel gives its tables
    module = torch.nn.ModuleDict(build_embeddings(model_cfg, "meta").named())
    for m in zch_modules(module):
        m.set_buckets(group)
    allowed = resolve_sharding_types(module, sharding_types, torch.device(cluster.compute_device))
    constraints = {n: ParameterConstraints(sharding_types=list(a)) for n, a in allowed.items()}
    quiet = logging.getLogger("torchrec")  # its advice and the dry-run warnings are meant for live jobs
    level = quiet.level
    quiet.setLevel(logging.ERROR)
    local = min(cluster.gpus_per_host, group)
    topology = Topology(world_size=group, local_world_size=local, compute_device=cluster.compute_device,
                        hbm_cap=cluster.hbm_bytes, ddr_cap=cluster.ddr_bytes_per_rank,
                        intra_host_bw=cluster.intra_gbps * 1e9, inter_host_bw=cluster.inter_gbps * 1e9)
    frac = min(max(reserve_bytes / cluster.hbm_bytes, 0.0), 1.0)
    stats = _capture_stats()
    planner = EmbeddingShardingPlanner(topology=topology, batch_size=batch_size, constraints=constraints,
                                       storage_reservation=FixedPercentageStorageReservation(frac), stats=[stats])
    try:
        plan = planner.plan(module, sharders_for(module))
    except Exception as e:  # noqa: BLE001 - torchrec's PlannerError and its kin: reported in one line below
        need = sum(t.num_embeddings * t.embedding_dim * 4 for t in model_cfg.tables)
        have = group * (cluster.hbm_bytes - reserve_bytes + cluster.ddr_bytes_per_rank)
        raise PlanError(f"embedding tables do not fit: torchrec's planner found no placement on rank 0's sharding "
                        f"group (ranks 0-{group - 1}) for {need} bytes of table weights; it has {have} bytes of HBM + "
                        f"DDR left after {reserve_bytes} bytes of dense state per rank ({type(e).__name__})") from None
    finally:
        quiet.setLevel(level)
    out = EmbeddingPlan(plan=plan, group=group)
    for r in range(group):
        out.hbm[r], out.ddr[r], out.zch[r] = 0, 0, 0
    zch = {t.name: zch_bytes_per_row(t.zch.eviction_policy) for t in model_cfg.tables if t.zch is not None}
    for so in stats.best_plan:
        out.kernels[so.name] = str(so.compute_kernel)
        for shard in so.shards:
            if shard.rank is None or shard.storage is None:
                continue
            out.hbm[shard.rank] += int(shard.storage.hbm)
            out.ddr[shard.rank] += int(shard.storage.ddr)
            if so.name in zch:  # the id maps live beside the rows on the rank's device
                out.zch[shard.rank] += int(shard.size[0]) * zch[so.name]
                out.hbm[shard.rank] += int(shard.size[0]) * zch[so.name]
    return out
