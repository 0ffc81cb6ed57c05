"""The inputs of a run, declared once in the `data:` config group, and the data config around them.

Layout of the `data:` group (configs/data/*.yaml; docs/DATA.md)::

    source: synthetic | parquet
    seed: int                   # synthetic: the hidden world and the sample streams derive from it
    batch_size: int             # examples (requests) per rank per step
    max_candidates: int         # candidates per request, 1..max (default 1: one per example, the row form)
    eval_batches: int           # batches per rank in one evaluation pass
    paths: [..]                 # parquet only: training files (globs allowed)
    eval_paths: [..]            # parquet only: held-out files
    allow_extra_columns: bool   # parquet only: columns no feature names are not read (default: an error)
    balance: none | cost        # several ranks: each global batch split into equal-count parts of near-equal cost
    features:                   # key = the feature's name inside gem
      <name>:
        kind: sequence | candidate | sparse | dense
        column: <column>        # default: the name
        table: <tables key>     # sequence / candidate / sparse; several features may share one table
        history: <histories key>  # sequence only (may be left out when there is one history)
        max_hot: 1              # sparse: ids per example in [min_hot, max_hot]; a candidate has exactly one
                                # per candidate (requests: a list column, one id per candidate)
        min_hot: 1
        size: 1                 # dense: a number column (1) or a fixed-size list of numbers (n)
    histories:                  # each with its own length per example, oldest event first
      <name>: {max_len, min_len, distribution, sparsity, mu, sigma, alpha, timestamp}
    labels:                     # task -> 0/1 column, in head order (requests: a list, one per candidate)
      <task>: <column>
    tables:                     # TorchRec EmbeddingConfig / EmbeddingBagConfig fields
      <name>: {num_embeddings, embedding_dim, pooling: sum | mean, init_range, ids: dense | raw, hash: modulo | zch,
               zch_eviction_policy, zch_eviction_interval, zch_input_hash_size}
    synthetic: {zipf_alpha, action}  # synthetic only: item popularity law; the sequence feature holding event types

Embedding collections: a table that a sequence or candidate feature uses is unpooled (TorchRec's
EmbeddingCollection, which needs one embedding_dim for all its tables); a table only sparse features use is pooled
(EmbeddingBagCollection, `pooling`). So the candidate may share the history's item table; a sparse feature cannot
share a table with a sequence feature (they need different pooling).

History lengths (synthetic). Sparsity follows the jagged-attention literature: s = 1 - E[L] / max_len, the fraction
of a padded [B, max_len] buffer that would be padding. `uniform`: L ~ U{lo..hi}, the widest integer range inside
[min_len, max_len] whose mean is (1 - s) * max_len (s = 0.5, min_len = 0 gives U{0..max_len}; with min_len = 1,
U{1..max_len - 1}). `lognormal`: L = round(exp(mu + sigma * N(0, 1))) clipped to [min_len, max_len]. `zipf`:
P(L = k) ~ (k - lo + 1)^-alpha on k in [lo, max_len], lo = max(min_len, 1): most histories short, a heavy tail of
long ones.

Raw ids: `ids: raw` tables take any 64-bit id; `hash: modulo` maps id -> id mod num_embeddings (Python's modulo, so
negative ids land in range too). With n distinct ids spread evenly over m rows, the expected fraction of ids that
share their row with another is 1 - (m / n) * (1 - exp(-n / m)) (n = m: 37%; n = m / 10: 4.8%). `hash: zch` keeps
the raw ids in the batch and gives each its own row through TorchRec's managed-collision modules
(gem.model.embeddings): zero collisions while the distinct ids fit the table, evictions by
`zch_eviction_policy` beyond that (ZchSpec).
"""

from __future__ import annotations

import dataclasses
import functools
import glob
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

from gem.config import Checker, ConfigError, build, to_plain

FEATURE_KINDS = ("sequence", "candidate", "sparse", "dense")
POOLINGS = ("sum", "mean")
ZCH_POLICIES = ("distance_lfu", "lfu", "lru")  # torchrec.modules.mc_modules' eviction policies
ZCH_KEYS = ("zch_eviction_policy", "zch_eviction_interval", "zch_input_hash_size")
MAX_INT64 = 2**63 - 1

