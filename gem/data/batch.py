"""The training batch: jagged histories + candidate + multi-hot sparse features + dense + labels (docs/DATA.md)."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import torch
from torch.utils.data import get_worker_info
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor
from torchrec.streamable import Pipelineable


@dataclass(eq=False)  # tensors have no single truth value; compare fields explicitly
class Batch(Pipelineable):
    """One batch: R examples (requests), each a history with 1 or more candidates, C candidates in all.

    `sequence`: KJT, the EmbeddingCollection's input (Schema.unpooled_names), stride R: every history's sequence
    features (the features of one history share its lengths, values per user oldest to newest), then the candidate
    features (each request's candidate ids, one per candidate: lengths = candidates per request, all 1 in the row
    form). `sparse`: KJT of the multi-hot sparse features (the EmbeddingBagCollection's input), stride R.
    `dense`: float32 [R, num_dense] (the dense features concatenated). `labels`: float32 [C, num_tasks] in task
    order, one row per candidate, requests one after another. `history_offsets`: per history (schema order) int64
    [R+1] offsets starting at 0; `history_max_lens`: host ints, each history's longest (0 when all are empty).
    `seq_offsets` / `max_seq_len`: the same over all histories of an example together (what the target interaction
    attends to; with one history they are that history's). `history_times`: per history with a declared timestamp
    column, float64 [T_h] event times (empty otherwise; a model that merges histories by time needs them).

    Requests (`data.max_candidates` > 1): `cand_offsets` int64 [R+1] from 0 to C, the candidates of request r are
    rows cand_offsets[r]:cand_offsets[r+1] of the labels and of each candidate feature's values; every request has
    one at least. `max_candidates`: host int, the most candidates of one request in the batch. `request_ids` int64
    [R]: ids unique across the data set (GAUC groups candidates by them; None: the request's index in the batch).
    The row form (`cand_offsets` None) is one candidate per example, C = R.
    """

    sequence: KeyedJaggedTensor
    sparse: KeyedJaggedTensor
    dense: torch.Tensor
    labels: torch.Tensor
    seq_offsets: torch.Tensor
    max_seq_len: int
    history_offsets: tuple[torch.Tensor, ...] = ()
    history_max_lens: tuple[int, ...] = ()
    history_times: tuple[torch.Tensor, ...] = ()
    cand_offsets: torch.Tensor | None = None
    max_candidates: int = 1
    request_ids: torch.Tensor | None = None

    def __post_init__(self) -> None:
        if not self.history_offsets:  # one history: the example's history is all of it
            self.history_offsets, self.history_max_lens = (self.seq_offsets,), (self.max_seq_len,)

    @property
    def batch_size(self) -> int:
        """Candidates C (what the model scores and samples/s counts; the examples R in the row form)."""
        return int(self.labels.shape[0])

    @property
    def num_requests(self) -> int:
        """Examples R (histories)."""
        return int(self.seq_offsets.shape[0]) - 1

    def _offsets_map(self, fn) -> tuple[torch.Tensor, tuple[torch.Tensor, ...]]:
        """(seq_offsets, history_offsets) through `fn`, one call per distinct tensor (one history: one copy)."""
        seq = fn(self.seq_offsets)
        return seq, tuple(seq if h is self.seq_offsets else fn(h) for h in self.history_offsets)

    def _request_fields(self, fn) -> dict:
        return {"cand_offsets": None if self.cand_offsets is None else fn(self.cand_offsets),
                "max_candidates": self.max_candidates,
                "request_ids": None if self.request_ids is None else fn(self.request_ids)}

    def to(self, device: torch.device, non_blocking: bool = False) -> Batch:
        seq, hist = self._offsets_map(lambda t: t.to(device=device, non_blocking=non_blocking))
        return Batch(
            sequence=self.sequence.to(device=device, non_blocking=non_blocking),
            sparse=self.sparse.to(device=device, non_blocking=non_blocking),
            dense=self.dense.to(device=device, non_blocking=non_blocking),
            labels=self.labels.to(device=device, non_blocking=non_blocking),
            seq_offsets=seq,
            max_seq_len=self.max_seq_len,
            history_offsets=hist,
            history_max_lens=self.history_max_lens,
            history_times=tuple(t.to(device=device, non_blocking=non_blocking) for t in self.history_times),
            **self._request_fields(lambda t: t.to(device=device, non_blocking=non_blocking)),
        )

    def record_stream(self, stream: torch.Stream) -> None:
        # Tells the caching allocator these tensors are used on `stream` (pipelined host-to-device copies).
        self.sequence.record_stream(stream)
        self.sparse.record_stream(stream)
        for t in (self.dense, self.labels, self.seq_offsets, *self.history_offsets, *self.history_times,
                  self.cand_offsets, self.request_ids):
            if t is not None:
                t.record_stream(stream)

    def pin_memory(self) -> Batch:
        seq, hist = self._offsets_map(lambda t: t.pin_memory())
        return Batch(
            sequence=self.sequence.pin_memory(),
            sparse=self.sparse.pin_memory(),
            dense=self.dense.pin_memory(),
            labels=self.labels.pin_memory(),
            seq_offsets=seq,
            max_seq_len=self.max_seq_len,
            history_offsets=hist,
            history_max_lens=self.history_max_lens,
            history_times=tuple(t.pin_memory() for t in self.history_times),
            **self._request_fields(lambda t: t.pin_memory()),
        )

    @property
    def seq_lengths(self) -> torch.Tensor:
        """History tokens per example over all histories [B] (int64), from the offsets."""
        return self.seq_offsets[1:] - self.seq_offsets[:-1]

    @property
    def num_candidates(self) -> torch.Tensor:
        """Candidates per request [R] (int64; all ones in the row form)."""
        if self.cand_offsets is None:
            return torch.ones(self.num_requests, dtype=torch.int64, device=self.seq_offsets.device)
        return self.cand_offsets[1:] - self.cand_offsets[:-1]

    def candidate_groups(self) -> torch.Tensor:
        """Per candidate [C] the id of its request (request_ids, else the request's index in the batch): GAUC's
        groups."""
        counts = self.num_candidates
        ids = self.request_ids if self.request_ids is not None else torch.arange(
            self.num_requests, device=counts.device)
        return torch.repeat_interleave(ids, counts, output_size=self.batch_size)


def lengths_to_offsets(lengths: torch.Tensor) -> torch.Tensor:
    """int64 offsets [B+1] starting at 0 from lengths [B]."""
    offsets = torch.zeros(lengths.numel() + 1, dtype=torch.int64)
    torch.cumsum(lengths.to(torch.int64), 0, out=offsets[1:])
    return offsets


def history_fields(lengths: list[torch.Tensor]) -> dict:
    """Batch's offset fields from each history's lengths [B] (host tensors)."""
    offs = [lengths_to_offsets(n) for n in lengths]
    maxes = [int(n.max()) if n.numel() else 0 for n in lengths]
    if len(offs) == 1:
        return {"seq_offsets": offs[0], "max_seq_len": maxes[0], "history_offsets": (offs[0],),
                "history_max_lens": (maxes[0],)}
    total = torch.stack(lengths).sum(0)
    return {"seq_offsets": lengths_to_offsets(total), "max_seq_len": int(total.max()) if total.numel() else 0,
            "history_offsets": tuple(offs), "history_max_lens": tuple(maxes)}


def request_fields(counts: torch.Tensor | None, request_ids: torch.Tensor | None = None) -> dict:
    """Batch's request fields from candidates per request [R] (host int64; None: the row form)."""
    if counts is None:
        return {}
    return {"cand_offsets": lengths_to_offsets(counts), "max_candidates": int(counts.max()) if counts.numel() else 1,
            "request_ids": request_ids}


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
