"""Typed model configuration built from the `model:` section of the Hydra config.

`ModelConfig.from_dict(cfg)` accepts a DictConfig or a plain mapping and fails with one `ConfigError` that names
the offending key (missing, unknown, wrong type or inconsistent with another key).
`validate_against_schema(model_cfg, schema)` checks the tables against the data schema (feature names,
kinds and cardinalities, number of dense features, task names).
"""

from __future__ import annotations

import typing
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

from gem._config import Checker, build, to_plain
from gem._config import ConfigError as _ConfigError

Kernel = Literal["auto", "triton", "reference"]
AttentionKind = Literal["jfa", "swa", "block"]
TableKind = Literal["sequence", "bag"]
Pooling = Literal["sum", "mean"]
Norm = Literal["rmsnorm", "layernorm"]
SeqCombine = Literal["concat", "sum"]
# How a request's candidates meet its history (docs/DATA.md, "Requests"): rows = one tower pass per candidate
# (a request's history is encoded once per candidate); interaction = the tower once per request, every candidate's
# query tokens attend to its output; targets = the candidates appended to the history as HSTU target tokens.
CandidateForm = Literal["rows", "interaction", "targets"]
GDPAActivation = Literal["gelu", "gelu_tanh", "silu", "relu", "relu2", "leaky_relu", "identity"]
KERNELS = typing.get_args(Kernel)
ATTENTION_KINDS = typing.get_args(AttentionKind)
TABLE_KINDS = typing.get_args(TableKind)
POOLINGS = typing.get_args(Pooling)
FFN_KINDS = ("swiglu", "moe")
NORMS = typing.get_args(Norm)
SEQ_COMBINE = typing.get_args(SeqCombine)
GDPA_ACTIVATIONS = typing.get_args(GDPAActivation)
CANDIDATE_FORMS = typing.get_args(CandidateForm)


class ConfigError(_ConfigError):
    """A model config problem; the message starts with the dotted key at fault."""


@dataclass
class TableConfig:
    name: str
    num_embeddings: int
    embedding_dim: int
    features: list[str]
    kind: TableKind = "sequence"  # sequence -> EmbeddingCollection, bag -> EmbeddingBagCollection
    pooling: Pooling = "sum"  # bag tables only
    init_range: float | None = None  # uniform(-r, r); None: torchrec's default sqrt(1 / num_embeddings)


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
    tasks: list[str] = field(default_factory=lambda: ["click", "conversion"])
    weights: list[float] | None = None  # per-task loss weights; None: all 1
    over_arch: list[int] = field(default_factory=lambda: [128])  # shared MLP over the interaction vector
    hidden: list[int] = field(default_factory=lambda: [64])  # per-task MLP


