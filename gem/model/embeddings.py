"""TorchRec embedding modules built from the model's table configs.

Tables of sequence and candidate features -> one `EmbeddingCollection` (unpooled: one row per history token, one
per candidate); tables only sparse features use -> one `EmbeddingBagCollection` (sum / mean pooled per example;
None when there are none). Tables carry their own `init_fn`, because TorchRec's
DistributedModelParallel re-initialises sharded tables from the table config instead of copying weights.

`hash: zch` tables (raw ids, zero-collision hashing) go into TorchRec's `ManagedCollisionEmbeddingCollection` /
`ManagedCollisionEmbeddingBagCollection` instead, one `MCHManagedCollisionModule` per table in front of its lookup
(torchrec's collections need a managed-collision module for every table they hold, so the zch tables of each kind
form a collection of their own). All collections read the same batch KJTs, each taking its own features.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import torch
from torch import nn
from torchrec import EmbeddingBagCollection, EmbeddingCollection
from torchrec.modules.embedding_configs import EmbeddingBagConfig, EmbeddingConfig, PoolingType
from torchrec.modules.mc_embedding_modules import (
    ManagedCollisionEmbeddingBagCollection,
    ManagedCollisionEmbeddingCollection,
)
from torchrec.modules.mc_modules import (
    DistanceLFU_EvictionPolicy,
    LFU_EvictionPolicy,
    LRU_EvictionPolicy,
    ManagedCollisionCollection,
    MCHManagedCollisionModule,
)
from torchrec.sparse.jagged_tensor import JaggedTensor

from gem.data.schema import EmbeddingTable, ZchSpec
from gem.model.config import ModelConfig

_POOLING = {"sum": PoolingType.SUM, "mean": PoolingType.MEAN}


def _init_kwargs(t: EmbeddingTable) -> dict:
    if t.init_range is None:
        return {}
    r = float(t.init_range)
    # A partial of a torch function pickles, so plans / DMP can carry it across processes.
    init_fn = functools.partial(torch.nn.init.uniform_, a=-r, b=r)
    return {"weight_init_min": -r, "weight_init_max": r, "init_fn": init_fn}


def _sequence_config(t: EmbeddingTable) -> EmbeddingConfig:
    return EmbeddingConfig(name=t.name, num_embeddings=t.num_embeddings, embedding_dim=t.embedding_dim,
                           feature_names=list(t.features), **_init_kwargs(t))


def _bag_config(t: EmbeddingTable) -> EmbeddingBagConfig:
    return EmbeddingBagConfig(name=t.name, num_embeddings=t.num_embeddings, embedding_dim=t.embedding_dim,
                              feature_names=list(t.features), pooling=_POOLING[t.pooling], **_init_kwargs(t))


def sequence_table_configs(cfg: ModelConfig) -> list[EmbeddingConfig]:
    return [_sequence_config(t) for t in cfg.sequence_tables]


def bag_table_configs(cfg: ModelConfig) -> list[EmbeddingBagConfig]:
    return [_bag_config(t) for t in cfg.bag_tables]


# SplitMix64's finaliser (a bijection of 64-bit words) in int64 arithmetic, which wraps on overflow; `>>` is
# arithmetic on int64, so each shift is masked to the bits a logical shift keeps.
_MIX1 = 0xBF58476D1CE4E5B9 - 2**64
_MIX2 = 0x94D049BB133111EB - 2**64


def zch_input_hash(ids: torch.Tensor, size: int) -> torch.Tensor:
    """Raw int64 ids -> [0, size), spread uniformly whatever the ids' own distribution (sequential, clustered,
    negative): TorchRec's row-wise sharding sends each id to the rank owning its block of [0, size), so the blocks
    must be evenly used. Distinct ids meet with probability ~ 1 / size per pair."""
    x = ids.to(torch.int64)
    x = x ^ ((x >> 30) & ((1 << 34) - 1))
    x = x * _MIX1
    x = x ^ ((x >> 27) & ((1 << 37) - 1))
    x = x * _MIX2
    x = x ^ ((x >> 31) & ((1 << 33) - 1))
    return torch.remainder(x, size)


_POLICIES = {
    "distance_lfu": DistanceLFU_EvictionPolicy,
    "lfu": LFU_EvictionPolicy,
    "lru": LRU_EvictionPolicy,
}


class ZchModule(MCHManagedCollisionModule):
    """TorchRec's zero-collision module whose id history grows to the batch instead of keeping the size it took
    from the first batch: TorchRec's drops the ids past that size, which then never enter the table (jagged
    histories vary in ids per step, and a shard may see none on its first step). The row-wise sharder rebuilds
    this class per shard (`rebuild_with_output_id_range` calls `type(self)`)."""

    def profile(self, features: dict[str, JaggedTensor]) -> dict[str, JaggedTensor]:
        if self.training and self._input_history_buffer_size >= 0:
            need = self._current_history_buffer_offset + sum(int(f.values().numel()) for f in features.values())
            if need > self._input_history_buffer_size:
                self._grow_history(max(need, 2 * self._input_history_buffer_size))
        return super().profile(features)

    def _grow_history(self, size: int) -> None:
        used = self._current_history_buffer_offset
        acc = torch.empty(size, dtype=torch.int64, device=self.device)
        acc[:used] = self._history_accumulator[:used]
        self._history_accumulator = acc
        for name, buf in list(self._history_metadata.items()):
            grown = torch.zeros(size, dtype=buf.dtype, device=buf.device)
            grown[:used] = buf[:used]
            self.register_buffer(f"_history_{name}", grown, persistent=False)
            self._history_metadata[name] = grown
        self._input_history_buffer_size = size

    @property
    def table(self) -> str:
        return self._name

    @property
    def rows(self) -> tuple[int, int]:
        """The table rows [start, end) this module maps ids to (its shard's, once sharded row-wise)."""
        return self._output_global_offset, self._output_global_offset + self._zch_size

    def set_buckets(self, n: int) -> None:
        """Input-space buckets: the row-wise shards this table gets (TorchRec's planner refuses a table whose
        bucket count its world size does not divide)."""
        self._buckets = n


def zch_module(t: EmbeddingTable, device: torch.device) -> ZchModule:
    z: ZchSpec = t.zch
    return ZchModule(zch_size=t.num_embeddings, device=device, eviction_policy=_POLICIES[z.eviction_policy](),
                     eviction_interval=z.eviction_interval, input_hash_size=z.input_hash_size,
                     input_hash_func=zch_input_hash, name=t.name)


class Embeddings(NamedTuple):
    """The model's embedding collections (None: no table of that kind)."""

    ec: EmbeddingCollection | None  # unpooled tables, dense or modulo-hashed ids
    ebc: EmbeddingBagCollection | None  # pooled tables, dense or modulo-hashed ids
    mc_ec: ManagedCollisionEmbeddingCollection | None  # unpooled hash: zch tables
    mc_ebc: ManagedCollisionEmbeddingBagCollection | None  # pooled hash: zch tables

    def named(self) -> dict[str, nn.Module]:
        """Attribute name -> collection, for the ones that exist."""
        return {k: m for k, m in self._asdict().items() if m is not None}


def build_embeddings(cfg: ModelConfig, device: torch.device | str = "cpu") -> Embeddings:
    """The collections on `device`; use "meta" when DistributedModelParallel will materialise (and init) them."""
    device = torch.device(device)
    seq = [t for t in cfg.sequence_tables if t.zch is None]
    bags = [t for t in cfg.bag_tables if t.zch is None]
    zseq = [t for t in cfg.sequence_tables if t.zch is not None]
    zbags = [t for t in cfg.bag_tables if t.zch is not None]
    ec = EmbeddingCollection(tables=[_sequence_config(t) for t in seq], device=device) if seq else None
    ebc = EmbeddingBagCollection(tables=[_bag_config(t) for t in bags], device=device) if bags else None
    mc_ec = mc_ebc = None
    if zseq:
        configs = [_sequence_config(t) for t in zseq]
        mcc = ManagedCollisionCollection({t.name: zch_module(t, device) for t in zseq}, configs)
        mc_ec = ManagedCollisionEmbeddingCollection(EmbeddingCollection(tables=configs, device=device), mcc)
    if zbags:
        configs = [_bag_config(t) for t in zbags]
        mcc = ManagedCollisionCollection({t.name: zch_module(t, device) for t in zbags}, configs)
        mc_ebc = ManagedCollisionEmbeddingBagCollection(EmbeddingBagCollection(tables=configs, device=device), mcc)
    return Embeddings(ec, ebc, mc_ec, mc_ebc)


def zch_modules(module: nn.Module) -> list[ZchModule]:
    """Every zero-collision module inside `module` (sharded or not)."""
    return [m for m in module.modules() if isinstance(m, ZchModule)]


def unpooled_outputs(*outs) -> dict:
    """One mapping feature -> JaggedTensor from the outputs of the unpooled collections (an EmbeddingCollection's
    mapping, a managed-collision one's (mapping, remapped ids) pair; None: no such collection)."""
    merged: dict = {}
    for out in outs:
        if out is None:
            continue
        merged.update(out[0] if isinstance(out, tuple) else out)
    return merged


def sequence_embeddings(out, names: list[str]) -> list[torch.Tensor]:
    """Per feature (in `names` order) its jagged embeddings [T, dim] (every history token; a candidate feature:
    [B, dim]), from an EmbeddingCollection's output (a mapping feature -> JaggedTensor, sharded or not)."""
    missing = [n for n in names if n not in out]
    if missing:
        raise KeyError(f"features {missing} missing from the EmbeddingCollection output {list(out)}")
    return [out[n].values() for n in names]


def pooled_embeddings(kts, names: list[str]) -> list[torch.Tensor]:
    """Per sparse feature (in `names` order) its pooled embedding [B, dim], from the KeyedTensor of an
    EmbeddingBagCollection (or a list of them; a managed-collision collection's (KeyedTensor, remapped ids) pair).
    Indexed by key: a sharded EBC's KeyedTensor lists features in plan order, not config order."""
    kts = [kt[0] if isinstance(kt, tuple) else kt for kt in (kts if isinstance(kts, list) else [kts]) if kt is not None]
    where = {}
    for kt in kts:
        where.update(dict.fromkeys(kt.keys(), kt))
    missing = [n for n in names if n not in where]
    if missing:
        raise KeyError(f"sparse features {missing} missing from the EmbeddingBagCollection output {list(where)}")
    return [where[n][n] for n in names]
