"""One layout on one cluster: memory per rank, communication per step and an estimated step time."""

from __future__ import annotations

import dataclasses
import functools
import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from gem.parallel.dims import ParallelConfig
from gem.plan import comm
from gem.plan.memory import DenseMemory, dense_memory, fsdp_units
from gem.plan.sharding import EmbeddingPlan, plan_embeddings
from gem.plan.straggler import Straggler
from gem.plan.topology import ClusterSpec, PlanError

_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}
SEARCH_SYNC_EVERY = (1, 2, 4, 8, 16)
# The measured step that compute estimates scale from; the training benchmark writes it (--write-reference).
REFERENCE_FILE = Path(__file__).with_name("reference.json")


@functools.cache
def reference_step(path: Path = REFERENCE_FILE) -> dict[str, Any]:
    """The shipped reference: {"experiment": name, "step_ms": ms of one step on one GPU, ...how it was measured}."""
    try:
        body = json.loads(Path(path).read_text())
        ok = isinstance(body["experiment"], str) and float(body["step_ms"]) > 0
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise PlanError(f"{path}: not a reference step file ({type(e).__name__}: {e})") from None
    if not ok:
        raise PlanError(f"{path}: step_ms must be > 0 and experiment a name")
    return body


@dataclass
class PlanOptions:
    """`plan.*` keys of `gem plan`."""

    # measured step of the reference experiment on one GPU (gem/plan/reference.json, docs/PERF.md); other configs
    # are scaled by their training FLOPs per rank
    ref_step_ms: float = field(default_factory=lambda: float(reference_step()["step_ms"]))
    ref_experiment: str = field(default_factory=lambda: reference_step()["experiment"])
    top: int = 5  # --search: layouts printed
    sync_every: tuple[int, ...] = SEARCH_SYNC_EVERY  # --search: emb_sync_every choices
    emb_groups: tuple[int, ...] | None = None  # --search: emb_shard_group choices (default: powers of 2 >= a host)
    seed: int = 0  # history lengths sampled for the estimate
    straggler_batches: int = 64  # global batches drawn to estimate the straggler factor

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> PlanOptions:
        fields = {f.name for f in dataclasses.fields(cls)}
        out: dict[str, Any] = {}
        for k, v in d.items():
            if k not in fields:
                raise PlanError(f"plan.{k}: unknown key (expected one of {', '.join(sorted(fields))})")
            try:
                if k in ("sync_every", "emb_groups"):
                    v = tuple(int(x) for x in (v if isinstance(v, (list, tuple)) else [v]))
                    if not v or min(v) < 1:
                        raise ValueError
                elif k in ("top", "seed", "straggler_batches"):
                    v = int(v)
                    if k in ("top", "straggler_batches") and v < 1:
                        raise ValueError
                elif k == "ref_step_ms":
                    v = float(v)
                    if v <= 0:
                        raise ValueError
                else:
                    v = str(v)
            except (TypeError, ValueError):
                raise PlanError(f"plan.{k}: bad value (got {v!r})") from None
            out[k] = v
        return cls(**out)


@dataclass
class Workload:
    """What one rank processes per step, from the data config (history lengths and candidates per request sampled
    like the synthetic data). `tokens`: what the towers run, by `model.candidates`: rows, a copy of each history per
    candidate; interaction, each history once; targets, each history once and one token per candidate.

    `straggler`: E[max] / E[mean] of the ranks' step FLOPs over `world` ranks, without and with data.balance=cost;
    `balance`: the config's choice, whose factor scales the compute time.
    """

    batch: int
    tokens: int
    flops: int
    ids_per_example: dict[str, float]
    history_tokens: dict[str, int] = field(default_factory=dict)  # tower tokens per history (they sum to `tokens`)
    candidates: int = 0  # candidates scored per step (= batch in the row form)
    straggler: Straggler = field(default_factory=lambda: Straggler(1.0, 1.0))
    balance: str = "cost"

    @property
    def straggler_factor(self) -> float:
        return self.straggler.factor(self.balance)


