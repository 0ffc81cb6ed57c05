"""TorchRec embedding sharding: a planner per sharding group, DMP inside it, replicas synced every k steps.

CUDA with several groups: torchrec's DMPCollection (2D sharding). Elsewhere (CPU/gloo, where DMPCollection
asserts CUDA) the same layout is built from DMP over the sharding-group process subgroup plus an explicit
average of each local shard's weights and fused-optimizer state over the replica group.

`hash: zch` tables (TorchRec's managed-collision collections) are sharded row-wise by TorchRec's
managed-collision sharders, over the whole world: each rank owns a block of the hashed id space and the id -> row
map of its rows (its buffers are in the model's state dict, so checkpoints carry them).
"""

from __future__ import annotations

import inspect
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torchrec import optim as trec_optim
from torchrec.distributed.embedding import EmbeddingCollectionSharder
from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
from torchrec.distributed.mc_embedding import ManagedCollisionEmbeddingCollectionSharder
from torchrec.distributed.mc_embeddingbag import ManagedCollisionEmbeddingBagCollectionSharder
from torchrec.distributed.model_parallel import DataParallelWrapper, DistributedModelParallel
from torchrec.distributed.planner import EmbeddingShardingPlanner, ParameterConstraints, Topology
from torchrec.distributed.sharding_plan import construct_module_sharding_plan, row_wise
from torchrec.distributed.types import ShardingEnv, ShardingPlan
from torchrec.modules.embedding_modules import EmbeddingBagCollection, EmbeddingCollection
from torchrec.modules.mc_embedding_modules import (
    BaseManagedCollisionEmbeddingCollection,
    ManagedCollisionEmbeddingBagCollection,
)
from torchrec.optim import RowWiseAdagrad
from torchrec.optim.apply_optimizer_in_backward import apply_optimizer_in_backward

from gem.model.embeddings import zch_modules
from gem.parallel.dims import ParallelConfigError, ParallelDims

try:  # fbgemm's table-batched kernel: the object holding a group's weights and optimizer state
    from fbgemm_gpu.split_table_batched_embeddings_ops_training import (
        SplitTableBatchedEmbeddingBagsCodegen,
        WeightDecayMode,
    )
except ImportError:  # pragma: no cover
    SplitTableBatchedEmbeddingBagsCodegen = WeightDecayMode = None

# torchrec's wrappers (not torch.optim's classes): their kwargs reach fbgemm's fused kernel as they are, so it can
# take fbgemm's own arguments (weight_decay_mode, beta1, beta2)
SPARSE_OPTIMIZERS = {
    "rowwise_adagrad": RowWiseAdagrad,
    "adagrad": trec_optim.Adagrad,
    "sgd": trec_optim.SGD,
    "adam": trec_optim.Adam,
}
_DECAY_MODES = ("l2", "decoupled")  # torch.optim's weight_decay (added to the gradient), AdamW's (to the weight)
# Tables are always sharded (never data_parallel): the fused sparse optimizer and the replica sync cover the
# sharded kernels only. What fbgemm's CPU kernels can do (STACK.md): bag tables not row-wise through the
# planner (a hand-written row-wise plan works).
_GPU_TYPES = ("table_wise", "row_wise", "column_wise", "table_row_wise", "table_column_wise")
_CPU_BAG_TYPES = ("table_wise", "column_wise")
_CPU_SEQ_TYPES = ("table_wise", "row_wise", "column_wise")
_CUDA_ONLY_OPTIMIZERS = ("adam",)  # fbgemm's CPU kernels: exact (rowwise) adagrad and sgd only


class _NoDataParallel(DataParallelWrapper):
    """Leave the dense part alone: gem.parallel wraps it (DDP over the world or FSDP2) itself."""

    def wrap(self, dmp: DistributedModelParallel, env: ShardingEnv, device: torch.device) -> None:
        return None


