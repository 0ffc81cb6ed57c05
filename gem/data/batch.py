"""The training batch: jagged histories + multi-hot sparse features + dense + labels (see docs/DATA.md)."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import torch
from torch.utils.data import get_worker_info
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor
from torchrec.streamable import Pipelineable


@dataclass(eq=False)  # tensors have no single truth value; compare fields explicitly
class Batch(Pipelineable):
    """One batch of user-candidate examples.

    `sequence`: KJT, keys = sequence feature names; every key has the same lengths (the history lengths [B]),
    values per user ordered oldest to newest. `sparse`: KJT of multi-hot sparse features. `dense`: float32
    [B, num_dense]. `labels`: float32 [B, num_tasks] in `tasks` order. `seq_offsets`: int64 [B+1] history offsets
    starting at 0. `max_seq_len`: host int, the longest history in the batch (0 when all are empty).
    """

    sequence: KeyedJaggedTensor
    sparse: KeyedJaggedTensor
    dense: torch.Tensor
    labels: torch.Tensor
    seq_offsets: torch.Tensor
    max_seq_len: int

    @property
    def batch_size(self) -> int:
        return int(self.dense.shape[0])

    def to(self, device: torch.device, non_blocking: bool = False) -> Batch:
        return Batch(
            sequence=self.sequence.to(device=device, non_blocking=non_blocking),
            sparse=self.sparse.to(device=device, non_blocking=non_blocking),
            dense=self.dense.to(device=device, non_blocking=non_blocking),
            labels=self.labels.to(device=device, non_blocking=non_blocking),
            seq_offsets=self.seq_offsets.to(device=device, non_blocking=non_blocking),
            max_seq_len=self.max_seq_len,
        )

    def record_stream(self, stream: torch.Stream) -> None:
        # Tells the caching allocator these tensors are used on `stream` (pipelined host-to-device copies).
        self.sequence.record_stream(stream)
        self.sparse.record_stream(stream)
        for t in (self.dense, self.labels, self.seq_offsets):
            t.record_stream(stream)

    def pin_memory(self) -> Batch:
        return Batch(
            sequence=self.sequence.pin_memory(),
            sparse=self.sparse.pin_memory(),
            dense=self.dense.pin_memory(),
            labels=self.labels.pin_memory(),
            seq_offsets=self.seq_offsets.pin_memory(),
            max_seq_len=self.max_seq_len,
        )

    @property
    def seq_lengths(self) -> torch.Tensor:
        """History lengths [B] (int64), from the offsets."""
        return self.seq_offsets[1:] - self.seq_offsets[:-1]


def stream_batches(dataset, end: int | None) -> Iterator[Batch]:
    """Yield `dataset.batch(i)` from its `_position` up to `end` (None: endless), advancing the position.

    Under DataLoader workers, worker w takes the batches start + w, start + w + n, ...; the DataLoader's
    round-robin over workers then restores the single-process order from any start position."""
    info = get_worker_info()
    worker, workers = (info.id, info.num_workers) if info is not None else (0, 1)
    i = start = dataset._position
    while end is None or i < end:
        if (i - start) % workers == worker:
            b = dataset.batch(i)
            dataset._position = i + 1
            yield b
        i += 1
    dataset._position = 0
