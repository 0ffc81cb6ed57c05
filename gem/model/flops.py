"""Analytic training FLOPs of the GEM model (for MFU), from the config and the batch's real jagged lengths.

Convention (the usual 6N rule): a matmul weight of n parameters applied to one row costs 2n FLOPs forward and
4n backward, so 6 * (matmul weights touched) per row; biases, norms, activations and embedding lookups are
excluded. Attention score + value matmuls cost 4 * H * D per visible (query, key) pair forward, x3 for
fwd + bwd. Visible pairs per sequence of length L, counting the diagonal half (FlashAttention's L^2 / 2 for causal):
the exact visible count minus L / 2. Causal: L^2 / 2; sliding window W (a row sees itself and W keys before it):
L^2 / 2 while L <= W + 1, else (W + 1)(W + 2) / 2 + (L - W - 1)(W + 1) - L / 2; block-causal with block S: the sum
over blocks of size^2 / 2.
MoE counts the router and the top_k active experts only.
"""

from __future__ import annotations

import functools
import itertools
from collections.abc import Mapping, Sequence

import torch

from gem.model.config import ModelConfig
from gem.model.heads import mlp_out_dim


def _mlp_weights(in_dim: int, hidden: Sequence[int], out_dim: int | None = None) -> int:
    dims = [in_dim, *hidden] + ([out_dim] if out_dim is not None else [])
    return sum(a * b for a, b in itertools.pairwise(dims))


def tower_weights_per_token(cfg: ModelConfig) -> int:
    """Matmul weights each history token passes through (input projection, blocks, interaction K/V)."""
    d, t = cfg.d_model, cfg.tower
    seq_dims = [tb.embedding_dim for tb in cfg.sequence_tables for _ in tb.features]
    n = (sum(seq_dims) if t.seq_combine == "concat" else seq_dims[0]) * d
    h, hk, dh = t.num_heads, cfg.tower_kv_heads, cfg.tower_head_dim
    for i in range(t.num_blocks):
        n += d * (h + 2 * hk) * dh + h * dh * d
        if cfg.is_moe_block(i):
            n += d * cfg.moe.num_experts + cfg.moe.top_k * 3 * d * cfg.moe_d_ff
        else:
            n += 3 * d * cfg.tower_d_ff
    n += d * 2 * cfg.interaction_kv_heads * cfg.interaction_head_dim
    return n


def weights_per_example(cfg: ModelConfig) -> int:
    """Matmul weights applied once per example (query tokens, interaction q/out, dense MLPs, heads)."""
    d, it = cfg.d_model, cfg.interaction
    bag_dims = {f: tb.embedding_dim for tb in cfg.bag_tables for f in tb.features}
    n = sum(bag_dims[f] * d for f in cfg.sparse_features)
    n += _mlp_weights(cfg.num_dense, it.dense_hidden, d)  # dense token
    hd = it.num_heads * cfg.interaction_head_dim
    n += cfg.num_query_tokens * (d * hd + hd * d)  # q projection and output projection per query token
    n += _mlp_weights(cfg.num_dense, it.dense_hidden)  # dense path
    z = cfg.num_query_tokens * d + mlp_out_dim(cfg.num_dense, it.dense_hidden)
    n += _mlp_weights(z, cfg.heads.over_arch)
    n += len(cfg.heads.tasks) * _mlp_weights(mlp_out_dim(z, cfg.heads.over_arch), cfg.heads.hidden, 1)
    return n


def dense_flops_per_token(cfg: ModelConfig) -> int:
    """6 x the matmul weights per history token (training, excluding attention and per-example parts)."""
    return 6 * tower_weights_per_token(cfg)


def attention_pairs_per_example(cfg: ModelConfig, lengths: torch.Tensor) -> torch.Tensor:
    """Visible (query, key) pairs of one tower attention layer per sequence (float64 [B]; see module doc)."""
    L = lengths.to(torch.float64)
    t = cfg.tower
    if t.attention == "jfa":
        return L * L / 2
    if t.attention == "swa":  # a row sees itself and up to `window` keys before it
        w = float(t.window)
        return torch.where(L <= w + 1, L * L / 2, (w + 1) * (w + 2) / 2 + (L - w - 1) * (w + 1) - L / 2)
    s = float(t.block_size)
    full = torch.floor(L / s)
    rest = L - full * s
    return full * s * s / 2 + rest * rest / 2


def attention_pairs(cfg: ModelConfig, lengths: torch.Tensor) -> float:
    """Visible (query, key) pairs of one tower attention layer summed over the batch (see module doc)."""
    return float(attention_pairs_per_example(cfg, lengths).sum())


def example_flops(cfg: ModelConfig, lengths: Mapping[str, torch.Tensor],
                  candidates: torch.Tensor | None = None) -> torch.Tensor:
    """Training FLOPs (fwd + bwd) of each example (float64 [B]) from its history lengths {history name: [B]}.

    The tower runs once per example on its history; the per-candidate work (query tokens, interaction attention
    over the history, heads) runs `candidates` times (int [B]; None: one candidate per example).
    """
    if len(lengths) != 1:
        raise ValueError(f"the model has one history tower; got lengths of {sorted(lengths)}")
    (L,) = lengths.values()
    L = L.detach().to("cpu", torch.float64)
    t, it = cfg.tower, cfg.interaction
    tower = 6 * tower_weights_per_token(cfg) * L
    tower = tower + 3 * 4 * t.num_heads * cfg.tower_head_dim * t.num_blocks * attention_pairs_per_example(cfg, L)
    per_candidate = 6 * weights_per_example(cfg) + 3 * 4 * it.num_heads * cfg.interaction_head_dim * \
        cfg.num_query_tokens * L
    if candidates is not None:
        per_candidate = per_candidate * candidates.detach().to("cpu", torch.float64)
    return tower + per_candidate


def example_cost(cfg: ModelConfig) -> functools.partial:
    """`example_flops` of this model as a picklable callable of the lengths (data.balance's cost per example)."""
    return functools.partial(example_flops, cfg)


def train_flops(cfg: ModelConfig, seq_offsets: torch.Tensor) -> int:
    """FLOPs of one training step (fwd + bwd) on a batch with these history offsets [B+1]."""
    offsets = seq_offsets.detach().to("cpu", torch.int64)
    return round(float(example_flops(cfg, {"history": offsets[1:] - offsets[:-1]}).sum()))
