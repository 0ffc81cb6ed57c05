"""Feature schema and data config, built from the `data:` config group (plain dict or OmegaConf DictConfig).

Layout of the `data:` group (configs/data/*.yaml)::

    source: synthetic | parquet
    seed: int                 # synthetic: the hidden world and the sample streams derive from it
    batch_size: int           # examples per rank per step
    eval_batches: int         # batches per rank in one evaluation pass
    paths: [..]               # parquet only: training files (globs allowed)
    eval_paths: [..]          # parquet only: held-out files
    allow_extra_columns: bool # parquet only: columns the schema does not name are not read (default: an error)
    balance: none | cost      # several ranks: each global batch split into equal-count parts of near-equal cost
    schema:
      num_items: int          # item vocabulary shared by `hist_item` and `cand_item`
      zipf_alpha: float       # item popularity: P(popularity rank k) ~ (k+1)^-alpha (0 = uniform)
      num_dense: int
      tasks: [click, conversion]
      sequence_features: [{name, num_embeddings}]            # must include hist_item
      sparse_features: [{name, num_embeddings, max_hot, min_hot}]  # must include cand_item (one-hot)
      history: {max_len, min_len, distribution: uniform | lognormal | zipf, sparsity, mu, sigma, alpha}

`num_embeddings` may be omitted for `hist_item` / `cand_item` (it is `num_items`).

History lengths. Sparsity follows the jagged-attention literature: s = 1 - E[L] / max_len, the fraction of a
padded [B, max_len] buffer that would be padding. `uniform`: L ~ U{lo..hi}, the widest integer range inside
[min_len, max_len] whose mean is (1 - s) * max_len (s = 0.5, min_len = 0 gives U{0..max_len}; with min_len = 1,
U{1..max_len - 1}). `lognormal`: L = round(exp(mu + sigma * N(0, 1))) clipped to [min_len, max_len]. `zipf`:
P(L = k) ~ (k - lo + 1)^-alpha on k in [lo, max_len], lo = max(min_len, 1): most histories short, a heavy tail of
long ones.
"""

from __future__ import annotations

import dataclasses
import glob
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

from gem._config import Checker, ConfigError, build, to_plain

HIST_ITEM = "hist_item"
HIST_ACTION = "hist_action"
CAND_ITEM = "cand_item"


def _check_keys(where: str, d: Mapping[str, Any], allowed: set[str], required: set[str] = frozenset()) -> None:
    if not isinstance(d, Mapping):
        raise ConfigError(where, "expected a mapping", d)
    for key in d:
        if key not in allowed:
            raise ConfigError(f"{where}.{key}", f"unknown key (expected one of {', '.join(sorted(allowed))})")
    for key in sorted(required):
        if key not in d:
            raise ConfigError(f"{where}.{key}", "missing required key")


