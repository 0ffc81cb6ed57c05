"""Parquet examples -> Batch.

File layout: one row = one user-candidate example; every column is named by the schema (gem/data/schema.py):
    sequence feature   list<integer>   the user's history, oldest first; the sequence columns of one history are
                                       equally long in a row (each history has its own length)
    candidate feature  integer, or list<integer> of exactly one id
    sparse feature     list<integer> of min_hot..max_hot ids, or integer (one id)
    dense feature      number (size 1), or a (fixed-size) list of `size` numbers
    label column       number or boolean, 0/1
    history timestamp  list<number> as long as the history's sequence columns (only where declared)
Several features may read one column. Other columns are an error unless `data.allow_extra_columns=true` (then they
are not read). `write_parquet` writes this layout from any Batch source.

Requests (`data.max_candidates` K > 1): one row = one request (one user's histories and own features, 1..K
candidates, docs/DATA.md): every candidate feature is a list<integer> of one id per candidate, every label column a
list of 0/1 (numbers or booleans) as long as the candidate lists, in the same order; the other columns as above,
once per request.

Checks, each failing with one line `<file>:<row>: <feature>: <what> (got <value>)` (row: 0-based, in the file): on
opening, every file's column names and types (from its metadata) and a sample of its row groups (the first and the
last; `check_rows="all"`: every row a pass reads, as for evaluation); then every batch as it is read: no nulls, the
sequence columns of a history equally long and at most its max_len, candidates one id, sparse ids per row within
[min_hot, max_hot], ids inside their table (raw-id tables: `hash: modulo` maps them into it, `hash: zch` takes
any int64), dense lists of their size with finite values, labels 0 or 1 (requests: 1..K candidates, every
candidate and label list of a row equally long).

Reading: the files (in the given order) form one stream of rows cut into global batches of `batch_size` rows;
rank r of W takes global batches r, r + W, ... (the same convention as the synthetic stream, so a world of W
reads the same rows as a world of 1, dealt out). Only the row groups a batch overlaps are read. Rows past the
last whole round of W batches are dropped. `cycle=True` repeats the files in the same order (no shuffling).
"""

from __future__ import annotations

import bisect
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any, Literal

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import torch
from torch.utils.data import IterableDataset
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from gem.config import UserError
from gem.data.batch import Batch, history_fields, request_fields, stream_batches
from gem.data.schema import Schema, expand_paths


def columns(schema: Schema) -> list[str]:
    """The columns the schema reads, each once, in declaration order (features, timestamps, labels)."""
    out = [f.column for f in schema.features]
    out += [h.timestamp for h in schema.histories if h.timestamp]
    out += [c for _, c in schema.labels]
    return list(dict.fromkeys(out))


def _list_array(lengths: torch.Tensor, values: torch.Tensor) -> pa.ListArray:
    offsets = torch.zeros(lengths.numel() + 1, dtype=torch.int32)
    torch.cumsum(lengths.to(torch.int64), 0, out=offsets[1:])
    return pa.ListArray.from_arrays(pa.array(offsets.numpy()), pa.array(values.to(torch.int64).numpy()))


def batch_to_table(batch: Batch, schema: Schema) -> pa.Table:
    """A Batch as rows of the layout above (candidates as integer columns, dense lists fixed-size; a request batch
    as request rows, candidates and labels as lists)."""
    requests = batch.cand_offsets is not None
    cols: dict[str, Any] = {}
    dense = batch.dense.to(torch.float32).numpy()
    d0 = 0
    for f in schema.features:
        if f.kind == "dense":
            block = np.ascontiguousarray(dense[:, d0:d0 + f.size])
            d0 += f.size
            cols[f.column] = pa.array(block[:, 0]) if f.size == 1 else pa.FixedSizeListArray.from_arrays(
                pa.array(block.reshape(-1)), f.size)
            continue
        jt = (batch.sequence if f.kind != "sparse" else batch.sparse)[f.name]
        if f.kind == "candidate" and not requests:
            cols[f.column] = pa.array(jt.values().to(torch.int64).numpy())
        else:
            cols[f.column] = _list_array(jt.lengths(), jt.values())
    if schema.has_times:
        for h, off, t in zip(schema.histories, batch.history_offsets, batch.history_times):
            cols[h.timestamp] = pa.ListArray.from_arrays(pa.array(off.to(torch.int32).numpy()),
                                                         pa.array(t.to(torch.float64).numpy()))
    labels = batch.labels.to(torch.float32).numpy()
    for t, (_, col) in enumerate(schema.labels):
        values = pa.array(np.ascontiguousarray(labels[:, t]))
        cols[col] = pa.ListArray.from_arrays(pa.array(batch.cand_offsets.to(torch.int32).numpy()), values) \
            if requests else values
    return pa.table(cols)


