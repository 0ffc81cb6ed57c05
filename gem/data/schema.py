"""Feature schema and data config, built from the `data:` config group (plain dict or OmegaConf DictConfig).

Layout of the `data:` group (gem/configs/data/*.yaml)::

    source: synthetic | parquet
    seed: int                 # synthetic: the hidden world and the sample streams derive from it
    batch_size: int           # examples per rank per step
    eval_batches: int         # batches per rank in one evaluation pass
    paths: [..]               # parquet only: training files (globs allowed)
    eval_paths: [..]          # parquet only: held-out files
    schema:
      num_items: int          # item vocabulary shared by `hist_item` and `cand_item`
      zipf_alpha: float       # item popularity: P(popularity rank k) ~ (k+1)^-alpha (0 = uniform)
      num_dense: int
      tasks: [click, conversion]
      sequence_features: [{name, num_embeddings}]            # must include hist_item
      sparse_features: [{name, num_embeddings, max_hot, min_hot}]  # must include cand_item (one-hot)
      history: {max_len, min_len, distribution: uniform | lognormal, sparsity, mu, sigma}

`num_embeddings` may be omitted for `hist_item` / `cand_item` (it is `num_items`).

History lengths. Sparsity follows the jagged-attention literature: s = 1 - E[L] / max_len, the fraction of a
padded [B, max_len] buffer that would be padding. `uniform`: L ~ U{lo..hi}, the widest integer range inside
[min_len, max_len] whose mean is (1 - s) * max_len (s = 0.5, min_len = 0 gives U{0..max_len}; with min_len = 1,
U{1..max_len - 1}). `lognormal`: L = round(exp(mu + sigma * N(0, 1))) clipped to [min_len, max_len].
"""

from __future__ import annotations

import dataclasses
import glob
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from gem._config import to_plain

HIST_ITEM = "hist_item"
HIST_ACTION = "hist_action"
CAND_ITEM = "cand_item"


def _check_keys(where: str, d: Mapping[str, Any], allowed: set[str], required: set[str] = frozenset()) -> None:
    if not isinstance(d, Mapping):
        raise TypeError(f"{where}: expected a mapping, got {type(d).__name__}")
    for key in d:
        if key not in allowed:
            raise ValueError(f"{where}: unknown key '{key}' (allowed: {', '.join(sorted(allowed))})")
    for key in required:
        if key not in d:
            raise ValueError(f"{where}: missing required key '{key}'")


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

    def __post_init__(self) -> None:
        if self.max_len < 1:
            raise ValueError(f"history.max_len must be >= 1, got {self.max_len}")
        if not 0 <= self.min_len <= self.max_len:
            raise ValueError(f"history.min_len must be in [0, max_len={self.max_len}], got {self.min_len}")
        if self.distribution not in ("uniform", "lognormal"):
            raise ValueError(f"history.distribution must be 'uniform' or 'lognormal', got '{self.distribution}'")
        if not 0.0 <= self.sparsity < 1.0:
            raise ValueError(f"history.sparsity must be in [0, 1), got {self.sparsity}")
        if self.sigma < 0:
            raise ValueError(f"history.sigma must be >= 0, got {self.sigma}")

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
        if self.num_items < 1:
            raise ValueError(f"schema.num_items must be >= 1, got {self.num_items}")
        if self.num_dense < 0:
            raise ValueError(f"schema.num_dense must be >= 0, got {self.num_dense}")
        if len(self.tasks) < 2 or len(set(self.tasks)) != len(self.tasks):
            raise ValueError(f"schema.tasks must list >= 2 distinct task names, got {list(self.tasks)}")
        if self.zipf_alpha < 0:
            raise ValueError(f"schema.zipf_alpha must be >= 0, got {self.zipf_alpha}")
        names = [f.name for f in self.sequence_features] + [f.name for f in self.sparse_features]
        dup = sorted({n for n in names if names.count(n) > 1})
        if dup:
            raise ValueError(f"schema: feature name '{dup[0]}' is declared twice")
        seq = {f.name: f for f in self.sequence_features}
        sp = {f.name: f for f in self.sparse_features}
        if HIST_ITEM not in seq:
            raise ValueError(f"schema.sequence_features must include '{HIST_ITEM}'")
        if CAND_ITEM not in sp:
            raise ValueError(f"schema.sparse_features must include '{CAND_ITEM}'")
        for name, spec in ((HIST_ITEM, seq[HIST_ITEM]), (CAND_ITEM, sp[CAND_ITEM])):
            if spec.num_embeddings != self.num_items:
                raise ValueError(
                    f"schema: '{name}' num_embeddings={spec.num_embeddings} must equal num_items={self.num_items}"
                )
        if sp[CAND_ITEM].max_hot != 1 or sp[CAND_ITEM].min_hot != 1:
            raise ValueError(f"schema: '{CAND_ITEM}' must be one-hot (min_hot = max_hot = 1)")
        for f in (*self.sequence_features, *self.sparse_features):
            if f.num_embeddings < 1:
                raise ValueError(f"schema: feature '{f.name}' num_embeddings must be >= 1, got {f.num_embeddings}")
        for f in self.sparse_features:
            if not 0 <= f.min_hot <= f.max_hot or f.max_hot < 1:
                raise ValueError(
                    f"schema: feature '{f.name}' needs 0 <= min_hot <= max_hot and max_hot >= 1, "
                    f"got min_hot={f.min_hot} max_hot={f.max_hot}"
                )

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
        num_items = int(d["num_items"])

        def card(where: str, f: Mapping[str, Any]) -> int:
            if "num_embeddings" in f and f["num_embeddings"] is not None:
                return int(f["num_embeddings"])
            if f.get("name") in (HIST_ITEM, CAND_ITEM):
                return num_items
            raise ValueError(f"{where}: feature '{f.get('name')}' needs num_embeddings")

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
                    max_hot=int(f.get("max_hot", 1)),
                    min_hot=int(f.get("min_hot", 1)),
                )
            )
        hist = d.get("history") or {}
        allowed = {f.name for f in dataclasses.fields(HistoryConfig)}
        _check_keys("data.schema.history", hist, allowed)
        return cls(
            num_items=num_items,
            sequence_features=tuple(seq),
            sparse_features=tuple(sparse),
            num_dense=int(d["num_dense"]),
            tasks=tuple(str(t) for t in d["tasks"]),
            history=HistoryConfig(**hist),
            zipf_alpha=float(d.get("zipf_alpha", 1.05)),
        )