def sparse_optimizer_spec(cfg: Any) -> tuple[type, dict]:
    """`{name: rowwise_adagrad|adagrad|sgd|adam, lr, eps, ...}` -> (optimizer class, kwargs)."""
    cfg = dict(_to_mapping(cfg) or {})
    name = cfg.pop("name", cfg.pop("type", "rowwise_adagrad"))
    if name not in SPARSE_OPTIMIZERS:
        raise ParallelConfigError("train.sparse_optimizer.name", f"expected one of {', '.join(SPARSE_OPTIMIZERS)}",
                                  name)
    kwargs = {"lr": float(cfg.pop("lr", 0.01))}
    if name != "sgd":
        kwargs["eps"] = float(cfg.pop("eps", 1e-8))
    momentum = cfg.pop("momentum", 0)
    if momentum:  # fbgemm's fused SGD is plain SGD: it would drop a momentum without a word
        raise ParallelConfigError("train.sparse_optimizer.momentum", "fbgemm's fused sgd has no momentum (use "
                                  "adam or rowwise_adagrad)", momentum)
    mode = cfg.pop("weight_decay_mode", None)
    if mode is not None and mode not in _DECAY_MODES:
        raise ParallelConfigError("train.sparse_optimizer.weight_decay_mode", f"expected one of "
                                  f"{', '.join(_DECAY_MODES)}", mode)
    decay = float(cfg.pop("weight_decay", 0.0))
    if decay < 0:
        raise ParallelConfigError("train.sparse_optimizer.weight_decay", "must be >= 0", decay)
    if decay:  # what fbgemm's fused kernels do with it: rowwise_adagrad either mode, adam AdamW's, the others none
        if name in ("sgd", "adagrad"):
            raise ParallelConfigError("train.sparse_optimizer.weight_decay", f"fbgemm's fused {name} has no weight "
                                      "decay (use rowwise_adagrad or adam)", decay)
        if name == "adam" and mode == "l2":
            raise ParallelConfigError("train.sparse_optimizer.weight_decay_mode", "fbgemm's fused adam decays the "
                                      "weights decoupled (AdamW's); l2 is rowwise_adagrad's", mode)
        kwargs["weight_decay"] = decay
        if name == "rowwise_adagrad":  # fbgemm applies its weight_decay only with a mode
            kwargs["weight_decay_mode"] = WeightDecayMode.DECOUPLE if mode == "decoupled" else WeightDecayMode.L2
    if "betas" in cfg:
        betas = cfg.pop("betas")
        if name != "adam":
            raise ParallelConfigError("train.sparse_optimizer.betas", f"only adam takes betas, not {name}", betas)
        if not isinstance(betas, (list, tuple)) or len(betas) != 2 or not all(0 <= float(b) < 1 for b in betas):
            raise ParallelConfigError("train.sparse_optimizer.betas", "need two values in [0, 1)", betas)
        kwargs["beta1"], kwargs["beta2"] = float(betas[0]), float(betas[1])  # fbgemm's names
    if cfg:
        raise ParallelConfigError(f"train.sparse_optimizer.{next(iter(cfg))}", "unknown key", cfg[next(iter(cfg))])
    return SPARSE_OPTIMIZERS[name], kwargs


def check_sparse_optimizer_device(cfg: Any, device: torch.device) -> None:
    """The fused optimizer `cfg` names must have a kernel on `device` (fbgemm asserts deep inside otherwise)."""
    name = dict(_to_mapping(cfg) or {}).get("name", "rowwise_adagrad")
    if device.type == "cpu" and name in _CUDA_ONLY_OPTIMIZERS:
        raise ParallelConfigError("train.sparse_optimizer.name", "adam needs CUDA (fbgemm's CPU embedding kernels "
                                  "run rowwise_adagrad, adagrad and sgd)", name)


def _to_mapping(cfg: Any) -> Mapping | None:
    if cfg is None or isinstance(cfg, Mapping):
        return cfg
    from omegaconf import OmegaConf

    return OmegaConf.to_container(cfg, resolve=True)


_COLLECTIONS = (EmbeddingCollection, EmbeddingBagCollection, BaseManagedCollisionEmbeddingCollection)


