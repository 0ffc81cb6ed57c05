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

import functools
import itertools
from collections.abc import Mapping, Sequence

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


def attention_pairs_per_example(cfg: ModelConfig, lengths: torch.Tensor, history: str | None = None) -> torch.Tensor:
    """Visible (query, key) pairs of one attention layer of `history`'s tower per sequence (float64 [B]; see module
    doc). `history` None: the first history's tower (merged histories: the one tower)."""
    L = lengths.to(torch.float64)
    t = cfg.tower_for(history or cfg.histories[0])
    if t.attention == "jfa":
        return L * L / 2
    if t.attention == "swa":  # a row sees itself and up to `window` keys before it
        w = float(t.window)
        return torch.where(L <= w + 1, L * L / 2, (w + 1) * (w + 2) / 2 + (L - w - 1) * (w + 1) - L / 2)
    s = float(t.block_size)
    full = torch.floor(L / s)
    rest = L - full * s
    return full * s * s / 2 + rest * rest / 2


def attention_pairs(cfg: ModelConfig, lengths: torch.Tensor, history: str | None = None) -> float:
    """Visible (query, key) pairs of one tower attention layer summed over the batch (see module doc)."""
    return float(attention_pairs_per_example(cfg, lengths, history).sum())


def example_flops(cfg: ModelConfig, lengths: Mapping[str, torch.Tensor]) -> torch.Tensor:
    """Training FLOPs (fwd + bwd) of each example (float64 [B]) from its history lengths {history name: [B]}, one
    entry per history of the model.

    Each history's tokens pass through its own tower (projection, blocks, attention on that history's length under
    its tower's mask and window; merged by time: the one tower's attention on the summed length) and the target
    interaction's K/V and attention; the per-example part (query tokens, interaction q / out, dense MLPs, heads)
    once. Every term is a whole number of FLOPs, so float64 sums over a batch are exact below 2^53.
    """
    missing = [h for h in cfg.histories if h not in lengths]
    if missing or len(lengths) != len(cfg.histories):
        raise ValueError(f"example_flops: lengths of {sorted(lengths)} for the histories {cfg.histories}")
    it = cfg.interaction
    per_history = [lengths[h].detach().to("cpu", torch.float64) for h in cfg.histories]
    b = per_history[0].numel()
    total = torch.full((b,), 6.0 * weights_per_example(cfg), dtype=torch.float64)
    gdpa = 3 * 4 * it.num_heads * cfg.interaction_head_dim * cfg.num_query_tokens
    for h, L in zip(cfg.histories, per_history):
        total += (6 * tower_weights_per_token(cfg, h) + gdpa) * L
        if not cfg.merged:
            t = cfg.tower_for(h)
            total += 3 * 4 * t.num_heads * t.head_dim * t.num_blocks * attention_pairs_per_example(cfg, L, h)
    if cfg.merged:  # one tower over every example's merged events (no per-history towers)
        t = cfg.tower_for()
        total += 3 * 4 * t.num_heads * t.head_dim * t.num_blocks * attention_pairs_per_example(cfg, sum(per_history))
    return total


def example_cost(cfg: ModelConfig) -> functools.partial:
    """`example_flops` of this model as a picklable callable of the lengths (data.balance's cost per example)."""
    return functools.partial(example_flops, cfg)


def _history_lengths(cfg: ModelConfig, offsets: torch.Tensor | Sequence[torch.Tensor]) -> dict[str, torch.Tensor]:
    """{history name: lengths [B]} from offsets [B+1] (one tensor per history, schema order; a single tensor for one
    history)."""
    per_history = [offsets] if isinstance(offsets, torch.Tensor) else list(offsets)
    if len(per_history) != len(cfg.histories):
        raise ValueError(f"train_flops: {len(per_history)} offsets for {len(cfg.histories)} histories")
    out = {}
    for h, off in zip(cfg.histories, per_history):
        off = off.detach().to("cpu", torch.int64)
        out[h] = off[1:] - off[:-1]
    return out


def train_flops(cfg: ModelConfig, offsets: torch.Tensor | Sequence[torch.Tensor]) -> int:
    """FLOPs of one training step (fwd + bwd) on a batch with these history offsets [B+1] (one tensor per history,
    schema order; a single tensor for one history)."""
    return round(float(example_flops(cfg, _history_lengths(cfg, offsets)).sum()))