def write_parquet(dataset_or_batches: Iterable[Batch], path: str, num_batches: int, schema: Schema | None = None):
    """Writes the first `num_batches` batches of a dataset (or any iterable of Batch) to one Parquet file, one row
    group per batch. `schema` defaults to the dataset's `.schema`. Returns the number of rows written."""
    schema = schema if schema is not None else getattr(dataset_or_batches, "schema", None)
    if schema is None:
        raise ValueError("write_parquet: pass schema= when writing a plain iterable of batches")
    if num_batches < 1:
        raise ValueError(f"write_parquet: num_batches must be >= 1, got {num_batches}")
    rows, writer = 0, None
    try:
        for i, batch in enumerate(dataset_or_batches):
            if i >= num_batches:
                break
            table = batch_to_table(batch, schema)
            if writer is None:
                writer = pq.ParquetWriter(path, table.schema)
            writer.write_table(table, row_group_size=max(table.num_rows, 1))
            rows += table.num_rows
    finally:
        if writer is not None:
            writer.close()
    if writer is None:
        raise ValueError("write_parquet: the source yielded no batches")
    return rows


class DataFileError(UserError):
    """A Parquet input that does not match the schema; the message names the file and row."""


def _ints(arr: pa.Array) -> torch.Tensor:
    return torch.from_numpy(np.array(arr.to_numpy(zero_copy_only=False), dtype=np.int64))  # writable copy


def _is_list(t: pa.DataType) -> bool:
    return pa.types.is_list(t) or pa.types.is_large_list(t) or pa.types.is_fixed_size_list(t)


def _is_int_list(t: pa.DataType) -> bool:
    return _is_list(t) and pa.types.is_integer(t.value_type)


def _is_number(t: pa.DataType) -> bool:
    return pa.types.is_floating(t) or pa.types.is_integer(t)


def _type_problem(f, t: pa.DataType, requests: bool = False) -> str | None:
    """Why column type `t` cannot hold feature `f` (None: it can); `requests`: request rows (module doc)."""
    if f.kind == "candidate" and requests:
        return None if _is_int_list(t) else "must be a list of integers (one id per candidate of the request: " \
            "data.max_candidates > 1)"
    if f.kind == "sequence":
        return None if _is_int_list(t) else "must be a list of integers"
    if f.kind == "candidate" or (f.kind == "sparse" and f.max_hot == 1):
        return None if (pa.types.is_integer(t) or _is_int_list(t)) else "must be an integer or a list of integers"
    if f.kind == "sparse":
        return None if _is_int_list(t) else f"must be a list of integers (max_hot={f.max_hot})"
    if f.size == 1:
        return None if (_is_number(t) or (_is_list(t) and _is_number(t.value_type))) else "must be numbers"
    if _is_list(t) and _is_number(t.value_type):
        if pa.types.is_fixed_size_list(t) and t.list_size != f.size:
            return f"must hold lists of size {f.size}"
        return None
    return f"must be a list of {f.size} numbers"