def embedding_modules(model: nn.Module) -> dict[str, nn.Module]:
    """fqn -> EmbeddingCollection / EmbeddingBagCollection / managed-collision collection (unsharded) found in
    `model`; the collection inside a managed-collision one is part of it, not listed."""
    out: dict[str, nn.Module] = {}

    def walk(m: nn.Module, prefix: str) -> None:
        if isinstance(m, _COLLECTIONS):
            out[prefix] = m
            return
        for name, child in m.named_children():
            walk(child, f"{prefix}.{name}" if prefix else name)

    walk(model, "")
    return out


def _configs(m: nn.Module) -> tuple[list, bool]:
    """(table configs, pooled) of a collection."""
    inner = m._embedding_module if isinstance(m, BaseManagedCollisionEmbeddingCollection) else m
    if isinstance(inner, EmbeddingBagCollection):
        return list(inner.embedding_bag_configs()), True
    return list(inner.embedding_configs()), False


def _tables(model: nn.Module) -> dict[str, bool]:
    """table name -> is a bag (pooled) table."""
    out: dict[str, bool] = {}
    for m in embedding_modules(model).values():
        configs, pooled = _configs(m)
        out.update({t.name: pooled for t in configs})
    return out


def zch_tables(model: nn.Module) -> set[str]:
    """Tables behind a managed-collision module (`hash: zch`)."""
    return {t.name for m in embedding_modules(model).values() if isinstance(m, BaseManagedCollisionEmbeddingCollection)
            for t in _configs(m)[0]}


def check_zch_layout(zch: list[str], cfg: Any, world_size: int) -> None:
    """The `parallel:` layout (validated against `world_size`) can hold the `hash: zch` tables `zch`: one sharding
    group (replicas would map an id to different rows) and row-wise sharding (TorchRec's managed-collision
    sharders)."""
    if not zch:
        return
    if cfg.emb_shard_group != world_size:
        raise ParallelConfigError(
            "parallel.emb_shard_group", f"hash: zch tables ({', '.join(zch)}) are sharded over every rank: their "
            f"replicas would map the same id to different rows (set it to the world size {world_size})",
            cfg.emb_shard_group)
    st = _to_mapping(cfg.sharding_types) if not isinstance(cfg.sharding_types, (list, tuple, str)) \
        else cfg.sharding_types
    for name in zch:
        allowed = st.get(name) if isinstance(st, Mapping) else st
        allowed = [allowed] if isinstance(allowed, str) else allowed
        if allowed and "row_wise" not in allowed:
            raise ParallelConfigError("parallel.sharding_types", f"table {name!r} is hash: zch, which TorchRec shards "
                                      "row_wise only", list(allowed))


def zch_resume_problem(module: nn.Module, saved: Mapping[str, Any]) -> str | None:
    """Why the id maps in `saved` (a loaded model state dict) cannot go into `module`'s sharded zch tables (None:
    they can). TorchRec rebuilds a shard's map from saved shards it covers whole, so a table saved in W row-wise
    shards resumes on W ranks or on fewer whose shards join saved ones, not on more."""
    for m in zch_modules(module):
        key = next((k for k in saved if k.endswith(f"_managed_collision_modules.{m.table}._output_segments_tensor")),
                   None)
        if key is None:
            continue
        bounds = sorted(set(saved[key].tolist()) - {-1})
        start, end = m.rows
        if start not in bounds or end not in bounds:
            return (f"the hash: zch table '{m.table}' was saved in {len(bounds) - 1} row-wise shard(s) (row bounds "
                    f"{bounds}); this rank's shard [{start}, {end}) would split one: resume on as many ranks, or on "
                    "fewer whose shards join whole saved ones")
    return None


class _ZchBagSharder(ManagedCollisionEmbeddingBagCollectionSharder):
    """TorchRec's managed-collision bag sharder, row-wise offered on CPU too: like the plain bag sharder, it runs
    row-wise there but does not say so (the intersection with the CPU bag sharder's types is empty)."""

    def sharding_types(self, compute_device_type: str) -> list[str]:
        return ["row_wise"]


def sharders_for(model: nn.Module) -> list:
    """The sharders of the collections in `model` (the managed-collision ones when it has zch tables)."""
    out = [EmbeddingBagCollectionSharder(), EmbeddingCollectionSharder()]
    if zch_tables(model):
        out += [_ZchBagSharder(), ManagedCollisionEmbeddingCollectionSharder()]
    return out


