"""Dense memory per rank under the HSDP / expert-parallel layout, counted from the model built on the meta device.

FSDP units are those gem.parallel.fsdp makes: each MoE layer (over the expert mesh), each transformer block
(without its MoE), and the root (every other dense parameter; the tables are TorchRec's). A parameter sharded
over s ranks keeps ceil(dim/s) slices of its shard dim on every rank (FSDP2 pads the dim to a multiple of s).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import torch

from gem.model.config import ModelConfig
from gem.model.precision import DEFAULT_FILTER
from gem.parallel.dims import ActivationCheckpointConfig, ParallelConfig
from gem.parallel.fsdp import FP8_GATHER_BYTES

_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}
EXPERT_WEIGHTS = ("w1", "w3", "w2")


@dataclass
class FsdpUnit:
    name: str
    shapes: list[tuple[int, ...]]  # full shapes of the unit's parameters
    expert: bool = False  # an MoE layer: w1/w3/w2 split over ep first, FSDP over the expert mesh
    reshard: bool = True  # all-gathered again in backward when reshard_after_forward is on (not the last block)
    fp8: tuple[bool, ...] = ()  # per parameter: a BlockFP8Linear weight (train.precision=fp8_block)

    def _shard_shapes(self, shard: int, ep: int = 1, dp_replicate: int = 1) -> list[list[int]]:
        few = False
        if self.expert:
            num_experts = self.shapes[-1][0]
            few = num_experts // ep < dp_replicate * shard  # gem.parallel.fsdp shards the hidden dim then
        out = []
        for i, s in enumerate(self.shapes):
            s = list(s)
            is_w = self.expert and i >= len(self.shapes) - 3
            if is_w:
                s[0] //= ep
            dim = 1 if (is_w and few) else 0
            s[dim] = math.ceil(s[dim] / shard)
            out.append(s)
        return out

    def shard_numel(self, shard: int, ep: int = 1, dp_replicate: int = 1) -> int:
        """Elements this unit keeps per rank when FSDP-sharded over `shard` ranks (padding included)."""
        return sum(math.prod(s) for s in self._shard_shapes(shard, ep, dp_replicate))

    def numel(self) -> int:
        return sum(math.prod(s) for s in self.shapes)

    def fp8_gathered(self, i: int, shard: int) -> bool:
        """Parameter i is all-gathered as FP8 codes + tile scales over `shard` ranks (gem.parallel.fsdp's rule)."""
        from gem.parallel.fsdp import fp8_all_gather_reason

        return (shard > 1 and i < len(self.fp8) and self.fp8[i]
                and fp8_all_gather_reason(self.shapes[i][0], shard, True) is None)

    def gather_bytes(self, shard: int, param_bytes: int, ep: int = 1, dp_replicate: int = 1) -> float:
        """Bytes one all-gather of this unit over `shard` ranks assembles: param_bytes an element, FP8_GATHER_BYTES for
        the weights gathered in FP8."""
        return shard * sum(math.prod(s) * (FP8_GATHER_BYTES if self.fp8_gathered(i, shard) else param_bytes)
                           for i, s in enumerate(self._shard_shapes(shard, ep, dp_replicate)))

    def unsharded_bytes(self, shard: int, param_bytes: int, ep: int = 1) -> float:
        """Bytes of the unit while gathered: an FP8-gathered weight holds its codes, W^T's codes and the scales."""
        shapes = self._shard_shapes(1, ep, 1) if self.expert else self.shapes
        return sum(math.prod(s) * (1 + FP8_GATHER_BYTES if self.fp8_gathered(i, shard) else param_bytes)
                   for i, s in enumerate(shapes))

    def fp8_cache_bytes(self, shard: int) -> float:
        """The cached FP8 copy (codes, W^T's codes, scales) that a BlockFP8Linear weight not gathered in FP8 keeps for
        the whole step, unsharded (gem.model.precision's per-step weight cache)."""
        return sum(math.prod(s) * (1 + FP8_GATHER_BYTES) for i, s in enumerate(self.shapes)
                   if i < len(self.fp8) and self.fp8[i] and not self.fp8_gathered(i, shard))


def fsdp_units(cfg: ModelConfig, ep: int = 1, precision: str = "bf16",
               precision_filter: Sequence[str] = DEFAULT_FILTER) -> list[FsdpUnit]:
    """FSDP units of the GEM model, root first, then blocks, then (ep > 1) the MoE layers; parameters in
    registration order. Without expert parallelism an MoE layer belongs to its block's unit. Under
    precision=fp8_block each unit marks the weights of the layers that become BlockFP8Linear."""
    from gem.model import GEMModel
    from gem.model.moe import MoE
    from gem.model.precision import linear_targets

    with torch.device("meta"):
        model = GEMModel(cfg, embedding_device="meta")
    fp8_ids: set[int] = set()
    if precision == "fp8_block":
        fp8_ids = {id(model.get_submodule(n).weight) for n in linear_targets(model, precision, precision_filter)[1]}

    def unit(name: str, ps: list, **kw) -> FsdpUnit:
        return FsdpUnit(name, [tuple(p.shape) for p in ps], fp8=tuple(id(p) in fp8_ids for p in ps), **kw)

    tables = {id(p) for m in model.embedding_collections() for p in m.parameters()}
    blocks = model.blocks
    units: list[FsdpUnit] = []
    taken: set[int] = set(tables)
    inner: list[FsdpUnit] = []
    for i, block in enumerate(blocks):
        moes = [m for m in block.modules() if isinstance(m, MoE)] if ep > 1 else []
        for m in moes:
            other = [p for n, p in m.named_parameters() if n.split(".")[-1] not in EXPERT_WEIGHTS]
            ws = [getattr(m, n) for n in EXPERT_WEIGHTS]
            inner.append(unit(f"blocks.{i}.moe", other + ws, expert=True))
            taken.update(id(p) for p in m.parameters())
        ps = [p for p in block.parameters() if id(p) not in taken]
        taken.update(id(p) for p in ps)
        units.append(unit(f"blocks.{i}", ps, reshard=i < len(blocks) - 1))
    root = [p for p in model.parameters() if id(p) not in taken]
    # the root's heads run last in forward, yet it is resharded and gathered again when backward starts
    return [unit("root", root), *units, *inner]


def peak_gathered_bytes(units: list[FsdpUnit], param_bytes: int, shard: int, ep: int = 1) -> float:
    """Bytes unsharded at once with reshard_after_forward on: the peak is in backward, where FSDP2 keeps the root
    gathered, runs block i (and its MoE unit) and has already prefetched block i - 1, the next in backward order."""
    def size(u: FsdpUnit) -> float:
        return u.unsharded_bytes(shard // ep if u.expert else shard, param_bytes, ep)

    blocks = [u for u in units[1:] if not u.expert]
    moe = {u.name[: -len(".moe")]: size(u) for u in units if u.expert}
    peak = 0.0
    for i, b in enumerate(blocks):
        prev = size(blocks[i - 1]) if i > 0 else 0
        peak = max(peak, size(b) + moe.get(b.name, 0) + prev)
    return size(units[0]) + peak


@dataclass
class DenseMemory:
    """Bytes per rank of the dense part."""

    params: int
    grads: int
    optimizer: int
    gathered: int  # unsharded units alive at once (the root, the current block and its MoE, the prefetched block)
    activations: int  # estimate: tensors saved for backward over the rank's history tokens
    detail: dict[str, int] = field(default_factory=dict)

    @property
    def total(self) -> int:
        return self.params + self.grads + self.optimizer + self.gathered + self.activations


def block_saved_bytes_per_token(cfg: ModelConfig, i: int, act_bytes: int, history: str | None = None) -> float:
    """Bytes one token of `history` (None: the first) keeps for backward in block `i` of its tower (what autograd
    saves in the eager block).

    Each norm: its input and output (act) and 1/rms (fp32). Attention: the QKV projection's input and output (q, k
    and v are views of it), RoPE's rotated copies of q and k (jfa / swa), the kernel's output and its fp32
    log-sum-exp per head. SwiGLU: its input, w1 and w3 outputs, silu(w1) and the product (d + 4 d_ff). MoE: the
    router's input, its fp32 probabilities, the top_k routed rows in and out (2d each) with each expert's SwiGLU
    (4 d_ff), the fp32 gates and the int64 routing indices.
    """
    t = cfg.tower_for(history or cfg.histories[0])
    d, h, hk, dh = cfg.d_model, t.num_heads, t.num_kv_heads, t.head_dim
    norm = act_bytes * 2 * d + 4
    attn = act_bytes * (d + (h + 2 * hk) * dh + h * dh) + 4 * h
    if t.rope and t.attention != "block":
        attn += act_bytes * (h + hk) * dh
    if cfg.is_moe_block(i, t):
        k, e = cfg.moe.top_k, cfg.moe.num_experts
        ffn = act_bytes * (d + k * (2 * d + 4 * cfg.moe_d_ff_for(t))) + 4 * (e + 2 * k + 1) + 8 * 2 * k
    else:
        ffn = act_bytes * (d + 4 * t.d_ff)
    return 2 * norm + attn + ffn


def activation_bytes_per_token(cfg: ModelConfig, act_bytes: int, checkpoint: str = "none", ac_every: int = 1,
                               history: str | None = None) -> float:
    """What one token of `history` (None: the first) keeps for backward at the peak (the start of backward through
    its tower).

    The blocks (block_saved_bytes_per_token); a checkpointed block keeps only its input (d) and is recomputed in
    backward one at a time, so the largest checkpointed block comes on top. Around the blocks: the lookups' int64
    ids, the concatenated embeddings (fp32) that the input projection keeps, the final norm, and the interaction's
    K/V projection of the tower output (its input, k and v).
    """
    history = history or cfg.histories[0]
    d = cfg.d_model
    kept, recompute = 0.0, 0.0
    for i in range(cfg.tower_for(history).num_blocks):
        b = block_saved_bytes_per_token(cfg, i, act_bytes, history)
        if checkpoint == "full" or (checkpoint == "selective" and i % ac_every == 0):
            kept += act_bytes * d
            recompute = max(recompute, b)
        else:
            kept += b
    feats = cfg.history_features(history)
    seq_in = sum(cfg.embedding_dim(f) for f in feats)
    around = 8 * len(feats) + 4 * seq_in + (act_bytes * 2 * d + 4) \
        + act_bytes * (d + 2 * cfg.interaction_kv_heads * cfg.interaction_head_dim)
    return kept + recompute + around


def dense_memory(units: list[FsdpUnit], cfg: ModelConfig, par: ParallelConfig, tokens: int | Mapping[str, int],
                 act_bytes: int, ac: ActivationCheckpointConfig | None = None, param_dtype: str = "fp32"
                 ) -> DenseMemory:
    """Per-rank dense bytes for a validated `par` (dp_shard resolved); `tokens`: history tokens per rank (per
    history: each history's tokens through its own tower; an int: all through the first history's); `ac`: the
    activation checkpointing (None: none); `param_dtype`: FSDP's, of the gathered parameters."""
    ac = ac or ActivationCheckpointConfig()
    fsdp = par.dense == "fsdp"
    s = par.dp_shard if fsdp else 1
    ep = par.ep
    s_exp = par.dp_shard // ep if fsdp else 1
    rep = par.dp_replicate
    shard = sum(u.shard_numel(s_exp, ep, rep) if u.expert else u.shard_numel(s) for u in units)
    p_bytes = _BYTES[param_dtype]
    # AdamW: fp32 params, fp32 grads, exp_avg + exp_avg_sq
    params, grads, optim = 4 * shard, 4 * shard, 8 * shard
    if fsdp and par.reshard_after_forward:
        gathered = peak_gathered_bytes(units, p_bytes, s, ep)
    elif fsdp:  # nothing resharded until backward: every unit stays gathered
        gathered = sum(u.unsharded_bytes(s_exp if u.expert else s, p_bytes, ep) for u in units)
    else:
        gathered = 0
    # fp8_block's per-step FP8 weight copies (none for the weights FSDP2 gathers in FP8)
    gathered = int(gathered + sum(u.fp8_cache_bytes(s) for u in units))
    per_history = tokens if isinstance(tokens, Mapping) else {cfg.histories[0]: tokens}
    acts = int(sum(n * activation_bytes_per_token(cfg, act_bytes, ac.mode, ac.every, h)
                   for h, n in per_history.items()))
    return DenseMemory(params=params, grads=grads, optimizer=optim, gathered=gathered, activations=acts,
                       detail={"shard_numel": shard, "total_numel": sum(u.numel() for u in units)})
