"""Shared by the dataset converters: raw files read line by line (a bad row is named by file and line), ids mapped
to contiguous ranges, events turned into examples or requests and written as Parquet (gem/data/parquet.py's layout).

Rows (`form="rows"`): every event of a user is one example whose candidate is that event's item and whose history
is the user's previous events (oldest first, at most `max_len`, ties in time kept in file order). Each user's last
event (users with at least two events) goes to the eval split, the others to train (rows shuffled with `seed`,
since the Parquet reader deals rows out in file order).

Requests (`form="requests"`, datasets with sessions: `DATASETS` marks them): a user's events in time order, cut
where two consecutive ones are more than `request_gap_s` apart, are one request each; a request of n >
`max_candidates` events is cut into ceil(n / max_candidates) requests of consecutive events, as equal as possible.
A request's history is the user's events before its first event, chosen as for rows (so a request cut in pieces
has the earlier pieces in the later ones' histories); its candidates are its events in time order. Each user's last
request (users with at least two) goes to eval, the others to train (shuffled).

Columns (natural names, declared by the dataset's data preset configs/data/<dataset>[_requests].yaml and by the
`schema.yaml` written beside the files): the history `<item>_ids` and `<action>` (+ the dataset's per-event ids,
e.g. `category_ids`), oldest first; the candidate `<item>_id` and its attributes (e.g. `category_id`); one-id
features (`user_id`, ...) as integers; multi-hot item attributes (e.g. `genres`) as lists; dense features
`user_events` = log1p(number of earlier events of the user), `hours_since_last` = log1p(hours since the user's
previous event), then the dataset's own; one 0/1 column per task. In the request form every per-event column (the
candidate, its attributes, the per-event ids that replace the dataset's own dense features, the labels) is a list
with one entry per candidate, and the request's own columns (`user_id`, `user_events`, `hours_since_last`, taken at
its first event) hold one value.
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
    cand_ids: dict[str, array] = field(default_factory=dict)  # request form only: per-event ids that stand in for
    # the dataset's own dense features (a request's dense features are the request's, not its candidates')

    def __post_init__(self) -> None:
        for cols, make in ((self.seq, _ints), (self.sparse, _ints), (self.labels, _floats), (self.cand_ids, _ints)):
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
    cand_id_cards: dict[str, int] = field(default_factory=dict)  # Events.cand_ids column -> cardinality (a table
    # each; request form only)


USER = "user_id"  # the one Events.sparse column that is the user's: a request's own feature in the request form


DENSE = ["user_events", "hours_since_last"]
FORMS = ("rows", "requests")


def schema_dict(spec: Spec, max_len: int, embedding_dim: int = 16, form: str = "rows",
                max_candidates: int = 1) -> dict:
    """The data group's declaration (features, histories, labels, tables; `max_candidates` for requests) of the
    converted files. Requests: every per-event sparse column is a candidate feature (on the table it shares with a
    history column, else its own), the dataset's own dense features give way to its per-event ids (cand_ids)."""
    requests = form == "requests"
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
            features[col] = {"kind": "candidate" if requests and col != USER else "sparse", "table": table}
            tables[table] = card
    if requests:
        for col, card in spec.cand_id_cards.items():
            features[col] = {"kind": "candidate", "table": col}
            tables[col] = card
    for col, (_, card) in spec.item_multi.items():
        features[col] = {"kind": "sparse", "table": col, "max_hot": max(multi_hot[col], 1), "min_hot": 0}
        tables[col] = card
    for col in DENSE + ([] if requests else spec.dense_names):
        features[col] = {"kind": "dense"}
    pooled = {t for f in features.values() if f["kind"] == "sparse" for t in [f["table"]]}
    return {
        **({"max_candidates": max_candidates} if requests else {}),
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
    """A list column: row i holds the next lengths[i] of `values` (int64 ids, or labels as they are)."""
    offsets = np.zeros(len(lengths) + 1, dtype=np.int32)
    np.cumsum(lengths, out=offsets[1:])
    values = values if values.dtype.kind == "f" else values.astype(np.int64, copy=False)
    return pa.ListArray.from_arrays(pa.array(offsets), pa.array(values))


def split_requests(user: np.ndarray, time_s: np.ndarray, gap_s: float, max_candidates: int
                   ) -> tuple[np.ndarray, np.ndarray]:
    """Requests of events sorted by (user, time): (first event [R], events [R]). A request is a run of one user's
    events at most `gap_s` apart; a run of n > max_candidates events becomes ceil(n / max_candidates) runs of
    consecutive events whose sizes differ by at most one (the larger first)."""
    n = len(user)
    cut = np.r_[True, (user[1:] != user[:-1]) | (np.diff(time_s) > gap_s)]
    run_start = np.flatnonzero(cut)
    run_len = np.diff(np.r_[run_start, n])
    pieces = -(-run_len // max_candidates)
    base, extra = np.repeat(run_len // pieces, pieces), np.repeat(run_len % pieces, pieces)
    j = np.arange(int(pieces.sum())) - np.repeat(np.cumsum(pieces) - pieces, pieces)  # piece within its run
    return np.repeat(run_start, pieces) + j * base + np.minimum(j, extra), base + (j < extra)


@dataclass
class Converted:
    out: Path
    train_rows: int  # rows written: examples, or requests in the request form
    eval_rows: int
    schema: dict
    skipped: int
    form: str = "rows"
    train_candidates: int = 0  # events scored: = the rows in the row form
    eval_candidates: int = 0


def write_examples(ev: Events, spec: Spec, out: Path, max_len: int, seed: int, rows_per_file: int,
                   skipped: int = 0, form: str = "rows", max_candidates: int = 1,
                   request_gap_s: float = 1800.0) -> Converted:
    """Examples (form "rows") or requests ("requests") from the events, written to out/train/*.parquet,
    out/eval/*.parquet and out/schema.yaml. Nothing appears under `out` unless all of it was written."""
    if len(ev) == 0:
        raise RawError(f"{spec.name}: the raw files hold no events")
    requests = form == "requests"
    if requests and spec.item_multi:
        raise ValueError(f"{spec.name}: multi-hot item attributes have no request layout")
    schema = schema_dict(spec, max_len, form=form, max_candidates=max_candidates)
    Schema.from_dict(schema)  # the converted layout must be one gem reads
    user = np.asarray(ev.user, dtype=np.int64)
    time_s = np.asarray(ev.time_s, dtype=np.float64)
    order = np.lexsort((np.arange(len(user)), time_s, user))  # by user, then time, then file order
    user, time_s = user[order], time_s[order]
    first = np.r_[True, user[1:] != user[:-1]]
    start = np.maximum.accumulate(np.where(first, np.arange(len(user)), 0))
    pos = np.arange(len(user)) - start  # earlier events of the same user
    gap_h = np.where(pos > 0, np.maximum(time_s - np.r_[time_s[:1], time_s[:-1]], 0.0) / 3600.0, 0.0)
    cols = {
        "item": np.asarray(ev.item, dtype=np.int64)[order],
        "action": np.asarray(ev.action, dtype=np.int64)[order],
        "seq": {n: np.asarray(v, dtype=np.int64)[order] for n, v in ev.seq.items()},
        "sparse": {n: np.asarray(v, dtype=np.int64)[order] for n, v in ev.sparse.items()},
        "dense": [np.log1p(pos).astype(np.float32), np.log1p(gap_h).astype(np.float32)]
        + [np.asarray(d, dtype=np.float32)[order] for d in ev.dense],
        "labels": {n: np.asarray(v, dtype=np.float32)[order] for n, v in ev.labels.items()},
        "cand_ids": {n: np.asarray(v, dtype=np.int64)[order] for n, v in ev.cand_ids.items()},
    }
    multi = {}
    for name, (ids, _) in spec.item_multi.items():
        lens = np.array([len(v) for v in ids], dtype=np.int64)
        flat = np.array([i for v in ids for i in v], dtype=np.int64)
        multi[name] = (lens, np.cumsum(lens) - lens, flat)
    if requests:  # a unit = a request: its first event and its events
        first_ev, count = split_requests(user, time_s, request_gap_s, max_candidates)
    else:  # a unit = an event
        first_ev, count = np.arange(len(user)), np.ones(len(user), dtype=np.int64)
    unit_user = user[first_ev]
    last = np.r_[unit_user[1:] != unit_user[:-1], True]
    is_eval = last & (pos[first_ev] > 0)

    def history(rows: np.ndarray) -> dict[str, pa.ListArray]:
        hist_len = np.minimum(pos[rows], max_len)
        hist = _ranges(rows - hist_len, hist_len)
        out_cols = {f"{spec.item}_ids": _list_array(hist_len, cols["item"][hist]),
                    spec.action: _list_array(hist_len, cols["action"][hist])}
        for n, v in cols["seq"].items():
            out_cols[n] = _list_array(hist_len, v[hist])
        return out_cols

    def table(units: np.ndarray) -> pa.Table:
        rows, n = first_ev[units], count[units]  # each unit's first event and its events
        cand = _ranges(rows, n)

        def per_event(v: np.ndarray) -> pa.Array:  # requests: a list per row, one entry per candidate
            return _list_array(n, v[cand]) if requests else pa.array(v[rows])

        out_cols = history(rows)
        out_cols[f"{spec.item}_id"] = per_event(cols["item"])
        for name, v in cols["sparse"].items():
            out_cols[name] = pa.array(v[rows]) if name == USER else per_event(v)
        if requests:
            for name, v in cols["cand_ids"].items():
                out_cols[name] = per_event(v)
        for name, (lens, starts, flat) in multi.items():
            items = cols["item"][rows]
            out_cols[name] = _list_array(lens[items], flat[_ranges(starts[items], lens[items])])
        for name, d in zip(DENSE if requests else DENSE + spec.dense_names, cols["dense"]):
            out_cols[name] = pa.array(d[rows])
        for t in spec.tasks:
            out_cols[t] = per_event(cols["labels"][t])
        return pa.table(out_cols)

    rng = np.random.default_rng(seed)
    splits = {"train": rng.permutation(np.flatnonzero(~is_eval)), "eval": np.flatnonzero(is_eval)}
    if len(splits["train"]) == 0:
        raise RawError(f"{spec.name}: no training {'requests' if requests else 'examples'} (every user has a single "
                       f"{'request' if requests else 'event'})")
    out.mkdir(parents=True, exist_ok=True)
    for split in (*splits, "schema.yaml"):
        if (out / split).exists():
            raise RawError(f"{out / split}: already exists (remove it or pick another --out)")
    tmp = out / f".converting-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        for split, units in splits.items():
            (tmp / split).mkdir(parents=True)
            for k, lo in enumerate(range(0, len(units), rows_per_file)):
                chunk = units[lo: lo + rows_per_file]
                pq.write_table(table(chunk), tmp / split / f"part-{k:05d}.parquet", row_group_size=65536)
        (tmp / "schema.yaml").write_text(_schema_yaml(spec.name, schema, form))
        for name in (*splits, "schema.yaml"):
            os.replace(tmp / name, out / name)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return Converted(out, len(splits["train"]), len(splits["eval"]), schema, skipped, form,
                     int(count[splits["train"]].sum()), int(count[splits["eval"]].sum()))


def _schema_yaml(name: str, schema: dict, form: str = "rows") -> str:
    from omegaconf import OmegaConf

    how = f" --form {form}" if form != "rows" else ""
    head = (f"# The declaration of these files (python -m gem.data.datasets {name}{how}): data.features, histories,\n"
            f"# labels and tables, sized for them; the data preset for this dataset holds the full dataset's sizes.\n")
    return head + OmegaConf.to_yaml(OmegaConf.create(schema))
