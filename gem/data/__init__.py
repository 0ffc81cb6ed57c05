"""Data: feature schema, the Batch type, synthetic and Parquet sources, batch validation, the training stream."""

from gem.data.batch import Batch
from gem.data.loader import BadBatchError, TrainBatches
from gem.data.schema import DataConfig, EmbeddingTable, FeatureSpec, HistorySpec, Schema, TableSpec
from gem.data.synthetic import SyntheticDataset
from gem.data.validate import validate_batch

__all__ = [
    "BadBatchError",
    "Batch",
    "DataConfig",
    "EmbeddingTable",
    "FeatureSpec",
    "HistorySpec",
    "Schema",
    "SyntheticDataset",
    "TableSpec",
    "TrainBatches",
    "build_dataset",
    "validate_batch",
]


def build_dataset(cfg, rank: int = 0, world_size: int = 1, split: str = "train", cost=None):
    """The dataset the `data:` group describes (a DataConfig, dict or DictConfig) for one rank.

    train: an endless stream; eval: `eval_batches` batches per rank (a held-out stream / `eval_paths`).
    `cost`: the model's cost per example ({history name: lengths [B]} -> [B]); with `data.balance=cost` on more
    than one rank, the training stream is this rank's balanced share of each global batch (gem/data/balance.py).
    """
    if not isinstance(cfg, DataConfig):
        cfg = DataConfig.from_dict(cfg)
    ds = _source(cfg, rank, world_size, split)
    if split == "train" and world_size > 1 and cfg.balance == "cost":
        if cost is None:
            raise ValueError("data.balance=cost needs the model's cost per example (build_dataset(cost=...))")
        from gem.data.balance import BalancedDataset

        return BalancedDataset(ds, cost)
    return ds


def _source(cfg: DataConfig, rank: int, world_size: int, split: str):
    if split not in ("train", "eval"):
        raise ValueError(f"split must be 'train' or 'eval', got '{split}'")
    num_batches = None if split == "train" else cfg.eval_batches
    if cfg.source == "synthetic":
        return SyntheticDataset(cfg.schema, cfg.seed, cfg.batch_size, rank, world_size, split, num_batches,
                                max_candidates=cfg.max_candidates)
    from gem.data.parquet import ParquetDataset

    paths = cfg.paths if split == "train" else cfg.eval_paths
    key = "data.paths" if split == "train" else "data.eval_paths"
    if not paths:
        from gem.config import ConfigError

        raise ConfigError(key, f"no Parquet files for split '{split}'", [])
    return ParquetDataset(
        cfg.schema, list(paths), cfg.batch_size, rank, world_size, num_batches=num_batches, cycle=split == "train",
        allow_extra_columns=cfg.allow_extra_columns, check_rows="sample" if split == "train" else "all", key=key,
        max_candidates=cfg.max_candidates,
    )
