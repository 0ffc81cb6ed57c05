"""Shared by the dataset converters: raw files read line by line (a bad row is named by file and line), ids mapped
to contiguous ranges, events turned into examples and written as Parquet (gem/data/parquet.py's layout).

Examples: every event of a user is one example whose candidate is that event's item and whose history is the
user's previous events (oldest first, at most `max_len`, ties in time kept in file order). Each user's last event
(users with at least two events) goes to the eval split, the others to train (rows shuffled with `seed`, since
the Parquet reader deals rows out in file order).

Columns (natural names, declared by the dataset's data preset configs/data/<dataset>.yaml and by the `schema.yaml`
written beside the files): the history `<item>_ids` and `<action>` (+ the dataset's per-event ids, e.g.
`category_ids`), oldest first; the candidate `<item>_id` (an integer) and its attributes (e.g. `category_id`);
one-id features (`user_id`, ...) as integers; multi-hot item attributes (e.g. `genres`) as lists; dense features
`user_events` = log1p(number of earlier events of the user), `hours_since_last` = log1p(hours since the user's
previous event), then the dataset's own; one 0/1 column per task.
"""

from __future__ import annotations

import os
import shutil
import sys
from array import array
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from gem.data.schema import Schema


class RawError(ValueError):
    """A malformed raw row or file; the message starts with `file:line:` where there is a line."""


@dataclass
class BadRows:
    """Malformed rows: the first raises, unless `max_bad` allows skipping (each skipped row is reported)."""

    max_bad: int = 0
    count: int = 0
    stream: object = field(default=sys.stderr)

    def __call__(self, where: str, problem: str) -> None:
        if self.count >= self.max_bad:
            more = f" (after skipping {self.count} bad rows)" if self.count else ""
            raise RawError(f"{where}: {problem}{more}")
        self.count += 1
        print(f"skipped {where}: {problem}", file=self.stream, flush=True)


def raw_file(raw: Path, *names: str) -> Path:
    """The first of `names` present in `raw` (a dataset's files have one name per release)."""
    for name in names:
        if (raw / name).is_file():
            return raw / name
    raise RawError(f"{raw}: no {' or '.join(names)} (see docs/DATASETS.md for the download)")


_BOM = b"\xef\xbb\xbf"  # a UTF-8 byte-order mark


def text_lines(path: Path, encoding: str = "utf-8") -> Iterator[tuple[int, str]]:
    """(line number, line without its end) of a text file, decoded line by line: a UTF-8 byte-order mark at the
    start is skipped, and a line that is not `encoding` text raises RawError naming the file and line."""
    with open(path, "rb") as f:
        for n, raw in enumerate(f, 1):
            if n == 1:
                raw = raw.removeprefix(_BOM)
            try:
                line = raw.decode(encoding)
            except UnicodeDecodeError as e:
                raise RawError(f"{path}:{n}: not {encoding} text ({e.reason} at column {e.start + 1})") from None
            yield n, line.rstrip("\r\n")


def read_rows(path: Path, sep: str, fields: int, bad: BadRows, header: Sequence[str] | None = None,
              encoding: str = "utf-8") -> Iterator[tuple[str, list[str]]]:
    """(where, fields) per row of a delimited file without quoting. `header`: the first line must name these
    columns (in any order, others allowed) and rows come back in `header`'s order."""
    index = None
    for n, line in text_lines(path, encoding):
        where = f"{path}:{n}"
        if header is not None and index is None:
            cols = [c.strip() for c in line.split(sep)]
            missing = [c for c in header if c not in cols]
            if missing:
                raise RawError(f"{where}: header lacks column(s) {missing} (got {cols})")
            index, fields = [cols.index(c) for c in header], len(cols)
            continue
        if not line.strip():
            continue
        parts = line.split(sep)
        if len(parts) != fields:
            bad(where, f"expected {fields} fields separated by {sep!r}, got {len(parts)} ({line[:80]!r})")
            continue
        yield where, parts if index is None else [parts[i] for i in index]