@dataclass
class ModelConfig:
    d_model: int
    num_dense: int
    tables: list[TableConfig]
    tower: TowerConfig = field(default_factory=TowerConfig)
    interaction: InteractionConfig = field(default_factory=InteractionConfig)
    moe: MoEConfig = field(default_factory=MoEConfig)
    heads: HeadConfig = field(default_factory=HeadConfig)
    candidates: CandidateForm = "rows"
    kernel: Kernel = "auto"
    name: str = "gem"

    # -- derived -------------------------------------------------------------------------------------------------
    @property
    def sequence_tables(self) -> list[TableConfig]:
        return [t for t in self.tables if t.kind == "sequence"]

    @property
    def bag_tables(self) -> list[TableConfig]:
        return [t for t in self.tables if t.kind == "bag"]

    @property
    def sequence_features(self) -> list[str]:
        return [f for t in self.sequence_tables for f in t.features]

    @property
    def sparse_features(self) -> list[str]:
        return [f for t in self.bag_tables for f in t.features]

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

    @property
    def interaction_head_dim(self) -> int:
        return self.interaction.head_dim or self.d_model // self.interaction.num_heads

    @property
    def interaction_kv_heads(self) -> int:
        return self.interaction.num_kv_heads or self.interaction.num_heads

    @property
    def num_query_tokens(self) -> int:
        # one per sparse feature + the dense-feature token + a learned summary token
        return len(self.sparse_features) + 2

    @property
    def head_input_dim(self) -> int:
        """Width of the vector the over-arch reads per candidate: the query tokens after the interaction (rows,
        interaction) or the candidate's target token from the tower (targets), and the dense-feature MLP path."""
        tokens = self.d_model if self.candidates == "targets" else self.num_query_tokens * self.d_model
        return tokens + (self.interaction.dense_hidden[-1] if self.interaction.dense_hidden else self.num_dense)

    @property
    def task_weights(self) -> list[float]:
        return list(self.heads.weights) if self.heads.weights is not None else [1.0] * len(self.heads.tasks)

    def is_moe_block(self, i: int) -> bool:
        n = self.tower.moe_every
        return n > 0 and (i + 1) % n == 0

    # -- construction --------------------------------------------------------------------------------------------
    @classmethod
    def from_dict(cls, cfg: Any) -> ModelConfig:
        out = build(cls, cfg, "model", ConfigError)
        out.validate()
        return out

    def validate(self) -> None:
        need = Checker("model", ConfigError).need
        t, it = self.tower, self.interaction
        need(self.d_model > 0, "d_model", "must be > 0", self.d_model)
        need(self.num_dense >= 0, "num_dense", "must be >= 0", self.num_dense)
        need(len(self.tables) > 0, "tables", "at least one table is needed", [])
        names, feats = set(), set()
        for i, tb in enumerate(self.tables):
            k = f"tables[{i}]"
            need(tb.name not in names, f"{k}.name", "duplicate table name", tb.name)
            names.add(tb.name)
            need(tb.num_embeddings > 0, f"{k}.num_embeddings", "must be > 0", tb.num_embeddings)
            need(tb.embedding_dim > 0, f"{k}.embedding_dim", "must be > 0", tb.embedding_dim)
            need(len(tb.features) > 0, f"{k}.features", "at least one feature name is needed", [])
            need(tb.init_range is None or tb.init_range > 0, f"{k}.init_range", "must be > 0 or null", tb.init_range)
            for f in tb.features:
                need(f not in feats, f"{k}.features", "a feature is used by two tables", f)
                feats.add(f)
        kinds = [tb.kind for tb in self.tables]
        need(len(self.sequence_tables) > 0, "tables", "at least one table of kind 'sequence' is needed", kinds)
        need(len(self.bag_tables) > 0, "tables", "at least one table of kind 'bag' is needed", kinds)
        seq_dims = {tb.embedding_dim for tb in self.sequence_tables}
        need(len(seq_dims) == 1, "tables", "sequence tables must share one embedding_dim (an EmbeddingCollection "
             "needs it)", sorted(seq_dims))
        need(t.num_blocks >= 0, "tower.num_blocks", "must be >= 0", t.num_blocks)
        need(t.num_heads > 0, "tower.num_heads", "must be > 0", t.num_heads)
        if t.head_dim is None:
            need(self.d_model % t.num_heads == 0, "tower.num_heads",
                 f"must divide d_model={self.d_model} (or set tower.head_dim)", t.num_heads)
        need(t.head_dim is None or t.head_dim > 0, "tower.head_dim", "must be > 0 or null", t.head_dim)
        need(t.num_kv_heads is None or t.num_kv_heads > 0, "tower.num_kv_heads", "must be > 0 or null",
             t.num_kv_heads)
        need(t.num_heads % self.tower_kv_heads == 0, "tower.num_kv_heads",
             f"must divide num_heads={t.num_heads}", self.tower_kv_heads)
        if t.rope:
            need(self.tower_head_dim % 2 == 0, "tower.head_dim", "rope needs an even head dim", self.tower_head_dim)
            need(t.rope_base > 0, "tower.rope_base", "must be > 0", t.rope_base)
        need(t.window is None or t.window > 0, "tower.window", "must be > 0 or null", t.window)
        need(t.block_size is None or t.block_size > 0, "tower.block_size", "must be > 0 or null", t.block_size)
        if t.attention == "swa":
            need(t.window is not None, "tower.window", "attention 'swa' needs a window > 0", t.window)
        if t.attention == "block":
            need(t.block_size is not None, "tower.block_size", "attention 'block' needs a block_size > 0",
                 t.block_size)
        if self.candidates == "targets":
            need(t.attention != "block", "candidates", "target tokens need the tower's attention to be jfa or swa "
                 "(block attention has no target mask)", self.candidates)
        need(t.d_ff >= 0, "tower.d_ff", "must be >= 0 (0: 4 * d_model)", t.d_ff)
        need(t.moe_every >= 0, "tower.moe_every", "must be >= 0 (0: no MoE)", t.moe_every)
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
        need(len(self.heads.tasks) >= 1, "heads.tasks", "at least one task is needed", [])
        need(len(set(self.heads.tasks)) == len(self.heads.tasks), "heads.tasks", "duplicate task names",
             self.heads.tasks)
        if self.heads.weights is not None:
            need(len(self.heads.weights) == len(self.heads.tasks), "heads.weights",
                 f"one weight per task ({len(self.heads.tasks)})", self.heads.weights)
            need(all(w >= 0 for w in self.heads.weights), "heads.weights", "weights must be >= 0",
                 self.heads.weights)
        for key, dims in (("heads.over_arch", self.heads.over_arch), ("heads.hidden", self.heads.hidden),
                          ("interaction.dense_hidden", it.dense_hidden)):
            need(all(d > 0 for d in dims), key, "layer sizes must be > 0", dims)