def check_columns(names: list[str], types: list[pa.DataType], schema: Schema, where: str,
                  allow_extra: bool = False, max_candidates: int = 1) -> None:
    """Column names and types (a file's metadata or a table's schema) against the layout above (request rows when
    max_candidates > 1)."""
    requests = max_candidates > 1
    have = dict(zip(names, types))
    for c in columns(schema):
        if c not in have:
            users = [f.name for f in schema.features if f.column == c] or [t for t, col in schema.labels if col == c]
            raise DataFileError(where, f"missing column '{c}' (of {', '.join(users) or 'a history timestamp'})",
                                sorted(have))
    if not allow_extra:
        extra = [c for c in names if c not in set(columns(schema))]
        if extra:
            raise DataFileError(where, f"column '{extra[0]}' is not in the schema (data.allow_extra_columns=true "
                                "ignores it)", extra)
    for f in schema.features:
        why = _type_problem(f, have[f.column], requests)
        if why:
            raise DataFileError(where, f"feature '{f.name}': column '{f.column}' {why}", have[f.column])
    for h in schema.histories:
        if h.timestamp and not (_is_list(have[h.timestamp]) and _is_number(have[h.timestamp].value_type)):
            raise DataFileError(where, f"history '{h.name}': timestamp column '{h.timestamp}' must be a list of "
                                "numbers", have[h.timestamp])
    for task, c in schema.labels:
        t = have[c]
        if requests:
            if not (_is_list(t) and (_is_number(t.value_type) or pa.types.is_boolean(t.value_type))):
                raise DataFileError(where, f"label '{task}': column '{c}' must be a list of 0/1, one per candidate "
                                    "(data.max_candidates > 1)", t)
        elif not (_is_number(t) or pa.types.is_boolean(t)):
            raise DataFileError(where, f"label '{task}': column '{c}' must be numbers 0 or 1", t)


def _first(mask: np.ndarray) -> int:
    return int(np.flatnonzero(mask)[0])


def _row_of(lengths: np.ndarray, k: int) -> int:
    """The row holding flattened value k of a list column with these row lengths."""
    return int(np.searchsorted(np.cumsum(lengths), k, side="right"))


def _ids(col: pa.Array, name: str, where: Callable[[int], str]) -> tuple[np.ndarray, np.ndarray]:
    """(lengths, ids) of an integer or list<integer> column, nulls refused."""
    if col.null_count:
        raise DataFileError(where(_first(col.is_null().to_numpy(zero_copy_only=False))), f"feature '{name}': null",
                            None)
    if not _is_list(col.type):
        return np.ones(len(col), dtype=np.int64), col.to_numpy(zero_copy_only=False).astype(np.int64)
    lengths = col.value_lengths().to_numpy(zero_copy_only=False).astype(np.int64)
    values = col.flatten()
    if values.null_count:
        k = _first(values.is_null().to_numpy(zero_copy_only=False))
        raise DataFileError(where(_row_of(lengths, k)), f"feature '{name}': null id", None)
    return lengths, values.to_numpy(zero_copy_only=False).astype(np.int64)


