"""Analytic training FLOPs of the GEM model (for MFU), from the config and the batch's real jagged lengths.

Convention (the usual 6N rule): a matmul weight of n parameters applied to one row costs 2n FLOPs forward and
4n backward, so 6 * (matmul weights touched) per row; biases, norms, activations and embedding lookups are
excluded. Attention score + value matmuls cost 4 * H * D per visible (query, key) pair forward, x3 for
fwd + bwd. Visible pairs per sequence of length L, counting the diagonal half (FlashAttention's L^2 / 2 for causal):
the exact visible count minus L / 2. Causal: L^2 / 2; sliding window W (a row sees itself and W keys before it):
L^2 / 2 while L <= W + 1, else (W + 1)(W + 2) / 2 + (L - W - 1)(W + 1) - L / 2; block-causal with block S: the sum
over blocks of size^2 / 2.
MoE counts the router and the top_k active experts only. Several histories: each tower counts on its own
history's lengths (merged by time: the one tower's attention on every example's summed length); the target
interaction's K/V and attention on all of an example's history tokens.
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


def tower_weights_per_token(cfg: ModelConfig, history: str | None = None) -> int:
    """Matmul weights each token of a history passes through (input projection, its tower's blocks, interaction
    K/V). `history` None: the first history."""
    history = history or cfg.histories[0]
    d, t = cfg.d_model, cfg.tower_for(history)
    dims = [cfg.embedding_dim(f) for f in cfg.history_features(history)]
    n = (sum(dims) if t.seq_combine == "concat" else dims[0]) * d
    h, hk, dh = t.num_heads, t.num_kv_heads, t.head_dim
    for i in range(t.num_blocks):
        n += d * (h + 2 * hk) * dh + h * dh * d
        if cfg.is_moe_block(i, t):
            n += d * cfg.moe.num_experts + cfg.moe.top_k * 3 * d * cfg.moe_d_ff_for(t)
        else:
            n += 3 * d * t.d_ff
    n += d * 2 * cfg.interaction_kv_heads * cfg.interaction_head_dim
    return n


def weights_per_example(cfg: ModelConfig) -> int:
    """Matmul weights applied once per example (query tokens, interaction q/out, dense MLPs, heads)."""
    d, it = cfg.d_model, cfg.interaction
    n = sum(cfg.embedding_dim(f) * d for f in cfg.query_features)
    n += _mlp_weights(cfg.num_dense, it.dense_hidden, d)  # dense token
    hd = it.num_heads * cfg.interaction_head_dim
    n += cfg.num_query_tokens * (d * hd + hd * d)  # q projection and output projection per query token
    n += _mlp_weights(cfg.num_dense, it.dense_hidden)  # dense path
    z = cfg.num_query_tokens * d + mlp_out_dim(cfg.num_dense, it.dense_hidden)
    n += _mlp_weights(z, cfg.heads.over_arch)
    n += len(cfg.tasks) * _mlp_weights(mlp_out_dim(z, cfg.heads.over_arch), cfg.heads.hidden, 1)
    return n


def dense_flops_per_token(cfg: ModelConfig, history: str | None = None) -> int:
    """6 x the matmul weights per history token (training, excluding attention and per-example parts)."""
    return 6 * tower_weights_per_token(cfg, history)


def attention_pairs(cfg: ModelConfig, lengths: torch.Tensor, history: str | None = None) -> float:
    """Visible (query, key) pairs of one tower attention layer summed over the batch (see module doc)."""
    L = lengths.to(torch.float64)
    t = cfg.tower_for(history or cfg.histories[0])
    if t.attention == "jfa":
        return float((L * L / 2).sum())
    if t.attention == "swa":  # a row sees itself and up to `window` keys before it
        w = float(t.window)
        return float(torch.where(L <= w + 1, L * L / 2, (w + 1) * (w + 2) / 2 + (L - w - 1) * (w + 1) - L / 2).sum())
    s = float(t.block_size)
    full = torch.floor(L / s)
    rest = L - full * s
    return float((full * s * s / 2 + rest * rest / 2).sum())


def train_flops(cfg: ModelConfig, offsets: torch.Tensor | Sequence[torch.Tensor]) -> int:
    """FLOPs of one training step (fwd + bwd) on a batch with these history offsets [B+1] (one tensor per history,
    schema order; a single tensor for one history)."""
    per_history = [offsets] if isinstance(offsets, torch.Tensor) else list(offsets)
    if len(per_history) != len(cfg.histories):
        raise ValueError(f"train_flops: {len(per_history)} offsets for {len(cfg.histories)} histories")
    it = cfg.interaction
    total = 0.0
    merged = 0
    for h, off in zip(cfg.histories, per_history):
        off = off.detach().to("cpu", torch.int64)
        lengths = off[1:] - off[:-1]
        merged = merged + lengths
        tokens = int(lengths.sum())
        t = cfg.tower_for(h)
        total += 6 * tower_weights_per_token(cfg, h) * tokens
        if not cfg.merged:
            total += 3 * 4 * t.num_heads * t.head_dim * attention_pairs(cfg, lengths, h) * t.num_blocks
        total += 3 * 4 * it.num_heads * cfg.interaction_head_dim * cfg.num_query_tokens * tokens
    if cfg.merged:  # one tower over every example's merged events (no per-history towers)
        t = cfg.tower_for()
        total += 3 * 4 * t.num_heads * t.head_dim * attention_pairs(cfg, merged, None) * t.num_blocks
    b = per_history[0].numel() - 1
    total += 6 * weights_per_example(cfg) * b
    return round(total)