def _int(where: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ConfigError(where, "expected an integer", value)
    return value


def _num(where: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ConfigError(where, "expected a number", value)
    return float(value)


@dataclass(frozen=True)
class FeatureSpec:
    """A categorical feature; ids are in [0, num_embeddings)."""

    name: str
    num_embeddings: int


@dataclass(frozen=True)
class SparseFeatureSpec(FeatureSpec):
    """A multi-hot feature: each example has between min_hot and max_hot ids."""

    max_hot: int = 1
    min_hot: int = 1


@dataclass(frozen=True)
class HistoryConfig:
    max_len: int = 64
    min_len: int = 0
    distribution: str = "uniform"
    sparsity: float = 0.5
    mu: float = 3.0
    sigma: float = 1.0
    alpha: float = 1.0  # zipf exponent

    def __post_init__(self) -> None:
        need = Checker("data.schema.history").need
        need(self.max_len >= 1, "max_len", "must be >= 1", self.max_len)
        need(0 <= self.min_len <= self.max_len, "min_len", f"must be in [0, max_len={self.max_len}]", self.min_len)
        need(self.distribution in ("uniform", "lognormal", "zipf"), "distribution",
             "must be uniform, lognormal or zipf", self.distribution)
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
class DataSchema:
    num_items: int
    sequence_features: tuple[FeatureSpec, ...]
    sparse_features: tuple[SparseFeatureSpec, ...]
    num_dense: int
    tasks: tuple[str, ...]
    history: HistoryConfig = field(default_factory=HistoryConfig)
    zipf_alpha: float = 1.05

    def __post_init__(self) -> None:
        need = Checker("data.schema").need
        need(self.num_items >= 1, "num_items", "must be >= 1", self.num_items)
        need(self.num_dense >= 0, "num_dense", "must be >= 0", self.num_dense)
        need(len(self.tasks) >= 2 and len(set(self.tasks)) == len(self.tasks), "tasks",
             "must list >= 2 distinct task names", self.tasks)
        need(self.zipf_alpha >= 0, "zipf_alpha", "must be >= 0", self.zipf_alpha)
        names = [f.name for f in self.sequence_features] + [f.name for f in self.sparse_features]
        dup = sorted({n for n in names if names.count(n) > 1})
        need(not dup, "sequence_features", "a feature name is declared twice", dup[0] if dup else None)
        seq = {f.name: f for f in self.sequence_features}
        sp = {f.name: f for f in self.sparse_features}
        need(HIST_ITEM in seq, "sequence_features", f"must include '{HIST_ITEM}'", sorted(seq))
        need(CAND_ITEM in sp, "sparse_features", f"must include '{CAND_ITEM}'", sorted(sp))
        for kind, name, spec in (("sequence", HIST_ITEM, seq[HIST_ITEM]), ("sparse", CAND_ITEM, sp[CAND_ITEM])):
            need(spec.num_embeddings == self.num_items, f"{kind}_features",
                 f"'{name}' num_embeddings must equal num_items={self.num_items}", spec.num_embeddings)
        need(sp[CAND_ITEM].max_hot == 1 and sp[CAND_ITEM].min_hot == 1, "sparse_features",
             f"'{CAND_ITEM}' must be one-hot (min_hot = max_hot = 1)", [sp[CAND_ITEM].min_hot, sp[CAND_ITEM].max_hot])
        for kind, feats in (("sequence", self.sequence_features), ("sparse", self.sparse_features)):
            for f in feats:
                need(f.num_embeddings >= 1, f"{kind}_features", f"'{f.name}' num_embeddings must be >= 1",
                     f.num_embeddings)
        for f in self.sparse_features:
            need(0 <= f.min_hot <= f.max_hot and f.max_hot >= 1, "sparse_features",
                 f"'{f.name}' needs 0 <= min_hot <= max_hot and max_hot >= 1", [f.min_hot, f.max_hot])

    @property
    def sequence_names(self) -> list[str]:
        return [f.name for f in self.sequence_features]

    @property
    def sparse_names(self) -> list[str]:
        return [f.name for f in self.sparse_features]

    @property
    def num_tasks(self) -> int:
        return len(self.tasks)

    def cardinalities(self) -> dict[str, int]:
        """Feature name -> num_embeddings, for every sequence and sparse feature."""
        return {f.name: f.num_embeddings for f in (*self.sequence_features, *self.sparse_features)}

    @classmethod
    def from_dict(cls, cfg: Mapping[str, Any]) -> DataSchema:
        d = dict(to_plain(cfg))
        _check_keys(
            "data.schema",
            d,
            {"num_items", "zipf_alpha", "num_dense", "tasks", "sequence_features", "sparse_features", "history"},
            {"num_items", "num_dense", "tasks", "sequence_features", "sparse_features"},
        )
        num_items = _int("data.schema.num_items", d["num_items"])

        def card(where: str, f: Mapping[str, Any]) -> int:
            if "num_embeddings" in f and f["num_embeddings"] is not None:
                return _int(f"{where}.num_embeddings", f["num_embeddings"])
            if f.get("name") in (HIST_ITEM, CAND_ITEM):
                return num_items
            raise ConfigError(f"{where}.num_embeddings", "missing required key", f.get("name"))

        seq = []
        for i, f in enumerate(d["sequence_features"]):
            where = f"data.schema.sequence_features[{i}]"
            _check_keys(where, f, {"name", "num_embeddings"}, {"name"})
            seq.append(FeatureSpec(name=str(f["name"]), num_embeddings=card(where, f)))
        sparse = []
        for i, f in enumerate(d["sparse_features"]):
            where = f"data.schema.sparse_features[{i}]"
            _check_keys(where, f, {"name", "num_embeddings", "max_hot", "min_hot"}, {"name"})
            sparse.append(
                SparseFeatureSpec(
                    name=str(f["name"]),
                    num_embeddings=card(where, f),
                    max_hot=_int(f"{where}.max_hot", f.get("max_hot", 1)),
                    min_hot=_int(f"{where}.min_hot", f.get("min_hot", 1)),
                )
            )
        hist = d.get("history") or {}
        allowed = {f.name for f in dataclasses.fields(HistoryConfig)}
        _check_keys("data.schema.history", hist, allowed)
        return cls(
            num_items=num_items,
            sequence_features=tuple(seq),
            sparse_features=tuple(sparse),
            num_dense=_int("data.schema.num_dense", d["num_dense"]),
            tasks=tuple(str(t) for t in d["tasks"]),
            history=build(HistoryConfig, hist, "data.schema.history"),
            zipf_alpha=_num("data.schema.zipf_alpha", d.get("zipf_alpha", 1.05)),
        )


@dataclass(frozen=True)
class DataConfig:
    """The whole `data:` group: where examples come from plus the schema."""

    schema: DataSchema
    source: Literal["synthetic", "parquet"] = "synthetic"
    seed: int = 0
    batch_size: int = 128
    eval_batches: int = 8
    paths: tuple[str, ...] = ()
    eval_paths: tuple[str, ...] = ()
    num_workers: int = 0  # DataLoader worker processes making training batches (0: on the training thread)
    allow_extra_columns: bool = False  # parquet: columns the schema does not name are ignored instead of an error
    # training batches on several ranks: cost = each global batch split into equal-count parts of near-equal
    # cost (gem/data/balance.py); none = rank r trains the r-th batch of the step as drawn
    balance: Literal["none", "cost"] = "cost"

    def __post_init__(self) -> None:
        need = Checker("data").need
        need(self.batch_size >= 1, "batch_size", "must be >= 1", self.batch_size)
        need(self.eval_batches >= 0, "eval_batches", "must be >= 0", self.eval_batches)
        need(self.num_workers >= 0, "num_workers", "must be >= 0", self.num_workers)
        need(self.source != "parquet" or bool(self.paths), "paths", "the parquet source needs a training file",
             list(self.paths))

    @classmethod
    def from_dict(cls, cfg: Mapping[str, Any]) -> DataConfig:
        d = dict(to_plain(cfg))
        _check_keys("data", d, {f.name for f in dataclasses.fields(cls)}, {"schema"})
        d["schema"] = DataSchema.from_dict(d["schema"])
        for key in ("paths", "eval_paths"):  # one path or glob, a list of them, or null
            d[key] = [d[key]] if isinstance(d.get(key), str) else (d.get(key) or [])
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
