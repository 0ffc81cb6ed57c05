"""Analytic training FLOPs of the GEM model (for MFU), from the config and the batch's real jagged lengths.

Convention (the usual 6N rule): a matmul weight of n parameters applied to one row costs 2n FLOPs forward and
4n backward, so 6 * (matmul weights touched) per row; biases, norms, activations and embedding lookups are
excluded. Attention score + value matmuls cost 4 * H * D per visible (query, key) pair forward, x3 for
fwd + bwd. Visible pairs per sequence of length L, counting the diagonal half (FlashAttention's L^2 / 2 for causal):
the exact visible count minus L / 2. Causal: L^2 / 2; sliding window W (a row sees itself and W keys before it):
L^2 / 2 while L <= W + 1, else (W + 1)(W + 2) / 2 + (L - W - 1)(W + 1) - L / 2; block-causal with block S: the sum
over blocks of size^2 / 2.
MoE counts the router and the top_k active experts only.

Per candidate form (`model.candidates`, gem.model.gem), for R requests with histories L_r and k_r candidates:
rows runs every candidate's own copy of its history through the tower (sum_r k_r L_r tokens after the input
projection, which runs once per history; pairs per copy);
interaction runs each history once (sum_r L_r tokens) and the GDPA of every candidate's query tokens over its
history (n_q k_r L_r pairs); targets runs each history once plus one token per candidate through the blocks (not
the input projection, no GDPA), a target seeing its history (or the last `window` of it) and itself:
k_r (min(L_r, W) + 1) visible pairs, less half the diagonal.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence

import torch

from gem.model.config import ModelConfig
from gem.model.heads import mlp_out_dim


def _mlp_weights(in_dim: int, hidden: Sequence[int], out_dim: int | None = None) -> int:
    dims = [in_dim, *hidden] + ([out_dim] if out_dim is not None else [])
    return sum(a * b for a, b in itertools.pairwise(dims))


def block_weights_per_token(cfg: ModelConfig) -> int:
    """Matmul weights of the transformer blocks per token."""
    d, t = cfg.d_model, cfg.tower
    h, hk, dh = t.num_heads, cfg.tower_kv_heads, cfg.tower_head_dim
    n = 0
    for i in range(t.num_blocks):
        n += d * (h + 2 * hk) * dh + h * dh * d
        if cfg.is_moe_block(i):
            n += d * cfg.moe.num_experts + cfg.moe.top_k * 3 * d * cfg.moe_d_ff
        else:
            n += 3 * d * cfg.tower_d_ff
    return n


def input_weights_per_token(cfg: ModelConfig) -> int:
    """Matmul weights of the input projection (sequence embeddings -> d_model) per history token."""
    seq_dims = [tb.embedding_dim for tb in cfg.sequence_tables for _ in tb.features]
    return (sum(seq_dims) if cfg.tower.seq_combine == "concat" else seq_dims[0]) * cfg.d_model


def tower_weights_per_token(cfg: ModelConfig) -> int:
    """Matmul weights each history token passes through (input projection, blocks, and the interaction's K/V
    except in the targets form, which has no interaction)."""
    n = input_weights_per_token(cfg) + block_weights_per_token(cfg)
    if cfg.candidates != "targets":
        n += cfg.d_model * 2 * cfg.interaction_kv_heads * cfg.interaction_head_dim
    return n


def weights_per_example(cfg: ModelConfig) -> int:
    """Matmul weights applied once per candidate outside the tower (query tokens, interaction q/out or the target
    token's projection, dense MLPs, heads)."""
    d, it = cfg.d_model, cfg.interaction
    bag_dims = {f: tb.embedding_dim for tb in cfg.bag_tables for f in tb.features}
    n = sum(bag_dims[f] * d for f in cfg.sparse_features)
    n += _mlp_weights(cfg.num_dense, it.dense_hidden, d)  # dense token
    if cfg.candidates == "targets":
        n += cfg.num_query_tokens * d * d  # query tokens -> target token
    else:
        hd = it.num_heads * cfg.interaction_head_dim
        n += cfg.num_query_tokens * (d * hd + hd * d)  # q projection and output projection per query token
    n += _mlp_weights(cfg.num_dense, it.dense_hidden)  # dense path
    z = cfg.head_input_dim
    n += _mlp_weights(z, cfg.heads.over_arch)
    n += len(cfg.heads.tasks) * _mlp_weights(mlp_out_dim(z, cfg.heads.over_arch), cfg.heads.hidden, 1)
    return n


def dense_flops_per_token(cfg: ModelConfig) -> int:
    """6 x the matmul weights per history token (training, excluding attention and per-example parts)."""
    return 6 * tower_weights_per_token(cfg)


def attention_pairs(cfg: ModelConfig, lengths: torch.Tensor) -> float:
    """Visible (query, key) pairs of one tower attention layer summed over the batch (see module doc)."""
    L = lengths.to(torch.float64)
    t = cfg.tower
    if t.attention == "jfa":
        return float((L * L / 2).sum())
    if t.attention == "swa":  # a row sees itself and up to `window` keys before it
        w = float(t.window)
        return float(torch.where(L <= w + 1, L * L / 2, (w + 1) * (w + 2) / 2 + (L - w - 1) * (w + 1) - L / 2).sum())
    s = float(t.block_size)
    full = torch.floor(L / s)
    rest = L - full * s
    return float((full * s * s / 2 + rest * rest / 2).sum())


def target_pairs(cfg: ModelConfig, lengths: torch.Tensor, num_targets: torch.Tensor) -> float:
    """Visible (query, key) pairs of the target rows of one tower attention layer (module doc): each target sees
    its history, up to the window, and itself; half the diagonal off."""
    L = lengths.to(torch.float64)
    if cfg.tower.attention == "swa":
        L = L.clamp_max(float(cfg.tower.window))
    return float((num_targets.to(torch.float64) * (L + 0.5)).sum())


def train_flops(cfg: ModelConfig, seq_offsets: torch.Tensor, cand_offsets: torch.Tensor | None = None) -> int:
    """FLOPs of one training step (fwd + bwd) on a batch with these history offsets [R+1] and candidates per
    request (cand_offsets [R+1]; None: one candidate per history), computed as `cfg.candidates` computes them."""
    offsets = seq_offsets.detach().to("cpu", torch.int64)
    lengths = offsets[1:] - offsets[:-1]
    if cand_offsets is None:
        counts = torch.ones_like(lengths)
    else:
        c_off = cand_offsets.detach().to("cpu", torch.int64)
        counts = c_off[1:] - c_off[:-1]
    cands = int(counts.sum())
    t, it = cfg.tower, cfg.interaction
    attn = 3 * 4 * t.num_heads * cfg.tower_head_dim * t.num_blocks
    total = 6 * weights_per_example(cfg) * cands
    if cfg.candidates == "targets":
        total += 6 * (tower_weights_per_token(cfg) * int(lengths.sum()) + block_weights_per_token(cfg) * cands)
        total += attn * (attention_pairs(cfg, lengths) + target_pairs(cfg, lengths, counts))
        return round(total)
    per_cand = torch.repeat_interleave(lengths, counts)  # the history each candidate's queries see
    tower_lengths = per_cand if cfg.candidates == "rows" else lengths
    # the input projection runs before a history is copied per candidate
    copies = int(tower_lengths.sum()) - int(lengths.sum())
    total += 6 * (tower_weights_per_token(cfg) * int(tower_lengths.sum()) - input_weights_per_token(cfg) * copies)
    total += attn * attention_pairs(cfg, tower_lengths)
    total += 3 * 4 * it.num_heads * cfg.interaction_head_dim * cfg.num_query_tokens * int(per_cand.sum())
    return round(total)