# What the old form's keys became (one line each, raised as a ConfigError).
OLD_DATA_KEYS = {
    "schema": "replaced by data.features, data.histories, data.labels and data.tables (docs/DATA.md)",
}


def _check_keys(where: str, d: Any, allowed: set[str], required: set[str] = frozenset()) -> None:
    if not isinstance(d, Mapping):
        raise ConfigError(where, "expected a mapping", d)
    for key in d:
        if key not in allowed:
            raise ConfigError(f"{where}.{key}", f"unknown key (expected one of {', '.join(sorted(allowed))})")
    for key in sorted(required):
        if key not in d:
            raise ConfigError(f"{where}.{key}", "missing required key")


@dataclass(frozen=True)
class TableSpec:
    """One embedding table (`data.tables.<name>`)."""

    name: str
    num_embeddings: int
    embedding_dim: int
    pooling: Literal["sum", "mean"] | None = None  # pooled tables only; default sum
    init_range: float | None = None  # uniform(-r, r); None: torchrec's default sqrt(1 / num_embeddings)
    ids: Literal["dense", "raw"] = "dense"  # dense: ids in [0, num_embeddings), checked; raw: any int64, hashed
    hash: Literal["modulo", "zch"] | None = None  # raw ids only
    zch_eviction_policy: str | None = None  # hash: zch only (ZchSpec holds the defaults)
    zch_eviction_interval: int | None = None
    zch_input_hash_size: int | None = None

    @property
    def zch(self) -> ZchSpec | None:
        """The managed-collision settings of a `hash: zch` table (defaults filled in), else None."""
        if self.hash != "zch":
            return None
        given = {k[len("zch_"):]: getattr(self, k) for k in ZCH_KEYS if getattr(self, k) is not None}
        return ZchSpec(**given)


@dataclass(frozen=True)
class ZchSpec:
    """Zero-collision hashing of a raw-id table (TorchRec's MCHManagedCollisionModule; docs/DATA.md).

    A raw id is first mixed into [0, input_hash_size) (gem.model.embeddings.zch_input_hash; distinct ids meet there
    with probability ~ n^2 / (2 input_hash_size) for n of them), then looked up in the table's id -> row map. One
    row (per shard) is kept for ids the map does not hold; every `eviction_interval` training steps the ids seen
    since the last update enter the map, the lowest-scored ones leaving when it is full: `lfu` by count, `lru` by
    last step seen, `distance_lfu` by count / steps since last seen."""

    eviction_policy: str = "distance_lfu"
    eviction_interval: int = 1
    input_hash_size: int = 2**62


@dataclass(frozen=True)
class FeatureSpec:
    """One input (`data.features.<name>`)."""

    name: str
    kind: Literal["sequence", "candidate", "sparse", "dense"]
    column: str
    table: str | None = None
    history: str | None = None
    max_hot: int = 1
    min_hot: int = 1
    size: int = 1


@dataclass(frozen=True)
class HistorySpec:
    """One history (`data.histories.<name>`): its own length per example; length law for the synthetic source.
    `timestamp`: a list column of event times beside the history's sequence columns (merged towers need it)."""

    name: str = "events"
    max_len: int = 64
    min_len: int = 0
    distribution: Literal["uniform", "lognormal", "zipf"] = "uniform"
    sparsity: float = 0.5
    mu: float = 3.0
    sigma: float = 1.0
    alpha: float = 1.0  # zipf exponent
    timestamp: str | None = None

    def __post_init__(self) -> None:
        need = Checker(f"data.histories.{self.name}").need
        need(self.max_len >= 1, "max_len", "must be >= 1", self.max_len)
        need(0 <= self.min_len <= self.max_len, "min_len", f"must be in [0, max_len={self.max_len}]", self.min_len)
        need(self.alpha >= 0, "alpha", "must be >= 0", self.alpha)
        need(0.0 <= self.sparsity < 1.0, "sparsity", "must be in [0, 1)", self.sparsity)
        need(self.sigma >= 0, "sigma", "must be >= 0", self.sigma)

    def uniform_range(self) -> tuple[int, int]:
        """Integer bounds (lo, hi) of the uniform length law for this sparsity (see module docstring)."""
        mean = (1.0 - self.sparsity) * self.max_len
        mean = min(max(mean, self.min_len), self.max_len)
        half = min(mean - self.min_len, self.max_len - mean)
        lo, hi = math.ceil(mean - half - 1e-9), math.floor(mean + half + 1e-9)
        return max(lo, self.min_len), min(max(hi, lo), self.max_len)


