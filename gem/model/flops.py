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

Per candidate form (`model.candidates`, gem.model.gem), for R requests with histories L_r (all histories of
request r) and k_r candidates: `rows` runs every candidate's own copy of its request's histories through the towers
(sum_r k_r L_r tokens after the input projection, which runs once per history token; pairs per copy) and the GDPA
of its query tokens over its copy; `interaction` runs each history once (sum_r L_r tokens) and the GDPA of every
candidate's query tokens over its request's history (n_q k_r L_r pairs); `targets` runs each history once plus one
token per candidate through the one tower's blocks (not the input projection, no interaction), a target seeing its
history (or the last `window` of it) and itself: k_r (min(L_r, W) + 1) visible pairs, less half the diagonal.
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


def input_weights_per_token(cfg: ModelConfig, history: str | None = None) -> int:
    """Matmul weights of a history's input projection (its sequence embeddings -> d_model) per token."""
    history = history or cfg.histories[0]
    dims = [cfg.embedding_dim(f) for f in cfg.history_features(history)]
    return (sum(dims) if cfg.tower_for(history).seq_combine == "concat" else dims[0]) * cfg.d_model


def block_weights_per_token(cfg: ModelConfig, history: str | None = None) -> int:
    """Matmul weights of a history's tower blocks per token (`history` None: the first history's tower)."""
    d, t = cfg.d_model, cfg.tower_for(history or cfg.histories[0])
    h, hk, dh = t.num_heads, t.num_kv_heads, t.head_dim
    n = 0
    for i in range(t.num_blocks):
        n += d * (h + 2 * hk) * dh + h * dh * d
        if cfg.is_moe_block(i, t):
            n += d * cfg.moe.num_experts + cfg.moe.top_k * 3 * d * cfg.moe_d_ff_for(t)
        else:
            n += 3 * d * t.d_ff
    return n


def tower_weights_per_token(cfg: ModelConfig, history: str | None = None) -> int:
    """Matmul weights each token of a history passes through (input projection, its tower's blocks, interaction
    K/V except in the targets form, which has no interaction). `history` None: the first history."""
    n = input_weights_per_token(cfg, history) + block_weights_per_token(cfg, history)
    if cfg.candidates != "targets":
        n += cfg.d_model * 2 * cfg.interaction_kv_heads * cfg.interaction_head_dim
    return n


def weights_per_example(cfg: ModelConfig) -> int:
    """Matmul weights applied once per candidate outside the towers (query tokens, interaction q/out or the target
    token's projection, dense MLPs, heads)."""
    d, it = cfg.d_model, cfg.interaction
    n = sum(cfg.embedding_dim(f) * d for f in cfg.query_features)
    n += _mlp_weights(cfg.num_dense, it.dense_hidden, d)  # dense token
    if cfg.candidates == "targets":
        n += cfg.num_query_tokens * d * d  # query tokens -> target token
    else:
        hd = it.num_heads * cfg.interaction_head_dim
        n += cfg.num_query_tokens * (d * hd + hd * d)  # q projection and output projection per query token
    n += _mlp_weights(cfg.num_dense, it.dense_hidden)  # dense path
    z = cfg.head_input_dim
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


def example_flops(cfg: ModelConfig, lengths: Mapping[str, torch.Tensor], counts: torch.Tensor | None = None
                  ) -> torch.Tensor:
    """Training FLOPs (fwd + bwd) of each example or request (float64 [R]) from its history lengths {history name:
    [R]}, one entry per history of the model, and its candidates (`counts` [R]; None: one each), computed as
    `cfg.candidates` computes them (module doc).

    Each history's tokens pass through its own tower (the input projection once; the blocks once per candidate in
    the rows form; attention on that history's length under its tower's mask and window; merged by time: the one
    tower's attention on the summed length), then the target interaction's K/V and attention per candidate, or (the
    targets form) one token per candidate through the blocks; the per-candidate part (query tokens, interaction
    q / out, dense MLPs, heads) once per candidate. Sums over a batch are exact below 2^53.
    """
    missing = [h for h in cfg.histories if h not in lengths]
    if missing or len(lengths) != len(cfg.histories):
        raise ValueError(f"example_flops: lengths of {sorted(lengths)} for the histories {cfg.histories}")
    per_history = [lengths[h].detach().to("cpu", torch.float64) for h in cfg.histories]
    n = torch.ones_like(per_history[0]) if counts is None else counts.detach().to("cpu", torch.float64)
    copies = n if cfg.candidates == "rows" else torch.ones_like(n)
    total = 6.0 * weights_per_example(cfg) * n
    merged = torch.zeros_like(n)
    for h, L in zip(cfg.histories, per_history):
        merged = merged + L
        inp = input_weights_per_token(cfg, h)  # the input projection runs before any copy
        total += 6 * (inp * L + (tower_weights_per_token(cfg, h) - inp) * L * copies)
        if not cfg.merged:
            t = cfg.tower_for(h)
            total += 3 * 4 * t.num_heads * t.head_dim * t.num_blocks * attention_pairs_per_example(cfg, L, h) * copies
    if cfg.merged:  # one tower over every example's merged events (no per-history towers)
        t = cfg.tower_for()
        total += 3 * 4 * t.num_heads * t.head_dim * t.num_blocks * attention_pairs_per_example(cfg, merged) * copies
    if cfg.candidates == "targets":  # one token per candidate through the blocks; no interaction
        one = cfg.towers_built[0]
        t = cfg.tower_for(one)
        seen = merged.clamp_max(float(t.window)) if t.attention == "swa" else merged
        total += 6 * block_weights_per_token(cfg, one) * n
        return total + 3 * 4 * t.num_heads * t.head_dim * t.num_blocks * n * (seen + 0.5)
    it = cfg.interaction  # GDPA: every candidate's query tokens over all of its request's history tokens
    return total + 3 * 4 * it.num_heads * cfg.interaction_head_dim * cfg.num_query_tokens * merged * n


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


def train_flops(cfg: ModelConfig, offsets: torch.Tensor | Sequence[torch.Tensor],
                cand_offsets: torch.Tensor | None = None) -> int:
    """FLOPs of one training step (fwd + bwd) on a batch with these history offsets [R+1] (one tensor per history,
    schema order; a single tensor for one history) and candidates per request (cand_offsets [R+1]; None: one
    candidate per example), computed as `cfg.candidates` computes them (module doc)."""
    counts = None
    if cand_offsets is not None:
        off = cand_offsets.detach().to("cpu", torch.int64)
        counts = off[1:] - off[:-1]
    return round(float(example_flops(cfg, _history_lengths(cfg, offsets), counts).sum()))