def resolve_sharding_types(model: nn.Module, sharding_types: Any, device: torch.device) -> dict[str, list[str]]:
    """Allowed sharding types per table (config list / per-table mapping, restricted to what the device runs)."""
    st = _to_mapping(sharding_types) if not isinstance(sharding_types, (list, tuple, str)) else sharding_types
    tables = _tables(model)
    zch = zch_tables(model)
    if isinstance(st, Mapping):
        unknown = set(st) - set(tables)
        if unknown:
            raise ParallelConfigError(f"parallel.sharding_types: unknown table {min(unknown)!r}")
    out = {}
    for name, is_bag in tables.items():
        if st is None:
            allowed = None
        elif isinstance(st, Mapping):
            allowed = st.get(name)
        else:
            allowed = st
        if isinstance(allowed, str):
            allowed = [allowed]
        if name in zch:
            ok = ("row_wise",)  # TorchRec's managed-collision sharders: row-wise only
        elif device.type == "cpu":
            ok = _CPU_BAG_TYPES + ("row_wise",) if is_bag else _CPU_SEQ_TYPES
        else:
            ok = _GPU_TYPES if is_bag else tuple(t for t in _GPU_TYPES if t != "table_row_wise")
        allowed = [t for t in (allowed or ok) if t in ok]
        if not allowed:
            raise ParallelConfigError(
                f"parallel.sharding_types: table {name!r} has no type that {device.type} sharding supports "
                f"({', '.join(ok)})"
            )
        out[name] = allowed
    return out


def _plan(model: nn.Module, allowed: dict[str, list[str] | None], group_size: int, local_size: int,
          device: torch.device, sharders: list) -> ShardingPlan:
    """Plan for one sharding group (ranks 0..group_size-1): planned on rank 0 and broadcast to every rank."""
    zch = zch_tables(model)
    hand_row_wise = {n for n, a in allowed.items()
                     if device.type == "cpu" and a and "row_wise" in a and _tables(model)[n]
                     and not any(t in _CPU_BAG_TYPES for t in a) and n not in zch}
    constraints = {}
    for name, a in allowed.items():
        if name in hand_row_wise:
            a = ["table_wise"]  # placeholder, replaced by the hand-written row-wise plan below
        # the managed-collision sharders list UVM kernels that the CPU estimator does not know
        kernels = {"compute_kernels": ["fused"]} if name in zch and device.type == "cpu" else {}
        if a:
            constraints[name] = ParameterConstraints(sharding_types=list(a), **kernels)
    for m in zch_modules(model):
        m.set_buckets(group_size)  # one block of the hashed id space per rank of the group
    topology = Topology(world_size=group_size, local_world_size=min(local_size, group_size),
                        compute_device=device.type)

    def make_plan() -> ShardingPlan:
        plan = EmbeddingShardingPlanner(topology=topology, constraints=constraints).plan(model, sharders)
        # the CPU bag sharder does not offer row-wise to the planner, but runs it from an explicit plan
        for fqn, m in embedding_modules(model).items():
            if not isinstance(m, EmbeddingBagCollection) or isinstance(m, ManagedCollisionEmbeddingBagCollection):
                continue
            names = [t.name for t in m.embedding_bag_configs()]
            if not hand_row_wise.intersection(names):
                continue
            rw = construct_module_sharding_plan(m, {n: row_wise() for n in names},
                                                local_size=min(local_size, group_size), world_size=group_size,
                                                device_type=device.type)
            for n in hand_row_wise.intersection(names):
                plan.plan[fqn][n] = rw[n]
        return plan

    return _plan_on_rank0(make_plan)


def _wait_sharded_outputs(module: nn.Module) -> None:
    """Sharded EC/EBC return a LazyAwaitable; resolve it so the model sees the unsharded modules' output types
    (a dict of JaggedTensor / a KeyedTensor) and its forward works as before."""
    from torchrec.distributed.types import Awaitable, LazyAwaitable, ShardedModule

    def wait(_m, _inputs, out):
        if isinstance(out, tuple):  # a managed-collision collection: (embeddings, remapped ids or None)
            return tuple(o.wait() if isinstance(o, Awaitable) else o for o in out)
        return out.wait() if isinstance(out, LazyAwaitable) else out

    for m in module.modules():
        if isinstance(m, ShardedModule):
            m.register_forward_hook(wait)


