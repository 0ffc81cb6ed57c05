"""Typed model configuration built from the `model:` section of the Hydra config.

`ModelConfig.from_dict(cfg)` accepts a DictConfig or a plain mapping and fails with one `ConfigError` that names
the offending key (missing, unknown, wrong type or inconsistent with another key).
`validate_against_schema(model_cfg, schema)` checks the tables against the data schema (feature names,
kinds and cardinalities, number of dense features, task names).
"""

from __future__ import annotations

import dataclasses
import types
import typing
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from gem._config import to_plain

KERNELS = ("auto", "triton", "reference")
ATTENTION_KINDS = ("jfa", "swa", "block")
TABLE_KINDS = ("sequence", "bag")
POOLINGS = ("sum", "mean")
FFN_KINDS = ("swiglu", "moe")
NORMS = ("rmsnorm", "layernorm")
SEQ_COMBINE = ("concat", "sum")
GDPA_ACTIVATIONS = ("gelu", "gelu_tanh", "silu", "relu", "relu2", "leaky_relu", "identity")


class ConfigError(ValueError):
    """A model config problem; the message starts with the dotted key at fault."""


@dataclass
class TableConfig:
    name: str
    num_embeddings: int
    embedding_dim: int
    features: list[str]
    kind: str = "sequence"  # sequence -> EmbeddingCollection, bag -> EmbeddingBagCollection
    pooling: str = "sum"  # bag tables only
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
    attention: str = "jfa"  # jfa (causal) | swa (causal, sliding window) | block (block-diagonal causal)
    window: int | None = None  # swa: keys visible to the left of each query (FlashAttention's left window)
    block_size: int | None = None  # block: tokens per attention block
    rope: bool = True
    rope_base: float = 10000.0
    d_ff: int = 0  # 0: 4 * d_model
    moe_every: int = 0  # every n-th block (1-based: blocks n-1, 2n-1, ...) uses an MoE FFN; 0: none
    seq_combine: str = "concat"  # how sequence features' embeddings merge before the input projection
    norm: str = "rmsnorm"