def parse_int(text: str, what: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise ValueError(f"{what} is not an integer ({text!r})") from None


def parse_float(text: str, what: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise ValueError(f"{what} is not a number ({text!r})") from None
    if not np.isfinite(value):
        raise ValueError(f"{what} is not finite ({text!r})")
    return value


class Vocab:
    """Raw id -> contiguous id in order of first appearance."""

    def __init__(self) -> None:
        self.ids: dict[str, int] = {}

    def __call__(self, raw: str) -> int:
        i = self.ids.get(raw)
        if i is None:
            i = self.ids[raw] = len(self.ids)
        return i

    def __len__(self) -> int:
        return len(self.ids)


def _ints() -> array:
    return array("q")


def _floats() -> array:
    return array("d")


@dataclass
class Events:
    """The raw events of a dataset, one entry per event in file order (contiguous ids). Columns are typed arrays
    (8 bytes a value, not a Python object each): empty lists given for them become arrays."""

    user: array = field(default_factory=_ints)
    time_s: array = field(default_factory=_floats)
    item: array = field(default_factory=_ints)
    action: array = field(default_factory=_ints)
    seq: dict[str, array] = field(default_factory=dict)  # more per-event ids that join the history
    sparse: dict[str, array] = field(default_factory=dict)  # one-hot candidate features, per event
    dense: list[array] = field(default_factory=list)  # the dataset's dense features, one column per feature
    labels: dict[str, array] = field(default_factory=dict)

    def __post_init__(self) -> None:
        for cols, make in ((self.seq, _ints), (self.sparse, _ints), (self.labels, _floats)):
            for name in cols:
                cols[name] = make()
        self.dense = [_floats() for _ in self.dense]

    def __len__(self) -> int:
        return len(self.item)


@dataclass
class Spec:
    """What a converter produced: names, cardinalities, multi-hot features per item, the label names."""

    name: str
    item: str  # the item's name: the history column `<item>_ids`, the candidate `<item>_id`, the table `<item>`
    num_items: int
    action: str  # the history's event-type column (and table)
    num_actions: int
    seq_cards: dict[str, tuple[str, int]]  # more history columns -> (table, cardinality)
    sparse_cards: dict[str, int]  # one id per example (Events.sparse) -> cardinality; a table each
    item_multi: dict[str, tuple[list[list[int]], int]]  # name -> (ids per item, cardinality)
    tasks: list[str]
    dense_names: list[str]  # the dataset's own dense columns (Events.dense, in order)
    candidate_attrs: dict[str, str] = field(default_factory=dict)  # Events.sparse column -> table shared with
    # a history column (the candidate's attribute, e.g. its category)


DENSE = ["user_events", "hours_since_last"]


def schema_dict(spec: Spec, max_len: int, embedding_dim: int = 16) -> dict:
    """The data group's declaration (features, histories, labels, tables) of the converted files."""
    multi_hot = {name: max((len(v) for v in ids), default=1) for name, (ids, _) in spec.item_multi.items()}
    items, cand = f"{spec.item}_ids", f"{spec.item}_id"
    features = {items: {"kind": "sequence", "table": spec.item, "history": "events"},
                spec.action: {"kind": "sequence", "table": spec.action, "history": "events"}}
    tables = {spec.item: spec.num_items, spec.action: spec.num_actions}
    for col, (table, card) in spec.seq_cards.items():
        features[col] = {"kind": "sequence", "table": table, "history": "events"}
        tables[table] = card
    features[cand] = {"kind": "candidate", "table": spec.item}
    for col, card in spec.sparse_cards.items():
        if col in spec.candidate_attrs:
            features[col] = {"kind": "candidate", "table": spec.candidate_attrs[col]}
        else:
            table = col.removesuffix("_id")
            features[col] = {"kind": "sparse", "table": table}
            tables[table] = card
    for col, (_, card) in spec.item_multi.items():
        features[col] = {"kind": "sparse", "table": col, "max_hot": max(multi_hot[col], 1), "min_hot": 0}
        tables[col] = card
    for col in DENSE + spec.dense_names:
        features[col] = {"kind": "dense"}
    pooled = {t for f in features.values() if f["kind"] == "sparse" for t in [f["table"]]}
    return {
        "features": features,
        "histories": {"events": {"max_len": max_len, "min_len": 0}},
        "labels": {t: t for t in spec.tasks},
        "tables": {t: {"num_embeddings": max(n, 1), "embedding_dim": embedding_dim, "init_range": 0.05,
                       **({"pooling": "mean" if t in spec.item_multi else "sum"} if t in pooled else {})}
                   for t, n in tables.items()},
    }


def _ranges(starts: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    """Concatenation of arange(s, s + n) for each (s, n)."""
    total = int(lengths.sum())
    offsets = np.repeat(np.cumsum(lengths) - lengths, lengths)
    return np.repeat(starts, lengths) + (np.arange(total, dtype=np.int64) - offsets)


def _list_array(lengths: np.ndarray, values: np.ndarray) -> pa.ListArray:
    offsets = np.zeros(len(lengths) + 1, dtype=np.int32)
    np.cumsum(lengths, out=offsets[1:])
    return pa.ListArray.from_arrays(pa.array(offsets), pa.array(values.astype(np.int64, copy=False)))


@dataclass
class Converted:
    out: Path
    train_rows: int
    eval_rows: int
    schema: dict
    skipped: int


def write_examples(ev: Events, spec: Spec, out: Path, max_len: int, seed: int, rows_per_file: int,
                   skipped: int = 0) -> Converted:
    """Examples from the events, written to out/train/*.parquet, out/eval/*.parquet and out/schema.yaml. Nothing
    appears under `out` unless all of it was written."""
    if len(ev) == 0:
        raise RawError(f"{spec.name}: the raw files hold no events")
    schema = schema_dict(spec, max_len)
    Schema.from_dict(schema)  # the converted layout must be one gem reads
    user = np.asarray(ev.user, dtype=np.int64)
    time_s = np.asarray(ev.time_s, dtype=np.float64)
    order = np.lexsort((np.arange(len(user)), time_s, user))  # by user, then time, then file order
    user, time_s = user[order], time_s[order]
    first = np.r_[True, user[1:] != user[:-1]]
    start = np.maximum.accumulate(np.where(first, np.arange(len(user)), 0))
    pos = np.arange(len(user)) - start  # earlier events of the same user
    last = np.r_[user[1:] != user[:-1], True]
    is_eval = last & (pos > 0)
    gap_h = np.where(pos > 0, np.maximum(time_s - np.r_[time_s[:1], time_s[:-1]], 0.0) / 3600.0, 0.0)
    cols = {
        "item": np.asarray(ev.item, dtype=np.int64)[order],
        "action": np.asarray(ev.action, dtype=np.int64)[order],
        "seq": {n: np.asarray(v, dtype=np.int64)[order] for n, v in ev.seq.items()},
        "sparse": {n: np.asarray(v, dtype=np.int64)[order] for n, v in ev.sparse.items()},
        "dense": [np.log1p(pos).astype(np.float32), np.log1p(gap_h).astype(np.float32)]
        + [np.asarray(d, dtype=np.float32)[order] for d in ev.dense],
        "labels": {n: np.asarray(v, dtype=np.float32)[order] for n, v in ev.labels.items()},
    }
    multi = {}
    for name, (ids, _) in spec.item_multi.items():
        lens = np.array([len(v) for v in ids], dtype=np.int64)
        flat = np.array([i for v in ids for i in v], dtype=np.int64)
        multi[name] = (lens, np.cumsum(lens) - lens, flat)

    def table(rows: np.ndarray) -> pa.Table:
        hist_len = np.minimum(pos[rows], max_len)
        hist = _ranges(rows - hist_len, hist_len)
        out_cols = {f"{spec.item}_ids": _list_array(hist_len, cols["item"][hist]),
                    spec.action: _list_array(hist_len, cols["action"][hist])}
        for n, v in cols["seq"].items():
            out_cols[n] = _list_array(hist_len, v[hist])
        out_cols[f"{spec.item}_id"] = pa.array(cols["item"][rows])
        for n, v in cols["sparse"].items():
            out_cols[n] = pa.array(v[rows])
        for n, (lens, starts, flat) in multi.items():
            items = cols["item"][rows]
            out_cols[n] = _list_array(lens[items], flat[_ranges(starts[items], lens[items])])
        for name, d in zip(DENSE + spec.dense_names, cols["dense"]):
            out_cols[name] = pa.array(d[rows])
        for t in spec.tasks:
            out_cols[t] = pa.array(cols["labels"][t][rows])
        return pa.table(out_cols)

    rng = np.random.default_rng(seed)
    splits = {"train": rng.permutation(np.flatnonzero(~is_eval)), "eval": np.flatnonzero(is_eval)}
    if len(splits["train"]) == 0:
        raise RawError(f"{spec.name}: no training examples (every user has a single event)")
    out.mkdir(parents=True, exist_ok=True)
    for split in (*splits, "schema.yaml"):
        if (out / split).exists():
            raise RawError(f"{out / split}: already exists (remove it or pick another --out)")
    tmp = out / f".converting-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        for split, rows in splits.items():
            (tmp / split).mkdir(parents=True)
            for k, lo in enumerate(range(0, len(rows), rows_per_file)):
                chunk = rows[lo: lo + rows_per_file]
                pq.write_table(table(chunk), tmp / split / f"part-{k:05d}.parquet", row_group_size=65536)
        (tmp / "schema.yaml").write_text(_schema_yaml(spec.name, schema))
        for name in (*splits, "schema.yaml"):
            os.replace(tmp / name, out / name)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return Converted(out, len(splits["train"]), len(splits["eval"]), schema, skipped)


def _schema_yaml(name: str, schema: dict) -> str:
    from omegaconf import OmegaConf

    head = (f"# The declaration of these files (python -m gem.data.datasets {name}): data.features, histories,\n"
            f"# labels and tables, sized for them; the data preset for this dataset holds the full dataset's sizes.\n")
    return head + OmegaConf.to_yaml(OmegaConf.create(schema))