def _plan_on_rank0(make_plan):
    """Plan on rank 0 and broadcast: the planner's choice among equal-cost proposals differs between processes,
    and every sharding group must get the same layout. A planner error is raised on every rank (no hang)."""
    result: list[Any] = [None]
    if dist.get_rank() == 0:
        try:
            result[0] = ("ok", make_plan())
        except Exception as e:  # noqa: BLE001 - re-raised on every rank below
            result[0] = ("error", f"{type(e).__name__}: {e}")
    dist.broadcast_object_list(result, src=0)
    status, value = result[0]
    if status == "error":
        raise RuntimeError(f"gem.parallel: embedding sharding planner failed: {value}")
    return value


def _copy_into_shards(module: nn.Module, full: dict[str, torch.Tensor]) -> None:
    """Write the unsharded tables' values into this rank's shards (DMP re-initialises them otherwise)."""
    from torch.distributed._shard.sharded_tensor import ShardedTensor
    from torch.distributed.tensor import DTensor

    sd = module.state_dict()
    with torch.no_grad():
        for key, src in full.items():
            dst = sd.get(key)
            if dst is None:
                raise RuntimeError(f"gem.parallel: sharded model has no state entry {key!r}")
            if isinstance(dst, ShardedTensor):
                for shard in dst.local_shards():
                    sl = tuple(slice(o, o + s) for o, s in zip(shard.metadata.shard_offsets, shard.metadata.shard_sizes))
                    shard.tensor.copy_(src[sl])
            elif isinstance(dst, DTensor):  # 2D sharding: tables as DTensors over the embedding mesh
                local = dst.to_local()
                if hasattr(local, "local_shards"):  # torchrec LocalShardsWrapper: shards with global offsets
                    for t, off in zip(local.local_shards(), local.local_offsets()):
                        t.copy_(src[tuple(slice(o, o + n) for o, n in zip(off, t.shape))])
                else:
                    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

                    shape, off = compute_local_shape_and_global_offset(dst.shape, dst.device_mesh, dst.placements)
                    local.copy_(src[tuple(slice(o, o + n) for o, n in zip(off, shape))])
            else:
                dst.copy_(src)


@dataclass
class ShardedEmbeddings:
    """The DMP (or DMPCollection) wrapping the model, and how to keep the embedding replicas in step."""

    dmp: DistributedModelParallel
    replica_pg: dist.ProcessGroup | None
    n_replicas: int
    uses_collection: bool  # torchrec DMPCollection does the replica sync itself

    @property
    def fused_optimizer(self):
        return self.dmp.fused_optimizer

    def _kernels(self) -> list[nn.Module]:
        """fbgemm TBE kernels of the sharded tables (sharded modules keep their lookups in a plain list)."""
        seen, out = set(), []

        def walk(m: nn.Module) -> None:
            if id(m) in seen:
                return
            seen.add(id(m))
            if isinstance(m, SplitTableBatchedEmbeddingBagsCodegen):
                out.append(m)
            for child in list(m.children()) + list(getattr(m, "_lookups", None) or []):
                walk(child)

        walk(self.dmp)
        return out

    def replica_tensors(self, include_optimizer_state: bool = True) -> list[torch.Tensor]:
        """This rank's shard weights (views) and fused optimizer state tensors, in a rank-independent order."""
        out = []
        for k in self._kernels():
            out.extend(w for w in k.split_embedding_weights() if w.numel() > 0)
            if include_optimizer_state:
                for state in k.get_optimizer_state():
                    out.extend(t for t in state.values() if isinstance(t, torch.Tensor) and t.numel() > 0)
        return out

    @torch.no_grad()
    def sync(self, include_optimizer_state: bool = True) -> None:
        """Average every local shard (weights + optimizer state) over the replica group."""
        if self.n_replicas <= 1:
            return
        if self.uses_collection:
            self.dmp.sync(include_optimizer_state=include_optimizer_state)
            return
        tensors = self.replica_tensors(include_optimizer_state)
        by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
        for t in tensors:
            by_dtype.setdefault(t.dtype, []).append(t)
        for ts in by_dtype.values():
            flat = torch.cat([t.reshape(-1) for t in ts])
            dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=self.replica_pg)  # gloo has no AVG
            flat.div_(self.n_replicas)
            i = 0
            for t in ts:
                t.copy_(flat[i:i + t.numel()].view_as(t))
                i += t.numel()


