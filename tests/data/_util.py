"""Shared helpers for the data tests."""

from __future__ import annotations

import copy
from typing import Any

import torch

from gem.data import Schema


def schema_dict(num_items: int = 500, zipf_alpha: float = 1.05, **history: Any) -> dict:
    """The data group's declaration (features, histories, labels, tables, synthetic) of a small schema."""
    d = {
        "features": {
            "hist_item": {"kind": "sequence", "table": "item", "history": "events"},
            "hist_action": {"kind": "sequence", "table": "action", "history": "events"},
            "cand_item": {"kind": "candidate", "table": "item"},
            "user_segment": {"kind": "sparse", "table": "user_segment"},
            "context": {"kind": "sparse", "table": "context", "max_hot": 3, "min_hot": 0},
            "dense": {"kind": "dense", "size": 4},
        },
        "histories": {"events": {"max_len": 24, "min_len": 0, "distribution": "uniform", "sparsity": 0.5}},
        "labels": {"click": "click", "conversion": "conversion"},
        "tables": {
            "item": {"num_embeddings": num_items, "embedding_dim": 8},
            "action": {"num_embeddings": 4, "embedding_dim": 8},
            "user_segment": {"num_embeddings": 20, "embedding_dim": 4},
            "context": {"num_embeddings": 7, "embedding_dim": 4, "pooling": "mean"},
        },
        "synthetic": {"zipf_alpha": zipf_alpha, "action": "hist_action"},
    }
    d["histories"]["events"].update(history)
    return copy.deepcopy(d)


def make_schema(num_items: int = 500, zipf_alpha: float = 1.05, **history: Any) -> Schema:
    return Schema.from_dict(schema_dict(num_items, zipf_alpha, **history))


def assert_batches_equal(a, b) -> None:
    for name in ("sequence", "sparse"):
        ka, kb = getattr(a, name), getattr(b, name)
        assert list(ka.keys()) == list(kb.keys())
        assert torch.equal(ka.values(), kb.values())
        assert torch.equal(ka.lengths(), kb.lengths())
    assert torch.equal(a.dense, b.dense)
    assert torch.equal(a.labels, b.labels)
    assert torch.equal(a.seq_offsets, b.seq_offsets)
    assert a.max_seq_len == b.max_seq_len
    assert len(a.history_offsets) == len(b.history_offsets)
    assert all(torch.equal(x, y) for x, y in zip(a.history_offsets, b.history_offsets))
    assert a.history_max_lens == b.history_max_lens


def batches_equal(a, b) -> bool:
    try:
        assert_batches_equal(a, b)
    except AssertionError:
        return False
    return True


def auc(p: torch.Tensor, y: torch.Tensor) -> float:
    """ROC AUC by the rank-sum formula (ties get average ranks)."""
    p, y = p.double(), y.bool()
    order = torch.argsort(p)
    sorted_p = p[order]
    ranks = torch.empty_like(p)
    ranks[order] = torch.arange(1, len(p) + 1, dtype=torch.float64)
    # Average ranks over ties.
    uniq, inverse = torch.unique(sorted_p, return_inverse=True)
    sums = torch.zeros(len(uniq), dtype=torch.float64).index_add_(0, inverse, torch.arange(1, len(p) + 1).double())
    counts = torch.zeros(len(uniq), dtype=torch.float64).index_add_(0, inverse, torch.ones(len(p), dtype=torch.float64))
    ranks[order] = (sums / counts)[inverse]
    npos, nneg = int(y.sum()), int((~y).sum())
    return float((ranks[y].sum() - npos * (npos + 1) / 2) / (npos * nneg))