def workload(cfgs, seed: int = 0, world: int = 1, straggler_batches: int = 64) -> Workload:
    from gem.data.batch import lengths_to_offsets
    from gem.data.synthetic import sample_candidate_counts, sample_lengths
    from gem.model.flops import train_flops
    from gem.plan.straggler import simulate

    b = cfgs.data.batch_size
    gen = torch.Generator().manual_seed(seed)
    offsets, means = [], {}
    for h in cfgs.data.schema.histories:
        lengths = sample_lengths(h, b, gen)
        offsets.append(lengths_to_offsets(lengths))
        means[h.name] = int(offsets[-1][-1]) / b
    k = cfgs.data.max_candidates
    counts = sample_candidate_counts(k, b, gen) if k > 1 else torch.ones(b, dtype=torch.int64)
    form = cfgs.model.candidates
    copies = counts if form == "rows" else torch.ones_like(counts)
    per_history = {h.name: int(((o[1:] - o[:-1]) * copies).sum()) for h, o in zip(cfgs.data.schema.histories, offsets)}
    if form == "targets":  # the candidates' tokens join the one tower (the first history's)
        first = cfgs.data.schema.histories[0].name
        per_history[first] += int(counts.sum())
    ids = comm.expected_ids_per_example(cfgs.data.schema, means, float(counts.float().mean()))
    flops = train_flops(cfgs.model, offsets, lengths_to_offsets(counts) if k > 1 else None)
    straggler = simulate(cfgs.model, cfgs.data.schema, b, world, straggler_batches, seed, k)
    return Workload(batch=b, tokens=sum(per_history.values()), flops=flops, ids_per_example=ids,
                    history_tokens=per_history, candidates=int(counts.sum()), straggler=straggler,
                    balance=cfgs.data.balance)


def activation_bytes(cfgs, cluster: ClusterSpec) -> int:
    a = cfgs.train.autocast
    fsdp_bf16 = cfgs.train.param_dtype != "fp32" and cfgs.parallel.dense != "ddp"  # DDP keeps fp32 parameters
    bf16 = a == "bf16" or (a == "auto" and cluster.compute_device == "cuda") or fsdp_bf16
    return 2 if bf16 else 4


LAYOUT_KEYS = ("dense", "dp_replicate", "dp_shard", "ep", "emb_shard_group", "emb_sync_every", "emb_group_layout")


@dataclass
class Estimate:
    par: ParallelConfig
    cluster: ClusterSpec
    work: Workload
    dense: DenseMemory
    emb: EmbeddingPlan
    collectives: list[comm.Collective]
    compute_ms: float
    hbm: dict[int, int] = field(default_factory=dict)  # global rank (of group 0) -> bytes used
    ddr: dict[int, int] = field(default_factory=dict)

    @property
    def comm_ms(self) -> float:
        return 1e3 * comm.total_seconds(self.collectives, self.cluster)

    @property
    def step_ms(self) -> float:
        """Compute plus every collective, none overlapped: an upper bound of the step time."""
        return self.compute_ms + self.comm_ms

    @property
    def overlapped_ms(self) -> float:
        """Every collective hidden behind compute: a lower bound."""
        return max(self.compute_ms, self.comm_ms)

    def overflow(self) -> str | None:
        """None if every rank fits, else one line naming the first rank that does not and the bytes."""
        c, dense = self.cluster, self.dense.total
        worst = max(self.hbm, key=self.hbm.get)
        if self.hbm[worst] > c.hbm_bytes:
            return (f"rank {worst} needs {self.hbm[worst]} bytes of HBM (dense {dense} + tables "
                    f"{self.hbm[worst] - dense}); it has {c.hbm_bytes}")
        worst = max(self.ddr, key=self.ddr.get)
        if self.ddr[worst] > c.ddr_bytes_per_rank:
            return f"rank {worst} needs {self.ddr[worst]} bytes of host memory for tables; it has {c.ddr_bytes_per_rank}"
        return None

    def overrides(self) -> str:
        """The layout as training overrides (the keys of LAYOUT_KEYS)."""
        p = self.par
        return (f"parallel.dense={p.dense} parallel.dp_replicate={p.dp_replicate} parallel.dp_shard={p.dp_shard} "
                f"parallel.ep={p.ep} parallel.emb_shard_group={p.emb_shard_group} "
                f"parallel.emb_sync_every={p.emb_sync_every} parallel.emb_group_layout={p.emb_group_layout}")


