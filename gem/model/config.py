"""Typed model configuration built from the `model:` section of the Hydra config.

The model group holds the architecture only; its inputs (features, histories, tables, tasks) are the data
group's (gem.data.schema.Schema). `ModelConfig.from_dict(cfg, schema)` accepts a DictConfig or a plain mapping and
fails with one `ConfigError` that names the offending key (missing, unknown, wrong type or inconsistent with
another key or with the schema, e.g. a task weight for a task the labels lack).

Several histories: each gets its own tower; `towers.<history>` overrides keys of the default `tower` for one
history (e.g. BlockAttention on a long history, JFA on a short one). `history_merge: time` instead merges every
example's histories into one sequence ordered by event time (each history declares a timestamp column) under one
tower.
"""

from __future__ import annotations

import dataclasses
import typing
from dataclasses import dataclass, field
from typing import Any, Literal

from gem.config import Checker, build, to_plain
from gem.config import ConfigError as _ConfigError
from gem.data.schema import EmbeddingTable, Schema

Kernel = Literal["auto", "triton", "reference"]
AttentionKind = Literal["jfa", "swa", "block"]
Norm = Literal["rmsnorm", "layernorm"]
SeqCombine = Literal["concat", "sum"]
# How a request's candidates meet its history (docs/DATA.md, "Requests"): rows = one tower pass per candidate
# (a request's history is encoded once per candidate); interaction = the tower once per request, every candidate's
# query tokens attend to its output; targets = the candidates appended to the history as HSTU target tokens.
CandidateForm = Literal["rows", "interaction", "targets"]
GDPAActivation = Literal["gelu", "gelu_tanh", "silu", "relu", "relu2", "leaky_relu", "identity"]
KERNELS = typing.get_args(Kernel)
ATTENTION_KINDS = typing.get_args(AttentionKind)
FFN_KINDS = ("swiglu", "moe")
NORMS = typing.get_args(Norm)
SEQ_COMBINE = typing.get_args(SeqCombine)
GDPA_ACTIVATIONS = typing.get_args(GDPAActivation)
CANDIDATE_FORMS = typing.get_args(CandidateForm)


class ConfigError(_ConfigError):
    """A model config problem; the message starts with the dotted key at fault."""


# What the old form's model keys became (one line each, raised as a ConfigError).
OLD_MODEL_KEYS = {
    "tables": "moved to data.tables (each feature names its table: data.features.<name>.table)",
    "num_dense": "the dense width is the data's: the sizes of data.features of kind dense",
    "heads.tasks": "the tasks are data.labels' keys (task -> column), in head order",
}

@dataclass
class MoEConfig:
    num_experts: int = 8
    top_k: int = 2
    d_ff: int = 0  # 0: the tower's d_ff
    capacity_factor: float | None = None  # None: dropless
    aux_loss_coef: float = 0.01
    # expert FFNs as one torch._grouped_mm per weight (None: wherever available, i.e. CUDA in bf16) instead of a
    # loop over experts
    grouped_mm: bool | None = None


@dataclass
class TowerConfig:
    num_blocks: int = 2
    num_heads: int = 2
    num_kv_heads: int | None = None  # None: num_heads (no GQA)
    head_dim: int | None = None  # None: d_model // num_heads
    attention: AttentionKind = "jfa"  # jfa (causal) | swa (causal, sliding window) | block (block-diagonal causal)
    window: int | None = None  # swa: keys visible to the left of each query (FlashAttention's left window)
    block_size: int | None = None  # block: tokens per attention block
    rope: bool = True
    rope_base: float = 10000.0
    d_ff: int = 0  # 0: 4 * d_model
    moe_every: int = 0  # every n-th block (1-based: blocks n-1, 2n-1, ...) uses an MoE FFN; 0: none
    seq_combine: SeqCombine = "concat"  # how sequence features' embeddings merge before the input projection
    norm: Norm = "rmsnorm"


@dataclass
class InteractionConfig:
    num_heads: int = 2
    head_dim: int | None = None  # None: d_model // num_heads
    num_kv_heads: int | None = None
    activation: GDPAActivation = "gelu"
    approx: Literal["poly6"] | None = None
    normalize: float | str | None = None  # GDPA output divisor (None, a number or "max_len_k")
    dense_hidden: list[int] = field(default_factory=lambda: [64])  # dense-feature MLP path