@dataclass(frozen=True)
class SyntheticSpec:
    """Synthetic source only: P(popularity rank k) ~ (k+1)^-zipf_alpha; `action`: a sequence feature whose ids are
    event types (drawn with P(a) ~ 2^-a, weighting the taste of the hidden user model)."""

    zipf_alpha: float = 1.05
    action: str | None = None


@dataclass(frozen=True)
class EmbeddingTable:
    """A table as the model builds it: TorchRec's config fields plus which features look it up and how."""

    name: str
    num_embeddings: int
    embedding_dim: int
    features: tuple[str, ...]
    kind: Literal["sequence", "bag"]  # sequence: EmbeddingCollection (unpooled); bag: EmbeddingBagCollection
    pooling: Literal["sum", "mean"] = "sum"
    init_range: float | None = None
    ids: Literal["dense", "raw"] = "dense"
    hash: str | None = None
    zch: ZchSpec | None = None  # hash: zch tables


@dataclass(frozen=True)
class Schema:
    """Every input of a run, from `data.features / histories / labels / tables`; see the module docstring."""

    features: tuple[FeatureSpec, ...]
    histories: tuple[HistorySpec, ...]
    labels: tuple[tuple[str, str], ...]  # (task, column), in head order
    tables: tuple[TableSpec, ...]
    synthetic: SyntheticSpec = SyntheticSpec()

    def __post_init__(self) -> None:
        _validate(self)

    # -- views ---------------------------------------------------------------------------------------------------
    def of_kind(self, kind: str) -> list[FeatureSpec]:
        return [f for f in self.features if f.kind == kind]

    @functools.cached_property
    def feature(self) -> dict[str, FeatureSpec]:
        return {f.name: f for f in self.features}

    @functools.cached_property
    def table(self) -> dict[str, TableSpec]:
        return {t.name: t for t in self.tables}

    @functools.cached_property
    def history(self) -> dict[str, HistorySpec]:
        return {h.name: h for h in self.histories}

    @property
    def history_names(self) -> list[str]:
        return [h.name for h in self.histories]

    def history_features(self, history: str) -> list[str]:
        """The sequence features of one history, in declaration order."""
        return [f.name for f in self.features if f.kind == "sequence" and f.history == history]

    @property
    def sequence_names(self) -> list[str]:
        """Every sequence feature, history by history (the order of their keys in Batch.sequence)."""
        return [n for h in self.histories for n in self.history_features(h.name)]

    @property
    def candidate_names(self) -> list[str]:
        return [f.name for f in self.of_kind("candidate")]

    @property
    def unpooled_names(self) -> list[str]:
        """Batch.sequence's keys (the EmbeddingCollection's input): sequence features, then candidate features."""
        return self.sequence_names + self.candidate_names

    @property
    def sparse_names(self) -> list[str]:
        """Batch.sparse's keys (the EmbeddingBagCollection's input)."""
        return [f.name for f in self.of_kind("sparse")]

    @property
    def query_names(self) -> list[str]:
        """Candidate and sparse features in declaration order: one query token each in the target interaction."""
        return [f.name for f in self.features if f.kind in ("candidate", "sparse")]

    @property
    def dense_names(self) -> list[str]:
        return [f.name for f in self.of_kind("dense")]

    @property
    def num_dense(self) -> int:
        """Width of Batch.dense: the dense features' sizes, concatenated in declaration order."""
        return sum(f.size for f in self.of_kind("dense"))

    @property
    def tasks(self) -> tuple[str, ...]:
        return tuple(t for t, _ in self.labels)

    @property
    def num_tasks(self) -> int:
        return len(self.labels)

    @property
    def has_times(self) -> bool:
        """Every history declares a timestamp column (Batch.history_times is filled)."""
        return all(h.timestamp for h in self.histories)

    @property
    def max_history_len(self) -> int:
        return max(h.max_len for h in self.histories)

    def cardinalities(self) -> dict[str, int]:
        """Feature name -> its table's num_embeddings (ids a batch may hold are in [0, that))."""
        rows = {t.name: t.num_embeddings for t in self.tables}
        return {f.name: rows[f.table] for f in self.features if f.table is not None}

    def hashed(self) -> dict[str, int]:
        """Feature -> num_embeddings for features whose table takes raw ids through `hash: modulo` (the reader maps
        them into range)."""
        tables = self.table
        return {f.name: tables[f.table].num_embeddings for f in self.features
                if f.table is not None and tables[f.table].hash == "modulo"}

    def zch_features(self) -> set[str]:
        """Features whose table is `hash: zch`: their raw ids reach the model as they are (any int64)."""
        tables = self.table
        return {f.name for f in self.features if f.table is not None and tables[f.table].hash == "zch"}

    @property
    def embedding_tables(self) -> list[EmbeddingTable]:
        """The tables with their features and collection (see the module docstring), in declaration order."""
        out = []
        for t in self.tables:
            users = [f for f in self.features if f.table == t.name]
            unpooled = any(f.kind in ("sequence", "candidate") for f in users)
            out.append(EmbeddingTable(
                name=t.name, num_embeddings=t.num_embeddings, embedding_dim=t.embedding_dim,
                features=tuple(f.name for f in users), kind="sequence" if unpooled else "bag",
                pooling=t.pooling or "sum", init_range=t.init_range, ids=t.ids, hash=t.hash, zch=t.zch))
        return out

    def embedding_dim(self, feature: str) -> int:
        return self.table[self.feature[feature].table].embedding_dim

    # -- construction --------------------------------------------------------------------------------------------
    @classmethod
    def from_dict(cls, cfg: Mapping[str, Any]) -> Schema:
        """From the `data:` group (only features / histories / labels / tables / synthetic are read)."""
        d = dict(to_plain(cfg))
        for key, what in OLD_DATA_KEYS.items():
            if key in d:
                raise ConfigError(f"data.{key}", what)
        for key in ("features", "histories", "labels", "tables"):
            if not isinstance(d.get(key), Mapping) or not d.get(key):
                if key == "histories" and d.get(key) is None:
                    continue
                raise ConfigError(f"data.{key}", "expected a non-empty mapping", d.get(key))
        hist_raw = d.get("histories") or {}
        histories = []
        allowed = {f.name for f in dataclasses.fields(HistorySpec)} - {"name"}
        for name, h in hist_raw.items():
            where = f"data.histories.{name}"
            _check_keys(where, h if h is not None else {}, allowed)
            histories.append(build(HistorySpec, {**(h or {}), "name": str(name)}, where))
        features = []
        allowed = {f.name for f in dataclasses.fields(FeatureSpec)} - {"name"}
        for name, f in d["features"].items():
            where = f"data.features.{name}"
            if f is None:  # `~data.features.x` deletes; `data.features.x=null` also drops it
                continue
            _check_keys(where, f, allowed, {"kind"})
            f = dict(f)
            if f.get("kind") not in FEATURE_KINDS:
                raise ConfigError(f"{where}.kind", f"must be one of {', '.join(FEATURE_KINDS)}", f.get("kind"))
            if f["kind"] == "sequence" and f.get("history") is None and len(histories) == 1:
                f["history"] = histories[0].name
            f.setdefault("column", str(name))
            features.append(build(FeatureSpec, {**f, "name": str(name)}, where))
        labels = []
        for task, col in d["labels"].items():
            if not isinstance(col, str) or not col:
                raise ConfigError(f"data.labels.{task}", "expected a column name", col)
            labels.append((str(task), col))
        tables = []
        allowed = {f.name for f in dataclasses.fields(TableSpec)} - {"name"}
        for name, t in d["tables"].items():
            where = f"data.tables.{name}"
            if t is None:
                continue
            _check_keys(where, t, allowed, {"num_embeddings", "embedding_dim"})
            tables.append(build(TableSpec, {**t, "name": str(name)}, where))
        syn = build(SyntheticSpec, d.get("synthetic") or {}, "data.synthetic")
        return cls(features=tuple(features), histories=tuple(histories), labels=tuple(labels), tables=tuple(tables),
                   synthetic=syn)