def reserve_for(dense_bytes: int, cluster: ClusterSpec) -> int:
    """HBM kept out of the planner's reach for the dense part: rounded up to 1% of HBM, so layouts with nearly the
    same dense footprint share one embedding plan in --search."""
    step = cluster.hbm_bytes / 100
    return min(int(math.ceil(dense_bytes / step) * step), cluster.hbm_bytes)


def ref_rate(ref_cfgs, ref_step_ms: float, seed: int = 0) -> float:
    """Achieved FLOP/ms of the measured reference step."""
    return workload(ref_cfgs, seed).flops / ref_step_ms


def estimate(cfgs, par: ParallelConfig, cluster: ClusterSpec, flops_per_ms: float, *, seed: int = 0,
             emb: EmbeddingPlan | None = None, units=None, work: Workload | None = None, check: bool = True
             ) -> Estimate:
    """Memory, communication and step time of the validated layout `par` (compute: the mean rank's FLOPs at the
    reference rate, times the straggler factor); raises PlanError (one line) if a rank runs out of HBM
    (`check=False`: the estimate all the same; `overflow()` says what does not fit)."""
    from gem.parallel.embedding import check_zch_layout

    check_zch_layout([t.name for t in cfgs.model.tables if t.zch is not None], par, cluster.world)
    work = work or workload(cfgs, seed, cluster.world)
    units = units if units is not None else fsdp_units(cfgs.model, par.ep, cfgs.train.precision,
                                                       cfgs.train.precision_filter)
    act = activation_bytes(cfgs, cluster)
    dense = dense_memory(units, cfgs.model, par, work.history_tokens or work.tokens, act, cfgs.activation_checkpoint,
                         cfgs.train.param_dtype)
    if check and dense.total > cluster.hbm_bytes:
        raise PlanError(f"rank 0 needs {dense.total} bytes of HBM for the dense part alone (params {dense.params}, "
                        f"grads {dense.grads}, optimizer {dense.optimizer}, gathered {dense.gathered}, activations "
                        f"{dense.activations}); it has {cluster.hbm_bytes}")
    g = par.emb_shard_group
    if emb is None:
        emb = plan_embeddings(cfgs.model, cluster, g, work.batch, par.sharding_types,
                              reserve_bytes=reserve_for(dense.total, cluster))
    groups = comm.layout_groups(par, cluster.world, cluster.gpus_per_host)
    out = Estimate(par=par, cluster=cluster, work=work, dense=dense, emb=emb, collectives=[],
                   compute_ms=work.flops / flops_per_ms * work.straggler_factor)
    for pos, rank in enumerate(groups["emb_shard"]):
        out.hbm[rank] = dense.total + emb.hbm.get(pos, 0)
        out.ddr[rank] = emb.ddr.get(pos, 0)
    problem = out.overflow()
    if check and problem:
        raise PlanError(problem)
    tables = comm.table_shards(emb.plan, cfgs.model)
    tc = cfgs.train
    opt = dict(tc.sparse_optimizer).get("name", "rowwise_adagrad")
    out.collectives = [
        *comm.embedding_collectives(tables, groups, work.batch, work.ids_per_example),
        *comm.expert_collectives(cfgs.model, par, groups, work.tokens, act),
        *comm.dense_collectives(units, par, groups, _BYTES[tc.param_dtype], _BYTES[tc.reduce_dtype]),
        *comm.replica_sync_collectives(tables, groups, opt, par.emb_sync_every),
    ]
    return out
