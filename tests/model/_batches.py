"""Small hand-built batches and configs for the model tests (no dependence on the data sources)."""

from __future__ import annotations

import copy
from pathlib import Path

import torch
from omegaconf import OmegaConf
from torchrec import KeyedJaggedTensor

from gem.data import Batch
from gem.model import ModelConfig

TINY_YAML = Path(__file__).resolve().parents[2] / "configs" / "model" / "gem_tiny.yaml"


def tiny_dict(**tower) -> dict:
    """The tiny config as a plain dict, smaller still for fast tests; `tower` overrides tower keys."""
    d = OmegaConf.to_container(OmegaConf.load(TINY_YAML), resolve=True)
    d = copy.deepcopy(d)
    d["tower"].update(tower)
    return d


def tiny_cfg(kernel: str = "reference", **tower) -> ModelConfig:
    cfg = ModelConfig.from_dict(tiny_dict(**tower))
    cfg.kernel = kernel
    return cfg


def make_batch(cfg: ModelConfig, lengths: list[int], *, seed: int = 0, hots: list[int] | None = None,
               dtype=torch.float32) -> Batch:
    """A batch with these history lengths; sparse features get `hots[i]` ids per example (default 1..2)."""
    g = torch.Generator().manual_seed(seed)
    b = len(lengths)
    lens = torch.tensor(lengths, dtype=torch.int64)
    total = int(lens.sum())
    card = {f: t.num_embeddings for t in cfg.tables for f in t.features}
    seq_keys = cfg.sequence_features
    seq_vals = torch.cat([torch.randint(0, card[k], (total,), generator=g) for k in seq_keys])
    sequence = KeyedJaggedTensor.from_lengths_sync(keys=seq_keys, values=seq_vals, lengths=lens.repeat(len(seq_keys)))
    sp_keys = cfg.sparse_features
    sp_lens = []
    sp_vals = []
    for i, k in enumerate(sp_keys):
        n = torch.randint(1, 3, (b,), generator=g) if hots is None else torch.full((b,), hots[i])
        sp_lens.append(n)
        sp_vals.append(torch.randint(0, card[k], (int(n.sum()),), generator=g))
    sparse = KeyedJaggedTensor.from_lengths_sync(keys=sp_keys, values=torch.cat(sp_vals), lengths=torch.cat(sp_lens))
    offsets = torch.zeros(b + 1, dtype=torch.int64)
    offsets[1:] = torch.cumsum(lens, 0)
    return Batch(sequence=sequence, sparse=sparse, dense=torch.randn(b, cfg.num_dense, generator=g, dtype=dtype),
                 labels=torch.randint(0, 2, (b, len(cfg.heads.tasks)), generator=g).float(), seq_offsets=offsets,
                 max_seq_len=int(lens.max()) if b else 0)
