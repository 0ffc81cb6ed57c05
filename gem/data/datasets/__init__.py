"""Converters from public recommendation datasets' raw files to gem's Parquet layout (gem/data/parquet.py).

    python -m gem.data.datasets NAME --raw DIR --out DIR [--max-len 64] [--seed 0] [--max-bad 0]

NAME: movielens-1m, movielens-20m (also 25M / 32M), kuairand (1K or Pure), taobao. The download is a separate
step and the licences differ (docs/DATASETS.md). Each NAME has an experiment preset: `experiment=<NAME with _>`
(kuairand: kuairand_pure). How events become examples: gem/data/datasets/_events.py.
"""

from __future__ import annotations

from pathlib import Path

from gem.data.datasets._events import BadRows, Converted, RawError, write_examples

# name -> (module, variant)
DATASETS = {
    "movielens-1m": ("movielens", "1m"),
    "movielens-20m": ("movielens", "20m"),
    "kuairand": ("kuairand", ""),
    "taobao": ("taobao", ""),
}

__all__ = ["DATASETS", "BadRows", "Converted", "RawError", "convert"]


def convert(name: str, raw: str | Path, out: str | Path, *, max_len: int = 64, seed: int = 0, max_bad: int = 0,
            rows_per_file: int = 1_000_000, bad: BadRows | None = None) -> Converted:
    """Reads dataset `name`'s raw files from `raw` and writes out/train, out/eval and out/schema.yaml.

    A malformed row raises RawError naming its file and line, unless `max_bad` allows skipping that many (each is
    reported on stderr). Nothing is written under `out` unless the whole conversion succeeds."""
    import importlib

    if name not in DATASETS:
        raise ValueError(f"unknown dataset '{name}' (choose from {', '.join(DATASETS)})")
    if max_len < 1:
        raise ValueError(f"--max-len must be >= 1 (got {max_len})")
    if max_bad < 0:
        raise ValueError(f"--max-bad must be >= 0 (got {max_bad})")
    if rows_per_file < 1:
        raise ValueError(f"--rows-per-file must be >= 1 (got {rows_per_file})")
    raw = Path(raw)
    if not raw.is_dir():
        raise RawError(f"{raw}: not a directory (--raw is the folder holding the dataset's files)")
    module, variant = DATASETS[name]
    bad = bad if bad is not None else BadRows(max_bad)
    events, spec = importlib.import_module(f"gem.data.datasets.{module}").convert(raw, variant, bad)
    return write_examples(events, spec, Path(out), max_len, seed, rows_per_file, bad.count)