def _floats(col: pa.Array, name: str, size: int, where: Callable[[int], str]) -> np.ndarray:
    """[rows, size] float32 of a number or list<number> column: nulls, sizes and finiteness checked."""
    if col.null_count:
        raise DataFileError(where(_first(col.is_null().to_numpy(zero_copy_only=False))), f"'{name}' is null", None)
    if _is_list(col.type):
        lengths = col.value_lengths().to_numpy(zero_copy_only=False) if not pa.types.is_fixed_size_list(col.type) \
            else np.full(len(col), col.type.list_size)
        bad = lengths != size
        if bad.any():
            i = _first(bad)
            raise DataFileError(where(i), f"dense feature '{name}': a list of {size} numbers is needed",
                                int(lengths[i]))
        values = col.flatten()
        if values.null_count:
            k = _first(values.is_null().to_numpy(zero_copy_only=False))
            raise DataFileError(where(k // size), f"dense feature '{name}': null value", None)
        v = values.to_numpy(zero_copy_only=False).astype(np.float32).reshape(len(col), size)
    else:
        v = col.to_numpy(zero_copy_only=False).astype(np.float32).reshape(len(col), 1)
    if not np.isfinite(v).all():
        i = _first(~np.isfinite(v).all(1))
        raise DataFileError(where(i), f"dense feature '{name}': values must be finite",
                            v[i].tolist() if size > 1 else float(v[i, 0]))
    return v


def read_table(table: pa.Table, schema: Schema, where: Callable[[int], str], max_candidates: int = 1
               ) -> dict[str, Any]:
    """The rows of `table` checked and decoded: feature -> (lengths, ids) / float block, label block, each
    history's lengths and, for request rows (max_candidates > 1), the candidates per row. `where(i)` names row i
    (e.g. 'file.parquet:17')."""
    requests = max_candidates > 1
    check_columns(table.column_names, [f.type for f in table.schema], schema, where(0), allow_extra=True,
                  max_candidates=max_candidates)
    cards, hashed, zch = schema.cardinalities(), schema.hashed(), schema.zch_features()
    cols = {c: table.column(c).combine_chunks() for c in columns(schema)}
    out: dict[str, Any] = {}
    for f in schema.features:
        if f.kind == "dense":
            out[f.name] = _floats(cols[f.column], f.name, f.size, where)
            continue
        lengths, ids = _ids(cols[f.column], f.name, where)
        lo, hi = ((1, max_candidates) if requests else (1, 1)) if f.kind == "candidate" else (f.min_hot, f.max_hot)
        if f.kind != "sequence":
            bad = (lengths < lo) | (lengths > hi)
            if bad.any():
                i = _first(bad)
                what = f"a request has 1..data.max_candidates={hi} candidates" if requests and f.kind == "candidate" \
                    else "a candidate has exactly one id" if f.kind == "candidate" else \
                    f"{'more' if lengths[i] > hi else 'fewer'} ids than {'max_hot' if lengths[i] > hi else 'min_hot'}" \
                    f"={hi if lengths[i] > hi else lo}"
                raise DataFileError(where(i), f"feature '{f.name}': {what}", int(lengths[i]))
        if f.name in hashed:
            ids = np.mod(ids, hashed[f.name])
        elif f.name not in zch:  # zch: the raw ids go to the model's managed-collision lookup as they are
            bad = (ids < 0) | (ids >= cards[f.name])
            if bad.any():
                k = _first(bad)
                raise DataFileError(where(_row_of(lengths, k)), f"feature '{f.name}': id outside its table "
                                    f"'{f.table}' range [0, {cards[f.name]})", int(ids[k]))
        out[f.name] = (lengths, ids)
    hist, times = {}, {}
    for h in schema.histories:
        names = schema.history_features(h.name)
        first = out[names[0]][0]
        for n in names[1:]:
            lengths = out[n][0]
            if not np.array_equal(lengths, first):
                i = _first(lengths != first)
                raise DataFileError(where(i), f"feature '{n}': history '{h.name}' has {int(first[i])} events in "
                                    f"'{names[0]}' but {int(lengths[i])} here (one history, one length per row)",
                                    int(lengths[i]))
        if h.timestamp:
            col = cols[h.timestamp]
            lengths = col.value_lengths().to_numpy(zero_copy_only=False) if col.null_count == 0 else None
            if lengths is None or not np.array_equal(lengths, first):
                i = _first(col.is_null().to_numpy(zero_copy_only=False)) if lengths is None else \
                    _first(lengths != first)
                raise DataFileError(where(i), f"history '{h.name}': timestamp column '{h.timestamp}' must be as long "
                                    f"as '{names[0]}'", None if lengths is None else int(lengths[i]))
            values = col.flatten()
            t = values.to_numpy(zero_copy_only=False).astype(np.float64)
            bad = ~np.isfinite(t)
            row = np.repeat(np.arange(len(first)), first)
            step = (np.diff(t) < 0) & (row[1:] == row[:-1])  # earlier than the event before it, in one row
            if bad.any() or step.any():
                k = _first(bad) if bad.any() else _first(step) + 1
                raise DataFileError(where(_row_of(first, k)), f"history '{h.name}': timestamps in '{h.timestamp}' "
                                    "must be finite and oldest first", float(t[k]))
            times[h.name] = t
        over = first > h.max_len
        if over.any():
            i = _first(over)
            raise DataFileError(where(i), f"feature '{names[0]}': history '{h.name}' is longer than "
                                f"data.histories.{h.name}.max_len={h.max_len}", int(first[i]))
        hist[h.name] = first
    counts = None
    if requests:  # every candidate feature and label list of a row: one entry per candidate
        cands = schema.candidate_names
        counts = out[cands[0]][0]
        for n in cands[1:]:
            if not np.array_equal(out[n][0], counts):
                i = _first(out[n][0] != counts)
                raise DataFileError(where(i), f"feature '{n}': {int(out[n][0][i])} candidates but "
                                    f"'{cands[0]}' has {int(counts[i])} (one id per candidate)", int(out[n][0][i]))
    labels = []
    for task, c in schema.labels:
        col = cols[c]
        if col.null_count:
            raise DataFileError(where(_first(col.is_null().to_numpy(zero_copy_only=False))), f"label '{task}' is "
                                "null", None)
        row_of = (lambda k: k) if counts is None else (lambda k: _row_of(counts, k))
        if counts is not None:
            n = col.value_lengths().to_numpy(zero_copy_only=False)
            if not np.array_equal(n, counts):
                i = _first(n != counts)
                raise DataFileError(where(i), f"label '{task}': {int(n[i])} labels for {int(counts[i])} candidates",
                                    int(n[i]))
            col = col.flatten()
            if col.null_count:
                k = _first(col.is_null().to_numpy(zero_copy_only=False))
                raise DataFileError(where(row_of(k)), f"label '{task}' is null", None)
        v = col.to_numpy(zero_copy_only=False).astype(np.float32)
        bad = (v != 0) & (v != 1)
        if bad.any():
            k = _first(bad)
            raise DataFileError(where(row_of(k)), f"label '{task}' must be 0 or 1", float(v[k]))
        labels.append(v)
    out["__labels__"] = np.stack(labels, 1) if labels else np.zeros((table.num_rows, 0), np.float32)
    out["__candidates__"] = counts
    out["__histories__"] = hist
    out["__times__"] = times
    return out


def check_rows(table: pa.Table, schema: Schema, where: Callable[[int], str], max_candidates: int = 1) -> None:
    """The values of rows in the layout above; raises DataFileError naming file:row and feature."""
    read_table(table, schema, where, max_candidates)


def table_to_batch(table: pa.Table, schema: Schema, where: Callable[[int], str] | None = None,
                   max_candidates: int = 1) -> Batch:
    """A Batch from rows in the layout above (columns by name), checked first; `where(i)` names row i in errors.
    max_candidates > 1: request rows (a request batch)."""
    r = read_table(table, schema, where or (lambda i: f"parquet row {i}"), max_candidates)
    counts = r["__candidates__"]
    bsz = table.num_rows

    def kjt(names: list[str]) -> KeyedJaggedTensor:
        if not names:
            return KeyedJaggedTensor(keys=[], values=torch.zeros(0, dtype=torch.int64),
                                     lengths=torch.zeros(0, dtype=torch.int64))
        return KeyedJaggedTensor(keys=names, values=torch.from_numpy(np.concatenate([r[n][1] for n in names])),
                                 lengths=torch.from_numpy(np.concatenate([r[n][0] for n in names])))

    dense = [r[n] for n in schema.dense_names]
    return Batch(
        sequence=kjt(schema.unpooled_names),
        sparse=kjt(schema.sparse_names),
        dense=torch.from_numpy(np.concatenate(dense, 1)) if dense else torch.zeros(bsz, 0),
        labels=torch.from_numpy(np.ascontiguousarray(r["__labels__"])),
        **history_fields([torch.from_numpy(r["__histories__"][h]) for h in schema.history_names]),
        history_times=tuple(torch.from_numpy(r["__times__"][h]) for h in schema.history_names)
        if schema.has_times else (),
        **request_fields(None if counts is None else torch.from_numpy(counts)),
    )


def check_files(cfg) -> None:
    """The files a parquet `data:` group (a DataConfig) names: every path or glob matches a file, and each file's
    columns and types (its metadata, no rows read) fit the declaration. Raises the one-line error; for `--check`."""
    if cfg.source != "parquet":
        return
    for key, paths in (("data.paths", cfg.paths), ("data.eval_paths", cfg.eval_paths)):
        for path in expand_paths(paths, key) if paths else []:
            try:
                arrow = pq.ParquetFile(path).metadata.schema.to_arrow_schema()
            except (OSError, pa.ArrowException) as e:
                raise DataFileError(path, "not a readable Parquet file", str(e).splitlines()[0]) from None
            check_columns(arrow.names, arrow.types, cfg.schema, path, cfg.allow_extra_columns, cfg.max_candidates)


class ParquetDataset(IterableDataset):
    """Batches of `batch_size` rows for one rank, read from Parquet files (paths or globs) row group by row group.

    `num_batches`: batches per rank in one pass (None: all whole rounds of the files). `cycle`: endless, repeating
    the pass. Resumable: `state_dict()` / `load_state_dict()` hold this rank's batch index. Opening checks every
    file's columns and `check_rows` of them up front: "sample" (each file's first and last row group) or "all"
    (every row one pass reads); the rest is checked batch by batch. `key`: the config key that named the files.
    """

    def __init__(
        self,
        schema: Schema,
        paths: Any,
        batch_size: int,
        rank: int = 0,
        world_size: int = 1,
        num_batches: int | None = None,
        cycle: bool = False,
        allow_extra_columns: bool = False,
        check_rows: Literal["sample", "all"] = "sample",
        key: str = "data.paths",
        max_candidates: int = 1,
    ) -> None:
        super().__init__()
        if world_size < 1 or not 0 <= rank < world_size:
            raise ValueError(f"need 0 <= rank < world_size, got rank={rank} world_size={world_size}")
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        self.schema, self.batch_size, self.rank, self.world_size = schema, batch_size, rank, world_size
        self.paths = expand_paths(paths, key)
        self.cycle = cycle
        self.max_candidates = max_candidates  # > 1: request rows
        self._columns = columns(schema)
        # Row-group index over all files: global row start of each (file, row group), and its start in its file.
        self._groups: list[tuple[int, int]] = []
        self._starts: list[int] = []
        self._file_starts: list[int] = []
        total = 0
        for f, path in enumerate(self.paths):
            try:
                meta = pq.ParquetFile(path).metadata
            except (OSError, pa.ArrowException) as e:
                raise DataFileError(path, "not a readable Parquet file", str(e).splitlines()[0]) from None
            arrow = meta.schema.to_arrow_schema()
            check_columns(arrow.names, arrow.types, schema, path, allow_extra_columns, max_candidates)
            in_file = 0
            for g in range(meta.num_row_groups):
                n = meta.row_group(g).num_rows
                if n:
                    self._groups.append((f, g))
                    self._starts.append(total)
                    self._file_starts.append(in_file)
                    total += n
                    in_file += n
        self.num_rows = total
        per_rank = (total // batch_size) // world_size
        if per_rank == 0:
            raise DataFileError(
                key, f"{total} rows make no whole batch of data.batch_size={batch_size} for each of {world_size} "
                "ranks", self.paths
            )
        self.batches_per_pass = per_rank if num_batches is None else min(num_batches, per_rank)
        self._files: dict[int, pq.ParquetFile] = {}
        self._cache: tuple[int, pa.Table] | None = None
        self._position = 0
        self._check_up_front(check_rows)

    def _check_up_front(self, mode: str) -> None:
        if mode == "all":
            last = bisect.bisect_left(self._starts, self.batches_per_pass * self.world_size * self.batch_size)
            picked = range(last)
        else:
            first_of_file: dict[int, int] = {}
            last_of_file: dict[int, int] = {}
            for i, (f, _) in enumerate(self._groups):
                first_of_file.setdefault(f, i)
                last_of_file[f] = i
            picked = sorted(set(first_of_file.values()) | set(last_of_file.values()))
        for i in picked:
            check_rows(self._row_group(i), self.schema, self._where([(0, i, 0)]), self.max_candidates)

    def _where(self, spans: list[tuple[int, int, int]]) -> Callable[[int], str]:
        """Row r of a table made of row-group slices -> 'file:row'; spans: (first table row, group, first group row)."""

        def where(r: int) -> str:
            k = bisect.bisect_right([s[0] for s in spans], r) - 1
            start, i, lo = spans[max(k, 0)]
            f = self._groups[i][0]
            return f"{self.paths[f]}:{self._file_starts[i] + lo + r - start}"

        return where

    def _row_group(self, i: int) -> pa.Table:
        if self._cache is None or self._cache[0] != i:
            f, g = self._groups[i]
            if f not in self._files:
                self._files[f] = pq.ParquetFile(self.paths[f])
            self._cache = (i, self._files[f].read_row_group(g, columns=self._columns))
        return self._cache[1]

    def _rows(self, start: int, stop: int) -> tuple[pa.Table, Callable[[int], str]]:
        parts, spans, n = [], [], 0
        i = bisect.bisect_right(self._starts, start) - 1
        while start < stop:
            table = self._row_group(i)
            lo = start - self._starts[i]
            take = min(stop - start, table.num_rows - lo)
            parts.append(table.slice(lo, take))
            spans.append((n, i, lo))
            n += take
            start += take
            i += 1
        return (parts[0] if len(parts) == 1 else pa.concat_tables(parts)), self._where(spans)

    def batch(self, index: int, rank: int | None = None) -> Batch:
        """This rank's (or `rank`'s) batch number `index` (wraps around the files when cycling)."""
        if not self.cycle and index >= self.batches_per_pass:
            raise IndexError(f"batch {index} is past the end ({self.batches_per_pass} batches per rank)")
        g = (index % self.batches_per_pass) * self.world_size + (self.rank if rank is None else rank)
        table, where = self._rows(g * self.batch_size, (g + 1) * self.batch_size)
        return table_to_batch(table, self.schema, where, self.max_candidates)

    def __iter__(self) -> Iterator[Batch]:
        return stream_batches(self, None if self.cycle else self.batches_per_pass)

    def last_rows(self) -> tuple[Batch, int] | None:
        """This rank's share of the rows past the last whole round of a pass over all the files, as (batch, real
        rows, or of request rows their candidates: the label rows that count): every rank gets a batch of the same size (collectives of sharded models need every rank's forward),
        its first `real rows` its own share in order, the rest repeats rows of the round (to be ignored). None on
        every rank when there are no such rows, or the pass stops earlier."""
        whole = self.batches_per_pass * self.world_size * self.batch_size
        if self.batches_per_pass < (self.num_rows // self.batch_size) // self.world_size or whole == self.num_rows:
            return None
        share = -(-(self.num_rows - whole) // self.world_size)
        start = min(whole + self.rank * share, self.num_rows)
        stop = min(start + share, self.num_rows)
        spans = [(start, stop)] if stop > start else []
        if stop - start < share:
            spans.append((whole, whole + share - (stop - start)))
        tables, wheres = zip(*(self._rows(a, b) for a, b in spans))
        table = tables[0] if len(tables) == 1 else pa.concat_tables(tables)
        first = tables[0].num_rows

        def where(r: int) -> str:
            return wheres[0](r) if r < first else wheres[-1](r - first)

        batch = table_to_batch(table, self.schema, where, self.max_candidates)
        real = stop - start  # rows; of a request batch, their candidates
        return batch, real if batch.cand_offsets is None else int(batch.cand_offsets[real])

    def __len__(self) -> int:
        if self.cycle:
            raise TypeError("a cycling ParquetDataset has no length")
        return self.batches_per_pass

    def state_dict(self) -> dict[str, int]:
        return {"batch_index": self._position, "world_size": self.world_size}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        index, saved_world = int(state["batch_index"]), int(state.get("world_size", self.world_size))
        if saved_world != self.world_size:
            raise ValueError(
                f"state was saved with world_size {saved_world}; this reader has {self.world_size} "
                "(rows are dealt per world size, so the position does not carry over)"
            )
        self._position = index