def _validate(s: Schema) -> None:
    """Config-level checks of a declaration; each failure is one ConfigError naming the key."""
    need = Checker("data").need
    tables = {t.name: t for t in s.tables}
    hists = {h.name for h in s.histories}
    need(bool(s.histories), "histories", "at least one history is needed", [])
    need(bool(s.of_kind("sequence")), "features", "at least one feature of kind 'sequence' is needed",
         sorted(f.name for f in s.features))
    need(bool(s.of_kind("candidate")), "features", "at least one feature of kind 'candidate' is needed",
         sorted(f.name for f in s.features))
    need(bool(s.labels), "labels", "at least one task is needed", [])
    for t in s.tables:
        k = f"tables.{t.name}"
        need(t.num_embeddings >= 1, f"{k}.num_embeddings", "must be >= 1", t.num_embeddings)
        need(t.embedding_dim >= 1, f"{k}.embedding_dim", "must be >= 1", t.embedding_dim)
        need(t.init_range is None or t.init_range > 0, f"{k}.init_range", "must be > 0 or null", t.init_range)
        if t.ids == "raw":
            need(t.hash is not None, f"{k}.hash", "raw ids need a hash: modulo or zch", t.hash)
        else:
            need(t.hash is None, f"{k}.hash", "only ids: raw tables are hashed (set ids: raw)", t.hash)
        if t.hash != "zch":
            for key in ZCH_KEYS:
                need(getattr(t, key) is None, f"{k}.{key}", "only hash: zch tables take it", getattr(t, key))
            continue
        need(t.num_embeddings >= 2, f"{k}.num_embeddings", "hash: zch keeps one row for ids not in the table: "
             "needs >= 2", t.num_embeddings)
        z = t.zch
        need(z.eviction_policy in ZCH_POLICIES, f"{k}.zch_eviction_policy", f"must be one of {', '.join(ZCH_POLICIES)}",
             z.eviction_policy)
        need(z.eviction_interval >= 1, f"{k}.zch_eviction_interval", "must be >= 1 (training steps)",
             z.eviction_interval)
        need(t.num_embeddings <= z.input_hash_size <= MAX_INT64, f"{k}.zch_input_hash_size",
             f"must be in [num_embeddings={t.num_embeddings}, 2**63 - 1]", z.input_hash_size)
    for f in s.features:
        k = f"features.{f.name}"
        if f.kind in ("dense", "sequence"):  # the keys' defaults (1) only: they would bound nothing here
            what = "a dense feature has no ids" if f.kind == "dense" else "a sequence feature has one id per event"
            need(f.max_hot == 1, f"{k}.max_hot", f"only sparse features take max_hot: {what}", f.max_hot)
            need(f.min_hot == 1, f"{k}.min_hot", f"only sparse features take min_hot: {what}", f.min_hot)
        if f.kind == "dense":
            need(f.table is None, f"{k}.table", "a dense feature has no table", f.table)
            need(f.size >= 1, f"{k}.size", "must be >= 1", f.size)
            continue
        need(f.size == 1, f"{k}.size", "only dense features have a size", f.size)
        need(f.table is not None, f"{k}.table", f"a {f.kind} feature needs a table", None)
        need(f.table in tables, f"{k}.table", f"no such table in data.tables ({', '.join(sorted(tables))})", f.table)
        if f.kind == "sequence":
            need(f.history in hists, f"{k}.history",
                 f"must name one of data.histories ({', '.join(sorted(hists))})", f.history)
        else:
            need(f.history is None, f"{k}.history", "only sequence features belong to a history", f.history)
        if f.kind == "candidate":
            need(f.max_hot == 1 and f.min_hot == 1, f"{k}.max_hot", "a candidate has exactly one id",
                 [f.min_hot, f.max_hot])
        if f.kind == "sparse":
            need(f.max_hot >= 1, f"{k}.max_hot", "must be >= 1", f.max_hot)
            need(0 <= f.min_hot <= f.max_hot, f"{k}.min_hot", f"must be in [0, max_hot={f.max_hot}]", f.min_hot)
    for h in s.histories:
        need(bool(s.history_features(h.name)), f"histories.{h.name}", "no sequence feature belongs to it")
    stamped = [h.name for h in s.histories if h.timestamp]
    need(not stamped or len(stamped) == len(s.histories), f"histories.{stamped[0] if stamped else ''}.timestamp",
         "give every history a timestamp column, or none", [h.name for h in s.histories if not h.timestamp])
    columns = [f.column for f in s.features if f.kind != "dense"]
    labels = [c for _, c in s.labels]
    clash = sorted(set(labels) & set(columns) | {c for c in labels if labels.count(c) > 1})
    need(not clash, "labels", "a label column is also a feature's or another task's column", clash[0] if clash else 0)
    for t in s.embedding_tables:
        users = [s.feature[n] for n in t.features]
        pooled = [f.name for f in users if f.kind == "sparse"]
        unpooled = [f.name for f in users if f.kind != "sparse"]
        if pooled and unpooled:
            raise ConfigError(f"data.tables.{t.name}", f"features {unpooled[0]!r} ({s.feature[unpooled[0]].kind}) "
                              f"and {pooled[0]!r} (sparse) need different pooling: give the sparse feature a table "
                              "of its own", sorted(t.features))
        if unpooled and tables[t.name].pooling is not None:
            raise ConfigError(f"data.tables.{t.name}.pooling", f"the table of {unpooled[0]!r} "
                              f"({s.feature[unpooled[0]].kind}) is not pooled", tables[t.name].pooling)
    used = {f.table for f in s.features if f.table is not None}
    for t in s.tables:
        need(t.name in used, f"tables.{t.name}", f"no feature uses this table (delete it too: ~data.tables.{t.name}, "
             "or name it in a feature's table)")
    dims = {t.name: t.embedding_dim for t in s.embedding_tables if t.kind == "sequence"}
    need(len(set(dims.values())) <= 1, "tables", "the tables of sequence and candidate features must share one "
         "embedding_dim (one TorchRec EmbeddingCollection holds them)", dims)
    if s.synthetic.action is not None:
        a = s.feature.get(s.synthetic.action)
        need(a is not None and a.kind == "sequence", "synthetic.action", "must name a sequence feature",
             s.synthetic.action)