@dataclass
class InteractionConfig:
    num_heads: int = 2
    head_dim: int | None = None  # None: d_model // num_heads
    num_kv_heads: int | None = None
    activation: str = "gelu"
    approx: str | None = None  # None | "poly6"
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
    kernel: str = "auto"
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
    def task_weights(self) -> list[float]:
        return list(self.heads.weights) if self.heads.weights is not None else [1.0] * len(self.heads.tasks)

    def is_moe_block(self, i: int) -> bool:
        n = self.tower.moe_every
        return n > 0 and (i + 1) % n == 0

    # -- construction --------------------------------------------------------------------------------------------
    @classmethod
    def from_dict(cls, cfg: Any) -> ModelConfig:
        data = to_plain(cfg)
        if not isinstance(data, Mapping):
            raise ConfigError(f"model: expected a mapping, got {type(data).__name__}")
        out = _build(cls, data, "model")
        out.validate()
        return out

    def validate(self) -> None:
        def need(ok: bool, key: str, msg: str) -> None:
            if not ok:
                raise ConfigError(f"model.{key}: {msg}")

        t, it = self.tower, self.interaction
        need(self.d_model > 0, "d_model", f"must be > 0, got {self.d_model}")
        need(self.num_dense >= 0, "num_dense", f"must be >= 0, got {self.num_dense}")
        need(self.kernel in KERNELS, "kernel", f"{self.kernel!r} not in {KERNELS}")
        need(len(self.tables) > 0, "tables", "at least one table is needed")
        names, feats = set(), set()
        for i, tb in enumerate(self.tables):
            k = f"tables[{i}]"
            need(tb.name not in names, f"{k}.name", f"duplicate table name {tb.name!r}")
            names.add(tb.name)
            need(tb.kind in TABLE_KINDS, f"{k}.kind", f"{tb.kind!r} not in {TABLE_KINDS}")
            need(tb.num_embeddings > 0, f"{k}.num_embeddings", f"must be > 0, got {tb.num_embeddings}")
            need(tb.embedding_dim > 0, f"{k}.embedding_dim", f"must be > 0, got {tb.embedding_dim}")
            need(len(tb.features) > 0, f"{k}.features", "at least one feature name is needed")
            need(tb.pooling in POOLINGS, f"{k}.pooling", f"{tb.pooling!r} not in {POOLINGS}")
            need(tb.init_range is None or tb.init_range > 0, f"{k}.init_range", "must be > 0 or null")
            for f in tb.features:
                need(f not in feats, f"{k}.features", f"feature {f!r} is used by two tables")
                feats.add(f)
        need(len(self.sequence_tables) > 0, "tables", "at least one table of kind 'sequence' is needed")
        need(len(self.bag_tables) > 0, "tables", "at least one table of kind 'bag' is needed")
        seq_dims = {tb.embedding_dim for tb in self.sequence_tables}
        need(len(seq_dims) == 1, "tables", f"sequence tables must share one embedding_dim (an EmbeddingCollection "
             f"needs it), got {sorted(seq_dims)}")
        need(t.seq_combine in SEQ_COMBINE, "tower.seq_combine", f"{t.seq_combine!r} not in {SEQ_COMBINE}")
        need(t.num_blocks >= 0, "tower.num_blocks", f"must be >= 0, got {t.num_blocks}")
        need(t.num_heads > 0, "tower.num_heads", f"must be > 0, got {t.num_heads}")
        if t.head_dim is None:
            need(self.d_model % t.num_heads == 0, "tower.num_heads",
                 f"d_model={self.d_model} is not divisible by num_heads={t.num_heads} (or set tower.head_dim)")
        need(self.tower_head_dim > 0, "tower.head_dim", "must be > 0")
        need(t.num_heads % self.tower_kv_heads == 0, "tower.num_kv_heads",
             f"num_heads={t.num_heads} is not a multiple of num_kv_heads={self.tower_kv_heads}")
        if t.rope:
            need(self.tower_head_dim % 2 == 0, "tower.head_dim", "rope needs an even head dim")
        need(t.attention in ATTENTION_KINDS, "tower.attention", f"{t.attention!r} not in {ATTENTION_KINDS}")
        if t.attention == "swa":
            need(t.window is not None and t.window > 0, "tower.window", "attention 'swa' needs window > 0")
        if t.attention == "block":
            need(t.block_size is not None and t.block_size > 0, "tower.block_size",
                 "attention 'block' needs block_size > 0")
        need(self.tower_d_ff > 0, "tower.d_ff", "must be > 0")
        need(t.moe_every >= 0, "tower.moe_every", "must be >= 0")
        need(t.norm in NORMS, "tower.norm", f"{t.norm!r} not in {NORMS}")
        if t.moe_every > 0:
            m = self.moe
            need(m.num_experts > 0, "moe.num_experts", "must be > 0")
            need(0 < m.top_k <= m.num_experts, "moe.top_k", f"must be in [1, num_experts={m.num_experts}]")
            need(m.capacity_factor is None or m.capacity_factor > 0, "moe.capacity_factor", "must be > 0 or null")
            need(m.aux_loss_coef >= 0, "moe.aux_loss_coef", "must be >= 0")
            need(m.grouped_mm in (True, False, None), "moe.grouped_mm", "must be true, false or null")
        need(it.num_heads > 0, "interaction.num_heads", "must be > 0")
        if it.head_dim is None:
            need(self.d_model % it.num_heads == 0, "interaction.num_heads",
                 f"d_model={self.d_model} is not divisible by num_heads={it.num_heads} (or set head_dim)")
        need(it.num_heads % self.interaction_kv_heads == 0, "interaction.num_kv_heads",
             f"num_heads={it.num_heads} is not a multiple of num_kv_heads={self.interaction_kv_heads}")
        need(it.activation in GDPA_ACTIVATIONS, "interaction.activation",
             f"{it.activation!r} not in {GDPA_ACTIVATIONS}")
        need(it.approx in (None, "poly6"), "interaction.approx", f"{it.approx!r}: expected null or 'poly6'")
        nz = it.normalize
        need(nz is None or nz == "max_len_k" or (isinstance(nz, (int, float)) and nz > 0), "interaction.normalize",
             f"{nz!r}: expected null, 'max_len_k' or a positive number")
        need(len(self.heads.tasks) >= 1, "heads.tasks", "at least one task is needed")
        need(len(set(self.heads.tasks)) == len(self.heads.tasks), "heads.tasks", "duplicate task names")
        if self.heads.weights is not None:
            need(len(self.heads.weights) == len(self.heads.tasks), "heads.weights",
                 f"{len(self.heads.weights)} weights for {len(self.heads.tasks)} tasks")
            need(all(w >= 0 for w in self.heads.weights), "heads.weights", "weights must be >= 0")
        for key, dims in (("heads.over_arch", self.heads.over_arch), ("heads.hidden", self.heads.hidden),
                          ("interaction.dense_hidden", it.dense_hidden)):
            need(all(d > 0 for d in dims), key, f"layer sizes must be > 0, got {dims}")


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
                    raise ConfigError(f"data.schema.{where}: entry {e!r} has no name")
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
                raise ConfigError(f"model.tables[{i}].features: {f!r} (kind {tb.kind!r}) is not in "
                                  f"data.schema.{kind_name} {sorted(pool)}{hint}")
            n = pool[f]
            if n is not None and n > tb.num_embeddings:
                raise ConfigError(f"model.tables[{i}].num_embeddings: {tb.num_embeddings} < the cardinality "
                                  f"{n} of feature {f!r} in the data schema")
    missing = [f for f in seq if f not in model_cfg.sequence_features]
    if missing:
        raise ConfigError(f"model.tables: sequence features {missing} of the data schema have no table")
    missing = [f for f in sparse if f not in model_cfg.sparse_features]
    if missing:
        raise ConfigError(f"model.tables: sparse features {missing} of the data schema have no table")
    nd = _schema_get(schema, "num_dense")
    if nd is not None and int(nd) != model_cfg.num_dense:
        raise ConfigError(f"model.num_dense: {model_cfg.num_dense} != data.schema.num_dense {nd}")
    tasks = _schema_get(schema, "tasks")
    if tasks is not None and list(tasks) != list(model_cfg.heads.tasks):
        raise ConfigError(f"model.heads.tasks: {list(model_cfg.heads.tasks)} != data.schema.tasks {list(tasks)}")