@dataclass(frozen=True)
class DataConfig:
    """The whole `data:` group: where examples come from plus the schema."""

    schema: DataSchema
    source: str = "synthetic"
    seed: int = 0
    batch_size: int = 128
    eval_batches: int = 8
    paths: tuple[str, ...] = ()
    eval_paths: tuple[str, ...] = ()
    num_workers: int = 0  # DataLoader worker processes making training batches (0: on the training thread)

    def __post_init__(self) -> None:
        if self.source not in ("synthetic", "parquet"):
            raise ValueError(f"data.source must be 'synthetic' or 'parquet', got '{self.source}'")
        if self.batch_size < 1:
            raise ValueError(f"data.batch_size must be >= 1, got {self.batch_size}")
        if self.eval_batches < 0:
            raise ValueError(f"data.eval_batches must be >= 0, got {self.eval_batches}")
        if self.num_workers < 0:
            raise ValueError(f"data.num_workers must be >= 0, got {self.num_workers}")
        if self.source == "parquet" and not self.paths:
            raise ValueError("data.paths: the parquet source needs at least one training file")

    @classmethod
    def from_dict(cls, cfg: Mapping[str, Any]) -> DataConfig:
        d = dict(to_plain(cfg))
        allowed = {f.name for f in dataclasses.fields(cls)}
        _check_keys("data", d, allowed, {"schema"})
        return cls(
            schema=DataSchema.from_dict(d["schema"]),
            source=str(d.get("source", "synthetic")),
            seed=int(d.get("seed", 0)),
            batch_size=int(d.get("batch_size", 128)),
            eval_batches=int(d.get("eval_batches", 8)),
            paths=tuple(str(p) for p in (d.get("paths") or ())),
            eval_paths=tuple(str(p) for p in (d.get("eval_paths") or ())),
            num_workers=int(d.get("num_workers", 0)),
        )


def expand_paths(paths: Any) -> list[str]:
    """Files named by `paths` (a path, a glob, or a list of either), in sorted order per entry."""
    if isinstance(paths, str):
        paths = [paths]
    out: list[str] = []
    for p in paths:
        hits = sorted(glob.glob(str(p)))
        if not hits:
            raise ValueError(f"no file matches '{p}'")
        out.extend(hits)
    return out
