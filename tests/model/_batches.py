"""Small hand-built batches and configs for the model tests (no dependence on the data sources)."""

from __future__ import annotations

import copy
from pathlib import Path

import torch
from omegaconf import OmegaConf
from torchrec import KeyedJaggedTensor

from gem.data import Batch, Schema
from gem.data.batch import history_fields, request_fields
from gem.model import ModelConfig

TINY_YAML = Path(__file__).resolve().parents[2] / "configs" / "model" / "gem_tiny.yaml"
DATA_YAML = Path(__file__).resolve().parents[2] / "configs" / "data" / "synthetic.yaml"


def tiny_dict(**tower) -> dict:
    """The tiny config as a plain dict, smaller still for fast tests; `tower` overrides tower keys."""
    d = OmegaConf.to_container(OmegaConf.load(TINY_YAML), resolve=True)
    d = copy.deepcopy(d)
    d["tower"].update(tower)
    return d


def data_dict() -> dict:
    """The default data declaration (configs/data/synthetic.yaml) as a plain dict."""
    return copy.deepcopy(OmegaConf.to_container(OmegaConf.load(DATA_YAML), resolve=True))


def tiny_schema(data: dict | None = None) -> Schema:
    return Schema.from_dict(data if data is not None else data_dict())


def tiny_cfg(kernel: str = "reference", *, data: dict | None = None, **tower) -> ModelConfig:
    cfg = ModelConfig.from_dict(tiny_dict(**tower), tiny_schema(data))
    cfg.kernel = kernel
    return cfg


def make_batch(cfg: ModelConfig, lengths: list[int] | list[list[int]], *, seed: int = 0,
               hots: list[int] | None = None, dtype=torch.float32, candidates: list[int] | None = None) -> Batch:
    """A batch with these history lengths (one list per history, or one list for a single history); sparse
    features get `hots[i]` ids per example (default 1..2). `candidates`: candidates per example (requests; None:
    the row form)."""
    g = torch.Generator().manual_seed(seed)
    per_hist = [lengths] if not lengths or not isinstance(lengths[0], (list, tuple)) else lengths
    b = len(per_hist[0])
    lens = [torch.tensor(x, dtype=torch.int64) for x in per_hist]
    card = {f: t.num_embeddings for t in cfg.tables for f in t.features}
    keys, vals, lns = [], [], []
    for h, n in zip(cfg.histories, lens):
        for k in cfg.history_features(h):
            keys.append(k)
            vals.append(torch.randint(0, card[k], (int(n.sum()),), generator=g))
            lns.append(n)
    counts = torch.ones(b, dtype=torch.int64) if candidates is None else torch.tensor(candidates, dtype=torch.int64)
    c = int(counts.sum())
    for k in cfg.candidate_features:
        keys.append(k)
        vals.append(torch.randint(0, card[k], (c,), generator=g))
        lns.append(counts)
    sequence = KeyedJaggedTensor.from_lengths_sync(keys=keys, values=torch.cat(vals), lengths=torch.cat(lns))
    sp_keys = cfg.sparse_features
    sp_lens = []
    sp_vals = []
    for i, k in enumerate(sp_keys):
        n = torch.randint(1, 3, (b,), generator=g) if hots is None else torch.full((b,), hots[i])
        sp_lens.append(n)
        sp_vals.append(torch.randint(0, card[k], (int(n.sum()),), generator=g))
    sparse = KeyedJaggedTensor.from_lengths_sync(keys=sp_keys, values=torch.cat(sp_vals), lengths=torch.cat(sp_lens))
    return Batch(sequence=sequence, sparse=sparse, dense=torch.randn(b, cfg.num_dense, generator=g, dtype=dtype),
                 labels=torch.randint(0, 2, (c, len(cfg.tasks)), generator=g).float(), **history_fields(lens),
                 **request_fields(None if candidates is None else counts,
                                  None if candidates is None else torch.arange(b) + 1000))
