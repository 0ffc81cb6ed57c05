"""Parquet examples -> Batch.

File layout: one row = one user-candidate example.
    <sequence feature>   list<int64>   the user's history for that feature, oldest first; all sequence columns of
                                       a row have the same length (e.g. hist_item, hist_action)
    <sparse feature>     list<int64>   multi-hot ids (e.g. cand_item: one id)
    dense_0 .. dense_{n-1}  float32    dense features
    <task name>          float32 or integer, 0/1 (e.g. click, conversion)
Other columns are ignored. `write_parquet` writes this layout from any Batch source.

Reading: the files (in the given order) form one stream of rows cut into global batches of `batch_size` rows;
rank r of W takes global batches r, r + W, ... (the same convention as the synthetic stream, so a world of W
reads the same rows as a world of 1, dealt out). Only the row groups a batch overlaps are read. Rows past the
last whole round of W batches are dropped. `cycle=True` repeats the files in the same order (no shuffling).
"""

from __future__ import annotations

import bisect
from collections.abc import Iterable, Iterator, Mapping
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import torch
from torch.utils.data import IterableDataset
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

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


def _ints(arr: pa.Array) -> torch.Tensor:
    return torch.from_numpy(np.array(arr.to_numpy(zero_copy_only=False), dtype=np.int64))  # writable copy


def table_to_batch(table: pa.Table, schema: DataSchema) -> Batch:
    """A Batch from rows in the layout above (columns by name)."""
    missing = [c for c in _columns(schema) if c not in table.column_names]
    if missing:
        raise ValueError(f"parquet: missing column '{missing[0]}' (have {table.column_names})")
    bsz = table.num_rows

    def jagged(name: str) -> tuple[torch.Tensor, torch.Tensor]:
        col = table.column(name).combine_chunks()
        if not pa.types.is_list(col.type) and not pa.types.is_large_list(col.type):
            raise ValueError(f"parquet: column '{name}' must be list<int64>, got {col.type}")
        if col.null_count:
            raise ValueError(f"parquet: column '{name}' has {col.null_count} null rows")
        return _ints(col.value_lengths()), _ints(col.flatten())

    seq = [jagged(n) for n in schema.sequence_names]
    sparse = [jagged(n) for n in schema.sparse_names]
    hist = seq[0][0] if seq else torch.zeros(bsz, dtype=torch.int64)
    for name, (lens, _) in zip(schema.sequence_names, seq):
        if not torch.equal(lens, hist):
            b = int((lens != hist).nonzero()[0])
            raise ValueError(
                f"parquet: sequence column '{name}' has length {int(lens[b])} at row {b}, "
                f"'{schema.sequence_names[0]}' has {int(hist[b])}"
            )

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
    the pass. Resumable: `state_dict()` / `load_state_dict()` hold this rank's batch index.
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
    ) -> None:
        super().__init__()
        if world_size < 1 or not 0 <= rank < world_size:
            raise ValueError(f"need 0 <= rank < world_size, got rank={rank} world_size={world_size}")
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        self.schema, self.batch_size, self.rank, self.world_size = schema, batch_size, rank, world_size
        self.paths = expand_paths(paths)
        self.cycle = cycle
        self._columns = _columns(schema)
        # Row-group index over all files: global row start of each (file, row group).
        self._groups: list[tuple[int, int]] = []
        self._starts: list[int] = []
        total = 0
        for f, path in enumerate(self.paths):
            meta = pq.ParquetFile(path).metadata
            names = set(meta.schema.to_arrow_schema().names)
            for c in self._columns:
                if c not in names:
                    raise ValueError(f"parquet file '{path}': missing column '{c}'")
            for g in range(meta.num_row_groups):
                n = meta.row_group(g).num_rows
                if n:
                    self._groups.append((f, g))
                    self._starts.append(total)
                    total += n
        self.num_rows = total
        per_rank = (total // batch_size) // world_size
        if per_rank == 0:
            raise ValueError(
                f"parquet: {total} rows make no whole batch of {batch_size} for each of {world_size} ranks"
            )
        self.batches_per_pass = per_rank if num_batches is None else min(num_batches, per_rank)
        self._files: dict[int, pq.ParquetFile] = {}
        self._cache: tuple[int, pa.Table] | None = None
        self._position = 0

    def _row_group(self, i: int) -> pa.Table:
        if self._cache is None or self._cache[0] != i:
            f, g = self._groups[i]
            if f not in self._files:
                self._files[f] = pq.ParquetFile(self.paths[f])
            self._cache = (i, self._files[f].read_row_group(g, columns=self._columns))
        return self._cache[1]

    def _rows(self, start: int, stop: int) -> pa.Table:
        parts = []
        i = bisect.bisect_right(self._starts, start) - 1
        while start < stop:
            table = self._row_group(i)
            lo = start - self._starts[i]
            take = min(stop - start, table.num_rows - lo)
            parts.append(table.slice(lo, take))
            start += take
            i += 1
        return parts[0] if len(parts) == 1 else pa.concat_tables(parts)

    def batch(self, index: int) -> Batch:
        """This rank's batch number `index` (wraps around the files when cycling)."""
        if not self.cycle and index >= self.batches_per_pass:
            raise IndexError(f"batch {index} is past the end ({self.batches_per_pass} batches per rank)")
        g = (index % self.batches_per_pass) * self.world_size + self.rank
        return table_to_batch(self._rows(g * self.batch_size, (g + 1) * self.batch_size), self.schema)

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
