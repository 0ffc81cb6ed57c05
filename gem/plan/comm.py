"""Per-step communication of one rank, collective by collective, and the time it takes on the cluster's links.

Convention: `bytes` is the size of the full buffer of each call as a rank hands it to torch.distributed (the
all-gather output, the reduce-scatter input, the all-reduce buffer, the all-to-all send buffer), summed over a
step. On the wire a rank moves bytes x (n-1)/n for all-gather / reduce-scatter / all-to-all (the part that is
not its own) and 2 x bytes x (n-1)/n for a ring all-reduce, at the group's per-GPU bandwidth.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch

from gem.model.config import ModelConfig
from gem.parallel.dims import ParallelConfig, ParallelDims
from gem.plan.memory import FsdpUnit
from gem.plan.topology import ClusterSpec

ALL_GATHER, REDUCE_SCATTER, ALL_REDUCE, ALL_TO_ALL = "all_gather", "reduce_scatter", "all_reduce", "all_to_all"
ID_BYTES = 8  # int64 ids
KJT_SPLITS = 3  # int64 split sizes every rank sends every other before a KJT all-to-all
# state elements per table row kept by the fused sparse optimizers (besides the weights)
_STATE_PER_ROW = {"rowwise_adagrad": lambda d: 1, "adagrad": lambda d: d, "adam": lambda d: 2 * d, "sgd": lambda d: 0}


@dataclass
class Collective:
    name: str  # what it carries, e.g. "FSDP all-gather (dense)"
    op: str  # ALL_GATHER | REDUCE_SCATTER | ALL_REDUCE | ALL_TO_ALL
    group: str  # mesh dim / group name
    ranks: tuple[int, ...]  # rank 0's group (bandwidth: inside a host or across hosts)
    bytes: float  # per rank per step (see the module docstring)

    @property
    def size(self) -> int:
        return len(self.ranks)

    def wire_bytes(self) -> float:
        n = self.size
        if n <= 1:
            return 0.0
        f = (n - 1) / n
        return self.bytes * (2 * f if self.op == ALL_REDUCE else f)

    def seconds(self, cluster: ClusterSpec) -> float:
        return self.wire_bytes() / cluster.bandwidth(self.ranks)


def layout_groups(par: ParallelConfig, world: int, local_world: int) -> dict[str, tuple[int, ...]]:
    """One group of every mesh dim of a validated layout (the meshes gem.parallel.dims builds): rank 0's, unless
    another group of that dim spans hosts where rank 0's does not (the slowest group sets the pace)."""
    dims = ParallelDims(cfg=par, world_size=world, rank=0, local_world_size=local_world, device=None)
    r, s, ep = par.dp_replicate, par.dp_shard, par.ep
    ranks = torch.arange(world)
    dense = ranks.view(r, s)
    expert = ranks.view(r, s // ep, ep)
    emb = dims.emb_layout()
    all_groups = {
        "world": ranks.view(1, world),
        "dp_shard": dense,
        "dp_replicate": dense.t(),
        "ep": expert.reshape(-1, ep),
        "dp_shard_mod_ep": expert.transpose(1, 2).reshape(-1, s // ep),
        "emb_shard": emb,
        "emb_replicate": emb.t(),
    }

    def pick(rows: torch.Tensor) -> tuple[int, ...]:
        groups = [tuple(row.tolist()) for row in rows]
        return next((g for g in groups if len({x // local_world for x in g}) > 1), groups[0])

    return {name: pick(rows) for name, rows in all_groups.items()}


def dense_collectives(units: Sequence[FsdpUnit], par: ParallelConfig, groups: Mapping[str, tuple[int, ...]],
                      param_bytes: int, reduce_bytes: int) -> list[Collective]:
    """FSDP2 all-gather (forward, and again in backward for resharded units; fp8_block weights in FP8 where
    gem.parallel.fsdp gathers them so) and reduce-scatter of every unit, HSDP's all-reduce of the shards over
    dp_replicate; DDP's gradient all-reduce over the world."""
    if par.dense != "fsdp":
        n = sum(u.numel() for u in units)
        return [Collective("DDP gradient all-reduce", ALL_REDUCE, "world", groups["world"], 4.0 * n)]
    out: dict[tuple[str, str], Collective] = {}

    def add(name: str, op: str, group: str, b: float) -> None:
        ranks = groups[group]
        if len(ranks) <= 1 or b == 0:
            return
        c = out.setdefault((name, group), Collective(name, op, group, ranks, 0.0))
        c.bytes += b

    for u in units:
        if u.expert:
            s, group, tag = par.dp_shard // par.ep, "dp_shard_mod_ep", "experts"
            ep, rep = par.ep, par.dp_replicate
        else:
            s, group, tag, ep, rep = par.dp_shard, "dp_shard", "dense", 1, 1
        shard = u.shard_numel(s, ep, rep)
        gathers = 2 if (u.reshard and par.reshard_after_forward) else 1
        add(f"FSDP all-gather ({tag})", ALL_GATHER, group, gathers * u.gather_bytes(s, param_bytes, ep, rep))
        add(f"FSDP reduce-scatter ({tag})", REDUCE_SCATTER, group, s * shard * reduce_bytes)
        add(f"HSDP replica all-reduce ({tag})", ALL_REDUCE, "dp_replicate", shard * reduce_bytes)
    return list(out.values())


def expert_collectives(cfg: ModelConfig, par: ParallelConfig, groups: Mapping[str, tuple[int, ...]],
                       tokens: int, act_bytes: int) -> list[Collective]:
    """Per MoE layer: the token all-to-all (dispatch and combine, forward and backward: 4 x tokens x top_k rows
    of d_model), the per-expert count exchange (E int64) and the router-gradient all-reduce over ep (fp32)."""
    if par.ep <= 1:
        return []
    layers = sum(cfg.is_moe_block(i) for i in range(cfg.tower.num_blocks))
    e, d, k = cfg.moe.num_experts, cfg.d_model, cfg.moe.top_k
    ranks = groups["ep"]
    return [
        Collective("expert all-to-all (tokens)", ALL_TO_ALL, "ep", ranks, layers * 4.0 * tokens * k * d * act_bytes),
        Collective("expert all-to-all (counts)", ALL_TO_ALL, "ep", ranks, layers * 8.0 * e),
        Collective("router gradient all-reduce", ALL_REDUCE, "ep", ranks, layers * 4.0 * e * d),
    ]


@dataclass
class TableShards:
    """One table's placement inside an embedding sharding group (from a torchrec ParameterSharding)."""

    name: str
    kind: str  # sequence | bag
    rows: int
    dim: int
    features: list[str]
    sharding_type: str
    shards: list[tuple[int, int, int]]  # (rank in the group, rows, cols) per shard

    @property
    def copies(self) -> int:
        """How many ranks receive each id: every column shard needs all ids; row shards split them."""
        if self.sharding_type in ("column_wise", "table_column_wise"):
            return len(self.shards)
        return 1


def table_shards(plan, model_cfg: ModelConfig) -> list[TableShards]:
    """TableShards of every table from a torchrec ShardingPlan (module fqn -> table -> ParameterSharding)."""
    by_name = {t.name: t for t in model_cfg.tables}
    out = []
    for module_plan in plan.plan.values():
        for name, ps in module_plan.items():
            t = by_name[name]
            shards = [(s.placement.rank(), s.shard_sizes[0], s.shard_sizes[1])
                      for s in ps.sharding_spec.shards] if ps.sharding_spec is not None else []
            out.append(TableShards(name, t.kind, t.num_embeddings, t.embedding_dim, list(t.features),
                                   ps.sharding_type, shards))
    return out


def embedding_collectives(tables: Sequence[TableShards], groups: Mapping[str, tuple[int, ...]], batch: int,
                          ids_per_example: Mapping[str, float], emb_bytes: int = 4, length_bytes: int = 8
                          ) -> list[Collective]:
    """Embedding all-to-alls over the sharding group of g ranks, per rank and step (batch = examples per rank).

    Input dist: every feature's ids (int64) go to the ranks holding its shards (once per column shard; split by
    row range otherwise), with one length per example for every receiving rank (all g ranks for row-wise);
    each (module, sharding type) first exchanges its split sizes (KJT_SPLITS int64 per rank).
    Output: sequence tables return one embedding per id, pooled tables one per example, forward and again as the
    gradient in backward; row-wise pooled tables reduce-scatter the group's partial sums (g x batch rows) and
    all-gather the gradients of those rows in backward.
    """
    ranks = groups["emb_shard"]
    g = len(ranks)
    ids = lengths = seq = pooled = rs = 0.0
    lengths += len({(t.kind, t.sharding_type) for t in tables}) * g * KJT_SPLITS * 8
    for t in tables:
        for f in t.features:
            n = batch * ids_per_example[f]
            ids += t.copies * n * ID_BYTES
            receivers = g if t.sharding_type in ("row_wise", "table_row_wise") else t.copies
            lengths += receivers * batch * length_bytes
            if t.kind == "sequence":
                seq += 2 * n * t.dim * emb_bytes
            elif t.sharding_type in ("row_wise", "table_row_wise"):
                rs += g * batch * t.dim * emb_bytes
            else:
                pooled += 2 * batch * t.dim * emb_bytes
    out = [Collective("embedding input dist (ids)", ALL_TO_ALL, "emb_shard", ranks, ids),
           Collective("embedding input dist (lengths, splits)", ALL_TO_ALL, "emb_shard", ranks, lengths),
           Collective("sequence embedding all-to-all (fwd+bwd)", ALL_TO_ALL, "emb_shard", ranks, seq),
           Collective("pooled embedding all-to-all (fwd+bwd)", ALL_TO_ALL, "emb_shard", ranks, pooled),
           Collective("pooled embedding reduce-scatter (fwd)", REDUCE_SCATTER, "emb_shard", ranks, rs),
           Collective("pooled embedding all-gather (bwd)", ALL_GATHER, "emb_shard", ranks, rs)]
    return [c for c in out if c.bytes > 0 and g > 1]


def local_table_elements(tables: Sequence[TableShards], sparse_optimizer: str) -> dict[int, int]:
    """Elements (weights + fused optimizer state) each rank of a sharding group holds."""
    per_rank: dict[int, int] = {}
    for t in tables:
        for rank, rows, cols in t.shards:
            per_rank[rank] = per_rank.get(rank, 0) + rows * cols + rows * _STATE_PER_ROW[sparse_optimizer](cols)
    return per_rank


def replica_sync_collectives(tables: Sequence[TableShards], groups: Mapping[str, tuple[int, ...]],
                             sparse_optimizer: str, sync_every: int) -> list[Collective]:
    """The 2D embedding layout's all-reduce of every local shard (weights + optimizer state, fp32) over the
    replica group, every `sync_every` steps (per step: divided by it); the largest rank's share."""
    ranks = groups["emb_replicate"]
    if len(ranks) <= 1:
        return []
    elems = max(local_table_elements(tables, sparse_optimizer).values(), default=0)
    return [Collective("embedding replica sync all-reduce", ALL_REDUCE, "emb_replicate", ranks,
                       4.0 * elems / sync_every)]


def expected_ids_per_example(schema, mean_lengths: Mapping[str, float], mean_candidates: float = 1.0
                             ) -> dict[str, float]:
    """Mean ids per example (request) of every feature of a gem.data.Schema: its history's mean length
    (`mean_lengths`: history -> mean) for sequence features, the mean candidates per request for candidate
    features, (min_hot+max_hot)/2 for sparse ones."""
    out = {}
    for f in schema.features:
        if f.kind == "sequence":
            out[f.name] = float(mean_lengths[f.history])
        elif f.kind == "candidate":
            out[f.name] = float(mean_candidates)
        elif f.kind == "sparse":
            out[f.name] = (f.min_hot + f.max_hot) / 2
    return out


def total_seconds(colls: Sequence[Collective], cluster: ClusterSpec) -> float:
    return math.fsum(c.seconds(cluster) for c in colls)
