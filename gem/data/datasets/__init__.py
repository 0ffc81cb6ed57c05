"""Converters from public recommendation datasets' raw files to gem's Parquet layout (gem/data/parquet.py).

    python -m gem.data.datasets NAME --raw DIR --out DIR [--max-len 64] [--seed 0] [--max-bad 0]
                                [--form rows|requests] [--max-candidates 32] [--request-gap 1800]

NAME: movielens-1m, movielens-20m (also 25M / 32M), kuairand (1K or Pure), taobao. The download is a separate
step and the licences differ (docs/DATASETS.md). Each NAME has an experiment preset: `experiment=<NAME with _>`
(kuairand: kuairand_pure); the datasets with sessions (kuairand, taobao) also write requests, one row per request
with its candidates as lists (`--form requests`, presets kuairand_requests and taobao_requests). How events become
examples and requests: gem/data/datasets/_events.py.
"""

from __future__ import annotations

from pathlib import Path

from gem.data.datasets._events import FORMS, BadRows, Converted, RawError, write_examples

# name -> (module, variant)
DATASETS = {
    "movielens-1m": ("movielens", "1m"),
    "movielens-20m": ("movielens", "20m"),
    "kuairand": ("kuairand", ""),
    "taobao": ("taobao", ""),
}
# the datasets whose events come in sessions: they can be written as requests (--form requests)
REQUEST_DATASETS = ("kuairand", "taobao")
MAX_CANDIDATES = 32  # --max-candidates: the request presets' data.max_candidates
REQUEST_GAP_S = 1800.0  # --request-gap: a pause of more than 30 minutes starts a new session, as in DSIN (Feng et
# al., IJCAI 2019) on Alibaba's logs


def preset(name: str, form: str = "rows") -> str:
    """The experiment (and data) preset that reads dataset `name` converted in `form`."""
    base = {"kuairand": "kuairand_pure"}.get(name, name.replace("-", "_"))
    return base if form == "rows" else f"{name.replace('-', '_')}_requests"

__all__ = ["DATASETS", "REQUEST_DATASETS", "BadRows", "Converted", "RawError", "convert", "preset"]


def convert(name: str, raw: str | Path, out: str | Path, *, max_len: int = 64, seed: int = 0, max_bad: int = 0,
            rows_per_file: int = 1_000_000, bad: BadRows | None = None, form: str = "rows",
            max_candidates: int | None = None, request_gap_s: float | None = None) -> Converted:
    """Reads dataset `name`'s raw files from `raw` and writes out/train, out/eval and out/schema.yaml.

    form "rows": one example per event; "requests" (REQUEST_DATASETS): one row per request, a user's events at most
    `request_gap_s` apart (default REQUEST_GAP_S), at most `max_candidates` (default MAX_CANDIDATES) each.
    A malformed row raises RawError naming its file and line, unless `max_bad` allows skipping that many (each is
    reported on stderr). Nothing is written under `out` unless the whole conversion succeeds."""
    import importlib

    if name not in DATASETS:
        raise ValueError(f"unknown dataset '{name}' (choose from {', '.join(DATASETS)})")
    if form not in FORMS:
        raise ValueError(f"--form must be one of {', '.join(FORMS)} (got {form!r})")
    if form == "rows":
        for flag, value in (("--max-candidates", max_candidates), ("--request-gap", request_gap_s)):
            if value is not None:
                raise ValueError(f"{flag} applies to --form requests (got {value} with --form rows)")
    else:
        if name not in REQUEST_DATASETS:
            raise ValueError(f"--form requests: {name} has no sessions to group into requests (datasets with "
                             f"sessions: {', '.join(REQUEST_DATASETS)})")
        max_candidates = MAX_CANDIDATES if max_candidates is None else max_candidates
        request_gap_s = REQUEST_GAP_S if request_gap_s is None else request_gap_s
        if max_candidates < 2:
            raise ValueError(f"--max-candidates must be >= 2 (one candidate per row is --form rows) "
                             f"(got {max_candidates})")
        if not request_gap_s >= 0:  # NaN too
            raise ValueError(f"--request-gap must be >= 0 seconds (got {request_gap_s})")
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
    return write_examples(events, spec, Path(out), max_len, seed, rows_per_file, bad.count, form=form,
                          max_candidates=max_candidates or 1, request_gap_s=request_gap_s or 0.0)
