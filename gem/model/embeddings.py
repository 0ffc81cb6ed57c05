"""TorchRec embedding modules built from the model's table configs.

Tables of sequence and candidate features -> one `EmbeddingCollection` (unpooled: one row per history token, one
per candidate); tables only sparse features use -> one `EmbeddingBagCollection` (sum / mean pooled per example;
None when there are none). Tables carry their own `init_fn`, because TorchRec's
DistributedModelParallel re-initialises sharded tables from the table config instead of copying weights.
"""

from __future__ import annotations

import functools

import torch
from torchrec import EmbeddingBagCollection, EmbeddingCollection
from torchrec.modules.embedding_configs import EmbeddingBagConfig, EmbeddingConfig, PoolingType

from gem.data.schema import EmbeddingTable
from gem.model.config import ModelConfig

_POOLING = {"sum": PoolingType.SUM, "mean": PoolingType.MEAN}


def _init_kwargs(t: EmbeddingTable) -> dict:
    if t.init_range is None:
        return {}
    r = float(t.init_range)
    # A partial of a torch function pickles, so plans / DMP can carry it across processes.
    init_fn = functools.partial(torch.nn.init.uniform_, a=-r, b=r)
    return {"weight_init_min": -r, "weight_init_max": r, "init_fn": init_fn}


def sequence_table_configs(cfg: ModelConfig) -> list[EmbeddingConfig]:
    return [EmbeddingConfig(name=t.name, num_embeddings=t.num_embeddings, embedding_dim=t.embedding_dim,
                            feature_names=list(t.features), **_init_kwargs(t)) for t in cfg.sequence_tables]


def bag_table_configs(cfg: ModelConfig) -> list[EmbeddingBagConfig]:
    return [EmbeddingBagConfig(name=t.name, num_embeddings=t.num_embeddings, embedding_dim=t.embedding_dim,
                               feature_names=list(t.features), pooling=_POOLING[t.pooling], **_init_kwargs(t))
            for t in cfg.bag_tables]


def build_embeddings(cfg: ModelConfig, device: torch.device | str = "cpu"
                     ) -> tuple[EmbeddingCollection, EmbeddingBagCollection | None]:
    """(ec, ebc) on `device`; use "meta" when DistributedModelParallel will materialise (and init) them."""
    device = torch.device(device)
    ec = EmbeddingCollection(tables=sequence_table_configs(cfg), device=device)
    bags = bag_table_configs(cfg)
    ebc = EmbeddingBagCollection(tables=bags, device=device) if bags else None
    return ec, ebc


def sequence_embeddings(out, names: list[str]) -> list[torch.Tensor]:
    """Per feature (in `names` order) its jagged embeddings [T, dim] (every history token; a candidate feature:
    [B, dim]), from an EmbeddingCollection's output (a mapping feature -> JaggedTensor, sharded or not)."""
    missing = [n for n in names if n not in out]
    if missing:
        raise KeyError(f"features {missing} missing from the EmbeddingCollection output {list(out)}")
    return [out[n].values() for n in names]


def pooled_embeddings(kt, names: list[str]) -> list[torch.Tensor]:
    """Per sparse feature (in `names` order) its pooled embedding [B, dim], from an EmbeddingBagCollection's
    KeyedTensor. Indexed by key: a sharded EBC's KeyedTensor lists features in plan order, not config order."""
    keys = kt.keys()
    missing = [n for n in names if n not in keys]
    if missing:
        raise KeyError(f"sparse features {missing} missing from the EmbeddingBagCollection output {list(keys)}")
    return [kt[n] for n in names]
