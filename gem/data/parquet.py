"""Parquet examples -> Batch.

File layout: one row = one user-candidate example.
    <sequence feature>   list<int64>   the user's history for that feature, oldest first; all sequence columns of
                                       a row have the same length (e.g. hist_item, hist_action)
    <sparse feature>     list<int64>   multi-hot ids (e.g. cand_item: one id)
    dense_0 .. dense_{n-1}  float32    dense features
    <task name>          float32 or integer, 0/1 (e.g. click, conversion)
Other columns are an error unless `data.allow_extra_columns=true` (then they are not read). `write_parquet` writes
this layout from any Batch source.

Checks, each failing with one line `<file>:<row>: <what> (got <value>)` (row: 0-based, in the file): on opening,
every file's column names and types (from its metadata) and a sample of its row groups (the first and the last;
`check_rows="all"`: every row a pass reads, as for evaluation); then every batch as it is read: no nulls, the
sequence columns of a row equally long and at most history.max_len, ids inside their table, dense values finite,
labels 0 or 1.

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

from gem._config import UserError
from gem.data.batch import Batch, stream_batches
from gem.data.schema import DataSchema, expand_paths


def _columns(schema: DataSchema) -> list[str]:
    return [
        *schema.sequence_names,
        *schema.sparse_names,
        *(f"dense_{i}" for i in range(schema.num_dense)),
        *schema.tasks,
    ]


def _list_column(kjt: KeyedJaggedTensor, key: str) -> pa.ListArray:
    jt = kjt[key]
    lengths = jt.lengths().to(torch.int64)
    offsets = torch.zeros(lengths.numel() + 1, dtype=torch.int32)
    torch.cumsum(lengths, 0, out=offsets[1:])
    return pa.ListArray.from_arrays(pa.array(offsets.numpy()), pa.array(jt.values().to(torch.int64).numpy()))


def batch_to_table(batch: Batch, schema: DataSchema) -> pa.Table:
    cols: dict[str, Any] = {}
    for name in schema.sequence_names:
        cols[name] = _list_column(batch.sequence, name)
    for name in schema.sparse_names:
        cols[name] = _list_column(batch.sparse, name)
    dense = batch.dense.to(torch.float32).numpy()
    for i in range(schema.num_dense):
        cols[f"dense_{i}"] = pa.array(np.ascontiguousarray(dense[:, i]))
    labels = batch.labels.to(torch.float32).numpy()
    for t, task in enumerate(schema.tasks):
        cols[task] = pa.array(np.ascontiguousarray(labels[:, t]))
    return pa.table(cols)


def write_parquet(dataset_or_batches: Iterable[Batch], path: str, num_batches: int, schema: DataSchema | None = None):
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


def _is_int_list(t: pa.DataType) -> bool:
    return (pa.types.is_list(t) or pa.types.is_large_list(t)) and pa.types.is_integer(t.value_type)


def _is_number(t: pa.DataType) -> bool:
    return pa.types.is_floating(t) or pa.types.is_integer(t)


def check_columns(names: list[str], types: list[pa.DataType], schema: DataSchema, where: str,
                  allow_extra: bool = False) -> None:
    """Column names and types (a file's metadata or a table's schema) against the layout above."""
    have = dict(zip(names, types))
    for c in _columns(schema):
        if c not in have:
            raise DataFileError(where, f"missing column '{c}'", sorted(have))
    if not allow_extra:
        extra = [c for c in names if c not in set(_columns(schema))]
        if extra:
            raise DataFileError(
                where, f"column '{extra[0]}' is not in the schema (data.allow_extra_columns=true ignores it)", extra
            )
    for c in (*schema.sequence_names, *schema.sparse_names):
        if not _is_int_list(have[c]):
            raise DataFileError(where, f"column '{c}' must be a list of integers", have[c])
    for c in (f"dense_{i}" for i in range(schema.num_dense)):
        if not _is_number(have[c]):
            raise DataFileError(where, f"dense column '{c}' must be numbers", have[c])
    for c in schema.tasks:
        if not (_is_number(have[c]) or pa.types.is_boolean(have[c])):
            raise DataFileError(where, f"label column '{c}' must be numbers 0 or 1", have[c])


def _first(mask: np.ndarray) -> int:
    return int(np.flatnonzero(mask)[0])


def check_rows(table: pa.Table, schema: DataSchema, where: Callable[[int], str]) -> None:
    """The values of rows in the layout above; `where(i)` names row i of `table` (e.g. 'file.parquet:17')."""
    check_columns(table.column_names, [f.type for f in table.schema], schema, where(0), allow_extra=True)
    cards = schema.cardinalities()
    hist = None
    for c in (*schema.sequence_names, *schema.sparse_names):
        col = table.column(c).combine_chunks()
        if col.null_count:
            i = _first(col.is_null().to_numpy(zero_copy_only=False))
            raise DataFileError(where(i), f"column '{c}' is null", None)
        lengths = col.value_lengths().to_numpy(zero_copy_only=False).astype(np.int64)
        values = col.flatten()
        if values.null_count:
            k = _first(values.is_null().to_numpy(zero_copy_only=False))
            i = int(np.searchsorted(np.cumsum(lengths), k, side="right"))
            raise DataFileError(where(i), f"column '{c}' holds a null id", None)
        if c in schema.sequence_names:
            if hist is None:
                hist, first = lengths, c
                over = lengths > schema.history.max_len
                if over.any():
                    i = _first(over)
                    raise DataFileError(where(i), f"history '{c}' is longer than data.schema.history.max_len="
                                        f"{schema.history.max_len}", int(lengths[i]))
            elif not np.array_equal(lengths, hist):
                i = _first(lengths != hist)
                raise DataFileError(where(i), f"sequence column '{c}' must be as long as '{first}' "
                                    f"({int(hist[i])}) in each row", int(lengths[i]))
        ids = values.to_numpy(zero_copy_only=False)
        bad = (ids < 0) | (ids >= cards[c])
        if bad.any():
            k = _first(bad)
            i = int(np.searchsorted(np.cumsum(lengths), k, side="right"))
            raise DataFileError(where(i), f"column '{c}': id outside its table's range [0, {cards[c]})", int(ids[k]))
    for c in (f"dense_{i}" for i in range(schema.num_dense)):
        col = table.column(c).combine_chunks()
        if col.null_count:
            raise DataFileError(where(_first(col.is_null().to_numpy(zero_copy_only=False))), f"'{c}' is null", None)
        v = col.to_numpy(zero_copy_only=False).astype(np.float64)
        if not np.isfinite(v).all():
            i = _first(~np.isfinite(v))
            raise DataFileError(where(i), f"dense value '{c}' must be finite", float(v[i]))
    for c in schema.tasks:
        col = table.column(c).combine_chunks()
        if col.null_count:
            raise DataFileError(where(_first(col.is_null().to_numpy(zero_copy_only=False))), f"label '{c}' is null",
                                None)
        v = col.to_numpy(zero_copy_only=False).astype(np.float64)
        bad = (v != 0) & (v != 1)
        if bad.any():
            i = _first(bad)
            raise DataFileError(where(i), f"label '{c}' must be 0 or 1", float(v[i]))


def table_to_batch(table: pa.Table, schema: DataSchema, where: Callable[[int], str] | None = None) -> Batch:
    """A Batch from rows in the layout above (columns by name), checked first; `where(i)` names row i in errors."""
    check_rows(table, schema, where or (lambda i: f"parquet row {i}"))
    bsz = table.num_rows

    def jagged(name: str) -> tuple[torch.Tensor, torch.Tensor]:
        col = table.column(name).combine_chunks()
        return _ints(col.value_lengths()), _ints(col.flatten())

    seq = [jagged(n) for n in schema.sequence_names]
    sparse = [jagged(n) for n in schema.sparse_names]
    hist = seq[0][0] if seq else torch.zeros(bsz, dtype=torch.int64)

    def floats(names: list[str]) -> torch.Tensor:
        if not names:
            return torch.zeros(bsz, 0, dtype=torch.float32)
        cols = [table.column(n).to_numpy().astype(np.float32, copy=False) for n in names]
        return torch.from_numpy(np.stack(cols, axis=1))

    offsets = torch.zeros(bsz + 1, dtype=torch.int64)
    torch.cumsum(hist, 0, out=offsets[1:])
    return Batch(
        sequence=KeyedJaggedTensor(
            keys=schema.sequence_names,
            values=torch.cat([v for _, v in seq]),
            lengths=torch.cat([l for l, _ in seq]),
        ),
        sparse=KeyedJaggedTensor(
            keys=schema.sparse_names,
            values=torch.cat([v for _, v in sparse]),
            lengths=torch.cat([l for l, _ in sparse]),
        ),
        dense=floats([f"dense_{i}" for i in range(schema.num_dense)]),
        labels=floats(list(schema.tasks)),
        seq_offsets=offsets,
        max_seq_len=int(hist.max()) if bsz else 0,
    )


class ParquetDataset(IterableDataset):
    """Batches of `batch_size` rows for one rank, read from Parquet files (paths or globs) row group by row group.

    `num_batches`: batches per rank in one pass (None: all whole rounds of the files). `cycle`: endless, repeating
    the pass. Resumable: `state_dict()` / `load_state_dict()` hold this rank's batch index. Opening checks every
    file's columns and `check_rows` of them up front: "sample" (each file's first and last row group) or "all"
    (every row one pass reads); the rest is checked batch by batch. `key`: the config key that named the files.
    """

    def __init__(
        self,
        schema: DataSchema,
        paths: Any,
        batch_size: int,
        rank: int = 0,
        world_size: int = 1,
        num_batches: int | None = None,
        cycle: bool = False,
        allow_extra_columns: bool = False,
        check_rows: Literal["sample", "all"] = "sample",
        key: str = "data.paths",
    ) -> None:
        super().__init__()
        if world_size < 1 or not 0 <= rank < world_size:
            raise ValueError(f"need 0 <= rank < world_size, got rank={rank} world_size={world_size}")
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        self.schema, self.batch_size, self.rank, self.world_size = schema, batch_size, rank, world_size
        self.paths = expand_paths(paths, key)
        self.cycle = cycle
        self._columns = _columns(schema)
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
            check_columns(arrow.names, arrow.types, schema, path, allow_extra_columns)
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
            check_rows(self._row_group(i), self.schema, self._where([(0, i, 0)]))

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
        return table_to_batch(table, self.schema, where)

    def __iter__(self) -> Iterator[Batch]:
        return stream_batches(self, None if self.cycle else self.batches_per_pass)

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