# ------------------------------------------------------------------------------------------------------------------
# Mapping -> dataclass with key-naming errors


def _coerce(tp: Any, value: Any, key: str) -> Any:
    origin = typing.get_origin(tp)
    args = typing.get_args(tp)
    if origin is typing.Union or origin is types.UnionType:
        if value is None:
            if type(None) in args:
                return None
            raise ConfigError(f"{key}: must not be null")
        errs = []
        for a in args:
            if a is type(None):
                continue
            try:
                return _coerce(a, value, key)
            except ConfigError as e:
                errs.append(str(e))
        raise ConfigError(errs[0] if len(errs) == 1 else f"{key}: {value!r} matches none of {args}")
    if origin in (list, Sequence):
        if isinstance(value, (str, bytes)) or not isinstance(value, (list, tuple)):
            raise ConfigError(f"{key}: expected a list, got {value!r}")
        return [_coerce(args[0] if args else Any, v, f"{key}[{i}]") for i, v in enumerate(value)]
    if dataclasses.is_dataclass(tp):
        if not isinstance(value, Mapping):
            raise ConfigError(f"{key}: expected a mapping, got {value!r}")
        return _build(tp, value, key)
    if tp is Any:
        return value
    if value is None:
        raise ConfigError(f"{key}: must not be null")
    if tp is bool:
        if not isinstance(value, bool):
            raise ConfigError(f"{key}: expected true/false, got {value!r}")
        return value
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"{key}: expected an integer, got {value!r}")
        return value
    if tp is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(f"{key}: expected a number, got {value!r}")
        return float(value)
    if tp is str:
        if not isinstance(value, str):
            raise ConfigError(f"{key}: expected a string, got {value!r}")
        return value
    return value


def _build(cls: type, data: Mapping, key: str) -> Any:
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls)}
    unknown = [k for k in data if k not in fields]
    if unknown:
        raise ConfigError(f"{key}.{unknown[0]}: unknown key (expected one of {sorted(fields)})")
    kwargs = {}
    for name, f in fields.items():
        if name not in data:
            if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
                raise ConfigError(f"{key}.{name}: missing required key")
            continue
        kwargs[name] = _coerce(hints[name], data[name], f"{key}.{name}")
    return cls(**kwargs)
