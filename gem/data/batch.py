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
    """One batch of examples: R histories (requests) and C candidate rows scored against them.

    `sequence`: KJT, keys = sequence feature names; every key has the same lengths (the history lengths [R]),
    values per user ordered oldest to newest. `seq_offsets`: int64 [R+1] history offsets starting at 0.
    `max_seq_len`: host int, the longest history in the batch (0 when all are empty).
    Per candidate row: `sparse` (KJT of multi-hot sparse features, stride C; a request's own features are repeated
    on each of its candidates), `dense` float32 [C, num_dense], `labels` float32 [C, num_tasks] in `tasks` order.

    Request form: `cand_offsets` int64 [R+1] (starting at 0, ending at C): the candidates of request r are rows
    cand_offsets[r]:cand_offsets[r+1]; a request has at least one. `max_candidates`: host int, the most
    candidates of one request in the batch. `request_ids` int64 [R]: ids unique across the data set (GAUC groups
    candidates by them). Row form (`cand_offsets` None): one candidate per history, R = C.
    """

    sequence: KeyedJaggedTensor
    sparse: KeyedJaggedTensor
    dense: torch.Tensor
    labels: torch.Tensor
    seq_offsets: torch.Tensor
    max_seq_len: int
    cand_offsets: torch.Tensor | None = None
    max_candidates: int = 1
    request_ids: torch.Tensor | None = None

    @property
    def batch_size(self) -> int:
        """Candidate rows C (what the model scores; what samples/s counts)."""
        return int(self.dense.shape[0])

    @property
    def num_requests(self) -> int:
        """Histories R (= batch_size in the row form)."""
        return int(self.seq_offsets.shape[0]) - 1

    def _map(self, fn) -> Batch:
        """A batch with every tensor passed through fn (KJTs included); host ints kept."""
        return Batch(sequence=fn(self.sequence), sparse=fn(self.sparse), dense=fn(self.dense), labels=fn(self.labels),
                     seq_offsets=fn(self.seq_offsets), max_seq_len=self.max_seq_len,
                     cand_offsets=None if self.cand_offsets is None else fn(self.cand_offsets),
                     max_candidates=self.max_candidates,
                     request_ids=None if self.request_ids is None else fn(self.request_ids))

    def to(self, device: torch.device, non_blocking: bool = False) -> Batch:
        return self._map(lambda t: t.to(device=device, non_blocking=non_blocking))

    def record_stream(self, stream: torch.Stream) -> None:
        # Tells the caching allocator these tensors are used on `stream` (pipelined host-to-device copies).
        self.sequence.record_stream(stream)
        self.sparse.record_stream(stream)
        for t in (self.dense, self.labels, self.seq_offsets, self.cand_offsets, self.request_ids):
            if t is not None:
                t.record_stream(stream)

    def pin_memory(self) -> Batch:
        return self._map(lambda t: t.pin_memory())

    @property
    def seq_lengths(self) -> torch.Tensor:
        """History lengths [R] (int64), from the offsets."""
        return self.seq_offsets[1:] - self.seq_offsets[:-1]

    @property
    def num_candidates(self) -> torch.Tensor:
        """Candidates per request [R] (int64; all ones in the row form)."""
        if self.cand_offsets is None:
            return torch.ones(self.num_requests, dtype=torch.int64, device=self.seq_offsets.device)
        return self.cand_offsets[1:] - self.cand_offsets[:-1]

    def candidate_groups(self) -> torch.Tensor:
        """Per candidate row [C] the id of its request (request_ids when given, else the request's index in the
        batch): the groups of GAUC."""
        counts = self.num_candidates
        ids = self.request_ids if self.request_ids is not None else torch.arange(
            self.num_requests, device=counts.device)
        return torch.repeat_interleave(ids, counts, output_size=self.batch_size)


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