def shard_embeddings(model: nn.Module, dims: ParallelDims, sparse_optimizer_cfg: Any,
                     device: torch.device) -> ShardedEmbeddings:
    """Fuse the sparse optimizer into the tables' backward, plan per sharding group and wrap in DMP."""
    emb = embedding_modules(model)
    if not emb:
        raise ValueError("gem.parallel: the model has no EmbeddingCollection / EmbeddingBagCollection")
    opt_cls, opt_kwargs = sparse_optimizer_spec(sparse_optimizer_cfg)
    check_sparse_optimizer_device(sparse_optimizer_cfg, device)
    table_params = [p for m in emb.values() for p in m.parameters()]
    # keep the model's own initial values (DMP re-initialises shards); skipped for meta-device tables. Weights
    # only: a managed-collision module's buffers are laid out per shard by its sharder.
    full = {}
    if all(p.device.type != "meta" for p in table_params):
        for fqn, m in emb.items():
            for k, v in m.named_parameters():
                full[f"{fqn}.{k}"] = v.detach().clone()
    apply_optimizer_in_backward(opt_cls, table_params, opt_kwargs)

    sharders = sharders_for(model)
    allowed = resolve_sharding_types(model, dims.cfg.sharding_types, device)
    g = dims.emb_shard_group
    n_rep = dims.emb_replicas
    check_zch_layout(sorted(zch_tables(model)), dims.cfg, dims.world_size)
    plan = _plan(model, allowed, g, dims.local_world_size, device, sharders)
    uses_collection = False
    if n_rep == 1:
        dmp = DistributedModelParallel(model, env=ShardingEnv.from_process_group(dist.group.WORLD), device=device,
                                       plan=plan, sharders=sharders, data_parallel_wrapper=_NoDataParallel())
    elif device.type == "cuda":
        dmp = _dmp_collection(model, dims, plan, sharders, device)
        uses_collection = True
    else:
        _remap_plan(plan, dims.emb_group_ranks(), device)
        dmp = DistributedModelParallel(model, env=_sharding_env_2d(dims), device=device, plan=plan,
                                       sharders=sharders, data_parallel_wrapper=_NoDataParallel())
    if full:
        _copy_into_shards(dmp.module, full)
    if device.type == "cpu":
        _host_eviction_resets(dmp.module)
    _wait_sharded_outputs(dmp.module)
    return ShardedEmbeddings(dmp=dmp, replica_pg=dims.emb_replica_pg, n_replicas=n_rep,
                             uses_collection=uses_collection)


class _HostRowReset:
    """A table-batched kernel on CPU as TorchRec's managed-collision eviction uses it: fbgemm has no CPU kernel for
    `reset_embedding_weight_momentum`, so the evicted rows' optimizer state is reset here, as the CUDA kernel does
    (the row-wise Adagrad sum to 0; TorchRec then re-initialises the rows' weights from the table's init_fn)."""

    def __init__(self, tbe: nn.Module) -> None:
        self._tbe = tbe

    def __getattr__(self, name: str):
        return getattr(self._tbe, name)

    @torch.no_grad()
    def reset_embedding_weight_momentum(self, pruned_indices: torch.Tensor, pruned_indices_offsets: torch.Tensor,
                                        logical_table_ids: torch.Tensor, buffer_ids: torch.Tensor) -> None:
        from fbgemm_gpu.split_embedding_configs import EmbOptimType

        t = int(logical_table_ids[0])
        rows = pruned_indices[int(pruned_indices_offsets[0]):int(pruned_indices_offsets[1])]
        if self._tbe.optimizer == EmbOptimType.EXACT_ROWWISE_ADAGRAD:
            self._tbe.split_optimizer_states()[t][0][rows] = 0
        self._tbe.split_embedding_weights()[t][rows] = 0