@dataclass
class HeadConfig:
    weights: dict[str, float] | None = None  # task -> loss weight; unnamed tasks (or None): 1
    over_arch: list[int] = field(default_factory=lambda: [128])  # shared MLP over the interaction vector
    hidden: list[int] = field(default_factory=lambda: [64])  # per-task MLP


@dataclass
class ModelConfig:
    d_model: int
    tower: TowerConfig = field(default_factory=TowerConfig)
    towers: dict[str, dict] = field(default_factory=dict)  # history -> keys of `tower` overridden for its tower
    # towers: a tower per history | time: the histories merged into one time-ordered sequence, one tower (`tower`)
    history_merge: Literal["towers", "time"] = "towers"
    interaction: InteractionConfig = field(default_factory=InteractionConfig)
    moe: MoEConfig = field(default_factory=MoEConfig)
    heads: HeadConfig = field(default_factory=HeadConfig)
    candidates: CandidateForm = "rows"
    kernel: Kernel = "auto"
    name: str = "gem"

    # -- inputs (from the data schema) ------------------------------------------------------------------------------
    schema: Schema | None = field(default=None, repr=False, compare=False)

    def _inputs(self) -> Schema:
        if self.schema is None:
            raise ConfigError("model", "the model's inputs come from the data group: build it with "
                              "ModelConfig.from_dict(model_cfg, schema)")
        return self.schema

    @property
    def tables(self) -> list[EmbeddingTable]:
        return self._inputs().embedding_tables

    @property
    def sequence_tables(self) -> list[EmbeddingTable]:
        """The EmbeddingCollection's tables (sequence and candidate features)."""
        return [t for t in self.tables if t.kind == "sequence"]

    @property
    def bag_tables(self) -> list[EmbeddingTable]:
        return [t for t in self.tables if t.kind == "bag"]

    @property
    def histories(self) -> list[str]:
        return self._inputs().history_names

    def history_features(self, history: str) -> list[str]:
        return self._inputs().history_features(history)

    @property
    def sequence_features(self) -> list[str]:
        """Every history's sequence features (history by history)."""
        return self._inputs().sequence_names

    @property
    def candidate_features(self) -> list[str]:
        return self._inputs().candidate_names

    @property
    def sparse_features(self) -> list[str]:
        """The pooled (EmbeddingBagCollection) features."""
        return self._inputs().sparse_names

    @property
    def query_features(self) -> list[str]:
        """Candidate and sparse features, one query token each, in declaration order."""
        return self._inputs().query_names

    def embedding_dim(self, feature: str) -> int:
        return self._inputs().embedding_dim(feature)

    @property
    def num_dense(self) -> int:
        return self._inputs().num_dense

    @property
    def tasks(self) -> list[str]:
        return list(self._inputs().tasks)

    def tower_for(self, history: str | None = None) -> TowerConfig:
        """The tower of one history (the default tower with `towers.<history>` applied), head_dim, num_kv_heads
        and d_ff resolved."""
        t = self.tower
        if history is not None and history in self.towers:
            t = build(TowerConfig, {**dataclasses.asdict(t), **self.towers[history]}, f"model.towers.{history}",
                      ConfigError)
        return dataclasses.replace(t, head_dim=t.head_dim or self.d_model // t.num_heads,
                                   num_kv_heads=t.num_kv_heads or t.num_heads, d_ff=t.d_ff or 4 * self.d_model)

    @property
    def tower_head_dim(self) -> int:
        return self.tower.head_dim or self.d_model // self.tower.num_heads

    @property
    def tower_kv_heads(self) -> int:
        return self.tower.num_kv_heads or self.tower.num_heads

    @property
    def tower_d_ff(self) -> int:
        return self.tower.d_ff or 4 * self.d_model

    @property
    def moe_d_ff(self) -> int:
        return self.moe.d_ff or self.tower_d_ff

    def moe_d_ff_for(self, tower: TowerConfig) -> int:
        return self.moe.d_ff or tower.d_ff or 4 * self.d_model

    @property
    def interaction_head_dim(self) -> int:
        return self.interaction.head_dim or self.d_model // self.interaction.num_heads

    @property
    def interaction_kv_heads(self) -> int:
        return self.interaction.num_kv_heads or self.interaction.num_heads

    @property
    def num_query_tokens(self) -> int:
        # one per candidate / sparse feature + the dense-feature token + a learned summary token
        return len(self.query_features) + 2

    @property
    def head_input_dim(self) -> int:
        """Width of the vector the over-arch reads per candidate: the query tokens after the interaction (rows,
        interaction) or the candidate's target token from the tower (targets), and the dense-feature MLP path."""
        tokens = self.d_model if self.candidates == "targets" else self.num_query_tokens * self.d_model
        return tokens + (self.interaction.dense_hidden[-1] if self.interaction.dense_hidden else self.num_dense)

    @property
    def towers_built(self) -> list[str | None]:
        """The towers the model builds: one per history, or one (None) over the histories merged by time."""
        return [None] if self.merged else list(self.histories)

    @property
    def task_weights(self) -> list[float]:
        w = self.heads.weights or {}
        return [float(w.get(t, 1.0)) for t in self.tasks]

    def is_moe_block(self, i: int, tower: TowerConfig | None = None) -> bool:
        """Block i (0-based, inside its tower) has an MoE FFN."""
        n = (tower or self.tower).moe_every
        return n > 0 and (i + 1) % n == 0

    @property
    def merged(self) -> bool:
        """Several histories merged by time into one sequence under one tower."""
        return self.history_merge == "time"

    # -- construction --------------------------------------------------------------------------------------------
    @classmethod
    def from_dict(cls, cfg: Any, schema: Schema | Any = None) -> ModelConfig:
        """The model group `cfg` over the data group's inputs (`schema`: a Schema or the data group mapping)."""
        d = to_plain(cfg)
        if isinstance(d, dict):
            for key, what in OLD_MODEL_KEYS.items():
                top, _, sub = key.partition(".")
                if (sub and isinstance(d.get(top), dict) and sub in d[top]) or (not sub and key in d):
                    raise ConfigError(f"model.{key}", what)
            if isinstance((d.get("heads") or {}).get("weights"), list):
                raise ConfigError("model.heads.weights", "a mapping task -> weight (tasks are data.labels' keys)",
                                  d["heads"]["weights"])
        out = build(cls, {k: v for k, v in d.items() if k != "schema"} if isinstance(d, dict) else d, "model",
                    ConfigError)
        if schema is not None and not isinstance(schema, Schema):
            schema = Schema.from_dict(schema)
        out.schema = schema
        out.validate()
        return out

    def validate(self) -> None:
        need = Checker("model", ConfigError).need
        it = self.interaction
        need(self.d_model > 0, "d_model", "must be > 0", self.d_model)
        self._validate_tower(self.tower, "tower")
        if self.schema is not None:
            hists = self.histories
            for h in self.towers:
                need(h in hists, f"towers.{h}", f"no such history in data.histories ({', '.join(hists)})", h)
            for h in self.towers:
                self._validate_tower(self.tower_for(h), f"towers.{h}")
            if self.merged:
                need(self.schema.has_times, "history_merge", "merging by time needs a timestamp column for every "
                     "history (data.histories.<name>.timestamp)", [h for h in hists if not self.schema.history[h].timestamp])
                need(not self.towers, "history_merge", "merged histories share the one tower `model.tower` (drop "
                     "model.towers)", sorted(self.towers))
            if self.candidates == "targets":
                need(len(self.towers_built) == 1, "candidates", "target tokens join one tower: use one history "
                     "or model.history_merge=time", self.histories)
                t = self.tower_for(None if self.merged else self.histories[0])
                need(t.attention != "block", "candidates", "target tokens need the tower's attention to be jfa or "
                     "swa (block attention has no target mask)", t.attention)
            if self.heads.weights:
                for task in self.heads.weights:
                    need(task in self.tasks, f"heads.weights.{task}",
                         f"no such task in data.labels ({', '.join(self.tasks)})", task)
        m = self.moe
        need(m.num_experts > 0, "moe.num_experts", "must be > 0", m.num_experts)
        need(0 < m.top_k <= m.num_experts, "moe.top_k", f"must be in [1, moe.num_experts={m.num_experts}]", m.top_k)
        need(m.d_ff >= 0, "moe.d_ff", "must be >= 0 (0: the tower's d_ff)", m.d_ff)
        need(m.capacity_factor is None or m.capacity_factor > 0, "moe.capacity_factor", "must be > 0 or null",
             m.capacity_factor)
        need(m.aux_loss_coef >= 0, "moe.aux_loss_coef", "must be >= 0", m.aux_loss_coef)
        need(it.num_heads > 0, "interaction.num_heads", "must be > 0", it.num_heads)
        if it.head_dim is None:
            need(self.d_model % it.num_heads == 0, "interaction.num_heads",
                 f"must divide d_model={self.d_model} (or set interaction.head_dim)", it.num_heads)
        need(it.head_dim is None or it.head_dim > 0, "interaction.head_dim", "must be > 0 or null", it.head_dim)
        need(it.num_kv_heads is None or it.num_kv_heads > 0, "interaction.num_kv_heads", "must be > 0 or null",
             it.num_kv_heads)
        need(it.num_heads % self.interaction_kv_heads == 0, "interaction.num_kv_heads",
             f"must divide num_heads={it.num_heads}", self.interaction_kv_heads)
        nz = it.normalize
        need(nz is None or nz == "max_len_k" or (not isinstance(nz, (str, bool)) and nz > 0),
             "interaction.normalize", "must be null, max_len_k or a number > 0", nz)
        if self.heads.weights is not None:
            need(all(w >= 0 for w in self.heads.weights.values()), "heads.weights", "weights must be >= 0",
                 self.heads.weights)
        for key, dims in (("heads.over_arch", self.heads.over_arch), ("heads.hidden", self.heads.hidden),
                          ("interaction.dense_hidden", it.dense_hidden)):
            need(all(d > 0 for d in dims), key, "layer sizes must be > 0", dims)

    def _validate_tower(self, t: TowerConfig, key: str) -> None:
        need = Checker("model", ConfigError).need
        need(t.num_blocks >= 0, f"{key}.num_blocks", "must be >= 0", t.num_blocks)
        need(t.num_heads > 0, f"{key}.num_heads", "must be > 0", t.num_heads)
        if t.head_dim is None:
            need(self.d_model % t.num_heads == 0, f"{key}.num_heads",
                 f"must divide d_model={self.d_model} (or set {key}.head_dim)", t.num_heads)
        need(t.head_dim is None or t.head_dim > 0, f"{key}.head_dim", "must be > 0 or null", t.head_dim)
        need(t.num_kv_heads is None or t.num_kv_heads > 0, f"{key}.num_kv_heads", "must be > 0 or null",
             t.num_kv_heads)
        kv = t.num_kv_heads or t.num_heads
        need(t.num_heads % kv == 0, f"{key}.num_kv_heads", f"must divide num_heads={t.num_heads}", kv)
        if t.rope:
            hd = t.head_dim or self.d_model // t.num_heads
            need(hd % 2 == 0, f"{key}.head_dim", "rope needs an even head dim", hd)
            need(t.rope_base > 0, f"{key}.rope_base", "must be > 0", t.rope_base)
        need(t.window is None or t.window > 0, f"{key}.window", "must be > 0 or null", t.window)
        need(t.block_size is None or t.block_size > 0, f"{key}.block_size", "must be > 0 or null", t.block_size)
        if t.attention == "swa":
            need(t.window is not None, f"{key}.window", "attention 'swa' needs a window > 0", t.window)
        if t.attention == "block":
            need(t.block_size is not None, f"{key}.block_size", "attention 'block' needs a block_size > 0",
                 t.block_size)
        need(t.d_ff >= 0, f"{key}.d_ff", "must be >= 0 (0: 4 * d_model)", t.d_ff)
        need(t.moe_every >= 0, f"{key}.moe_every", "must be >= 0 (0: no MoE)", t.moe_every)