@dataclass(frozen=True)
class DataConfig:
    """The whole `data:` group: where examples come from plus the schema."""

    schema: Schema
    source: Literal["synthetic", "parquet"] = "synthetic"
    seed: int = 0
    batch_size: int = 128
    eval_batches: int = 8
    paths: tuple[str, ...] = ()
    eval_paths: tuple[str, ...] = ()
    num_workers: int = 0  # DataLoader worker processes making training batches (0: on the training thread)
    allow_extra_columns: bool = False  # parquet: columns no feature names are ignored instead of an error
    max_candidates: int = 1  # candidates per request (synthetic: uniform 1..max); 1: one candidate per example
    # training batches on several ranks: cost = each global batch split into equal-count parts of near-equal
    # cost (gem/data/balance.py); none = rank r trains the r-th batch of the step as drawn
    balance: Literal["none", "cost"] = "cost"

    def __post_init__(self) -> None:
        need = Checker("data").need
        need(self.batch_size >= 1, "batch_size", "must be >= 1", self.batch_size)
        need(self.eval_batches >= 0, "eval_batches", "must be >= 0", self.eval_batches)
        need(self.num_workers >= 0, "num_workers", "must be >= 0", self.num_workers)
        need(self.max_candidates >= 1, "max_candidates", "must be >= 1", self.max_candidates)
        need(self.source != "parquet" or bool(self.paths), "paths", "the parquet source needs a training file",
             list(self.paths))

    @classmethod
    def from_dict(cls, cfg: Mapping[str, Any]) -> DataConfig:
        d = dict(to_plain(cfg))
        for key, what in OLD_DATA_KEYS.items():
            if key in d:
                raise ConfigError(f"data.{key}", what)
        schema_keys = ("features", "histories", "labels", "tables", "synthetic")
        schema = Schema.from_dict({k: d.pop(k) for k in schema_keys if k in d})
        _check_keys("data", d, {f.name for f in dataclasses.fields(cls)} - {"schema"} | set(schema_keys))
        for key in ("paths", "eval_paths"):  # one path or glob, a list of them, or null
            d[key] = [d[key]] if isinstance(d.get(key), str) else (d.get(key) or [])
        d["schema"] = schema
        return build(cls, d, "data")


def expand_paths(paths: Any, key: str = "data.paths") -> list[str]:
    """Files named by `paths` (a path, a glob, or a list of either), in sorted order per entry."""
    if isinstance(paths, str):
        paths = [paths]
    out: list[str] = []
    for p in paths:
        hits = sorted(glob.glob(str(p)))
        if not hits:
            raise ConfigError(key, "no file matches", p)
        out.extend(hits)
    return out