# ------------------------------------------------------------------------------------------------------------------
# Schema check


def _schema_get(schema: Any, key: str) -> Any:
    if isinstance(schema, Mapping):
        return schema.get(key)
    return getattr(schema, key, None)


def _feature_cardinalities(entries: Any, where: str) -> dict[str, int | None]:
    """Normalise a schema feature list: {name: spec} mapping, or a list of names / {name, num_embeddings}."""
    out: dict[str, int | None] = {}
    if entries is None:
        return out
    if isinstance(entries, Mapping):
        items = list(entries.items())
    else:
        items = []
        for e in entries:
            if isinstance(e, str):
                items.append((e, None))
            else:
                name = _schema_get(e, "name")
                if name is None:
                    raise ConfigError(f"data.schema.{where}", "an entry has no name", e)
                items.append((name, e))
    for name, spec in items:
        n = spec if isinstance(spec, int) else (None if spec is None else _schema_get(spec, "num_embeddings"))
        out[str(name)] = None if n is None else int(n)
    return out


def validate_against_schema(model_cfg: ModelConfig, schema: Any) -> None:
    """Fail with one ConfigError if the model's tables / dense width / tasks disagree with the data schema.

    `schema` is the data config's `schema:` (DictConfig / mapping) or an object with the same attributes
    (`sequence_features`, `sparse_features`, `num_dense`, `tasks`).
    """
    schema = to_plain(schema)
    if isinstance(schema, Mapping) and "num_items" in schema:
        # A raw `schema:` mapping: let the data layer fill defaults (hist_item / cand_item cardinalities).
        from gem.data.schema import DataSchema

        schema = DataSchema.from_dict(schema)
    seq = _feature_cardinalities(_schema_get(schema, "sequence_features"), "sequence_features")
    sparse = _feature_cardinalities(_schema_get(schema, "sparse_features"), "sparse_features")
    for i, tb in enumerate(model_cfg.tables):
        pool, other, kind_name = (seq, sparse, "sequence_features") if tb.kind == "sequence" else (
            sparse, seq, "sparse_features")
        for f in tb.features:
            if f not in pool:
                hint = f" (it is one of the schema's {'sparse' if f in other else 'sequence'} features)" \
                    if f in other else ""
                raise ConfigError(f"model.tables[{i}].features", f"a {tb.kind} table's feature must be one of "
                                  f"data.schema.{kind_name} {sorted(pool)}{hint}", f)
            n = pool[f]
            if n is not None and n > tb.num_embeddings:
                raise ConfigError(f"model.tables[{i}].num_embeddings", f"must be >= the cardinality {n} of feature "
                                  f"{f!r} in the data schema", tb.num_embeddings)
    missing = [f for f in seq if f not in model_cfg.sequence_features]
    if missing:
        raise ConfigError("model.tables", "the data schema's sequence features need a table", missing)
    missing = [f for f in sparse if f not in model_cfg.sparse_features]
    if missing:
        raise ConfigError("model.tables", "the data schema's sparse features need a table", missing)
    nd = _schema_get(schema, "num_dense")
    if nd is not None and int(nd) != model_cfg.num_dense:
        raise ConfigError("model.num_dense", f"must equal data.schema.num_dense={nd}", model_cfg.num_dense)
    tasks = _schema_get(schema, "tasks")
    if tasks is not None and list(tasks) != list(model_cfg.heads.tasks):
        raise ConfigError("model.heads.tasks", f"must equal data.schema.tasks={list(tasks)}", model_cfg.heads.tasks)