def _host_eviction_resets(module: nn.Module) -> None:
    """Give every sharded managed-collision collection the CPU stand-in for its kernels' eviction reset."""
    from torchrec.distributed.mc_embedding_modules import BaseShardedManagedCollisionEmbeddingCollection

    for m in module.modules():
        if isinstance(m, BaseShardedManagedCollisionEmbeddingCollection):
            m._table_to_tbe_and_index = {name: (_HostRowReset(tbe), idx)
                                         for name, (tbe, idx) in m._table_to_tbe_and_index.items()}


def _remap_plan(plan: ShardingPlan, group_ranks: list[int], device: torch.device) -> None:
    """Planner ranks 0..G-1 -> the global ranks of this rank's sharding group (in place)."""
    from torch.distributed._shard.sharding_spec import EnumerableShardingSpec
    from torch.distributed.remote_device import _remote_device

    for module_plan in plan.plan.values():
        for ps in module_plan.values():
            ps.ranks = [group_ranks[r] for r in ps.ranks] if ps.ranks is not None else None
            spec = ps.sharding_spec
            if isinstance(spec, EnumerableShardingSpec) and spec.shards is not None:
                for shard in spec.shards:
                    g = group_ranks[shard.placement.rank()]
                    dev = "cpu" if device.type == "cpu" else f"{device.type}:{shard.placement.device().index}"
                    shard.placement = _remote_device(f"rank:{g}/{dev}")


def _sharding_env_2d(dims: ParallelDims):
    """TorchRec's 2D sharding environment over our embedding mesh (what DMPCollection builds on CUDA)."""
    from torchrec.distributed.types import ShardingEnv2D

    params = inspect.signature(ShardingEnv2D.__init__).parameters
    kwargs: dict[str, Any] = {"sharding_pg": dims.emb_shard_pg, "global_pg": dist.group.WORLD,
                                  "device_mesh": dims.emb_mesh}
    if "replica_pg" in params:
        kwargs["replica_pg"] = dims.emb_replica_pg
    if "node_group_size" in params:
        kwargs["node_group_size"] = min(dims.local_world_size, dims.emb_shard_group)
    host_local = dims.cfg.emb_group_layout == "host_local"
    if "use_inter_host_allreduce" in params:
        kwargs["use_inter_host_allreduce"] = host_local
    elif host_local:
        raise ParallelConfigError(
            "parallel.emb_group_layout=host_local: this torchrec's 2D sharding only lays out strided groups"
        )
    return ShardingEnv2D(**kwargs)


def _dmp_collection(model, dims: ParallelDims, plan, sharders, device):
    """torchrec's 2D DMPCollection; its arguments differ across torchrec releases, so pass what it accepts."""
    from torchrec.distributed.model_parallel import DMPCollection

    params = inspect.signature(DMPCollection.__init__).parameters
    kwargs: dict[str, Any] = {"module": model, "device": device, "plan": plan, "world_size": dims.world_size,
                                  "sharding_group_size": dims.emb_shard_group, "global_pg": dist.group.WORLD,
                                  "sharders": sharders, "data_parallel_wrapper": _NoDataParallel()}
    host_local = dims.cfg.emb_group_layout == "host_local"
    if "use_inter_host_allreduce" in params:
        # DMPCollection's default keeps replicas on one host (sharding groups strided); inter-host allreduce
        # gives consecutive (host-local) sharding groups
        kwargs["use_inter_host_allreduce"] = host_local
    elif host_local and dims.emb_replicas > 1:
        raise ParallelConfigError(
            "parallel.emb_group_layout=host_local: this torchrec's DMPCollection only lays out strided groups"
        )
    if "node_group_size" in params:
        kwargs["node_group_size"] = min(dims.local_world_size, dims.emb_shard_group)
    return DMPCollection(**kwargs)
