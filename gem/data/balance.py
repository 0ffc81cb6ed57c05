"""Balanced ranks: every rank gets an equal share of a step's work, not only an equal number of examples.

In synchronous data parallelism each step waits for the slowest rank, and a rank's work grows with its examples'
history lengths (linearly in the projections and MoE, quadratically in full attention). With `data.balance: cost`
each global batch is drawn exactly as with `none` (the W per-rank batches of the step, so a run of W ranks sees
the same examples as a run of 1), every rank computes the same partition of it into W parts of equal example
count (TorchRec's input dist and the KJT batch size stay uniform) and near-equal cost, and takes its part. The
split happens where the batch is made (the DataLoader workers), needs no communication and leaves the data
position alone: a checkpoint resumes at the same global batch.

Cost per example: the model's FLOP model (gem.model.flops.example_flops) on the example's history lengths, given to
`BalancedDataset` as a callable of {history name: lengths [B]}.

`partition`: balanced largest-first greedy with equal counts (each round of W items, taken in descending cost,
gives the largest to the part with the lowest load so far; past the first 256 rounds the parts' order is refreshed
64 times rather than every round), then up to 64 swaps of one item between the heaviest and the lightest part
while one lowers the largest load. Deterministic (stable sorts, ties by index), O(n log n).
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import numpy as np
import torch
from torch.utils.data import IterableDataset
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from gem.data.batch import Batch, history_fields, lengths_to_offsets, request_fields, stream_batches

CostFn = Callable[..., torch.Tensor]  # ({history: lengths [R]}[, candidates per request [R]]) -> cost [R]


def partition(costs: Any, parts: int, max_swaps: int = 64) -> np.ndarray:
    """Part id [n] of each item: `parts` parts of n / parts items each with near-equal cost sums.

    `costs`: n non-negative numbers, n a multiple of `parts`. Same input, same output (stable sorts).
    """
    c = np.asarray(costs, dtype=np.float64).reshape(-1)
    n = c.size
    if parts < 1 or n % parts:
        raise ValueError(f"{n} items do not split into {parts} parts of equal count")
    out = np.empty(n, dtype=np.int64)
    if parts == 1 or n == 0:
        out[:] = 0
        return out
    order = np.argsort(-c, kind="stable")  # largest first, ties by index
    cs = c[order]
    assigned = _rounds(cs, parts)
    load = np.bincount(assigned, weights=cs, minlength=parts)
    out[order] = assigned
    if max_swaps:
        _swap(c, out, parts, load, max_swaps)
    return out


def _rounds(cs: np.ndarray, parts: int, exact: int = 256, refreshes: int = 64) -> np.ndarray:
    """Part of each item of `cs` (sorted descending) by rounds of `parts` items: the j-th largest of a round goes to
    the part with the j-th lowest load (ties by part id). The order of the parts is recomputed every round for the
    first `exact` rounds (the large items), then `refreshes` times over the rest (the small items, which move the
    loads little per round), so the work is O(n) after the sort whatever the number of rounds."""
    m = cs.size // parts
    rounds = cs.reshape(m, parts)
    assigned = np.empty((m, parts), dtype=np.int64)
    load = np.zeros(parts)
    head = min(m, exact)
    bounds = [*range(head + 1), *np.linspace(head, m, refreshes + 1).astype(np.int64)[1:].tolist()]
    for a, b in itertools.pairwise(bounds):
        if b <= a:
            continue
        lightest = np.argsort(load, kind="stable")
        assigned[a:b] = lightest
        load[lightest] += rounds[a:b].sum(0)
    return assigned.reshape(-1)


def _swap(c: np.ndarray, part: np.ndarray, parts: int, load: np.ndarray, max_swaps: int) -> None:
    """Exchange one item of the heaviest part with one of the lightest while that lowers the largest load by at
    least 1e-3 of the mean load (a swap moving cost d = c_x - c_y, 0 < d < gap, leaves the pair |gap - 2d| apart)."""
    small = part.astype(np.int16) if parts <= np.iinfo(np.int16).max else part  # numpy radix-sorts 16-bit ints
    members = np.split(np.argsort(small, kind="stable"), parts)  # equal counts: `parts` equal slices
    min_gain = 1e-3 * load.mean()
    for _ in range(max_swaps):
        hi, lo = int(np.argmax(load)), int(np.argmin(load))
        gap = load[hi] - load[lo]
        a, b = members[hi], members[lo]
        ca = c[a]
        ob = np.argsort(c[b], kind="stable")
        cbs = c[b][ob]
        # for each x in the heavy part, the y in the light part with c_x - c_y nearest gap / 2
        pos = np.searchsorted(cbs, ca - gap / 2)
        near = np.stack([np.clip(pos, 0, cbs.size - 1), np.clip(pos - 1, 0, cbs.size - 1)])
        d = ca[None, :] - cbs[near]
        d[(d <= 0) | (d >= gap)] = 0  # no swap: gap unchanged
        k, i = np.unravel_index(int(np.argmin(np.abs(gap - 2 * d))), d.shape)
        gain = min(d[k, i], gap - d[k, i]) if d[k, i] > 0 else 0.0  # how much the heavier of the two drops
        if gain < min_gain or gain <= 0:
            return
        j = int(ob[near[k, i]])
        x, y = a[i], b[j]
        part[x], part[y] = lo, hi
        a[i], b[j] = y, x
        load[hi] -= d[k, i]
        load[lo] += d[k, i]


def imbalance(costs: Any, part: np.ndarray, parts: int) -> float:
    """max / mean of the parts' cost sums (1.0: perfectly even; 1.0 for an all-zero batch)."""
    loads = np.bincount(part, weights=np.asarray(costs, dtype=np.float64), minlength=parts)
    mean = loads.mean()
    return float(loads.max() / mean) if mean > 0 else 1.0


# ---- rows of batches -------------------------------------------------------------------------------------------
def _kjt_concat_rows(kjts: Sequence[KeyedJaggedTensor]) -> KeyedJaggedTensor:
    """The KJTs' examples one after another (same keys in each)."""
    keys = kjts[0].keys()
    if not keys:
        return kjts[0]
    values, lengths = [], []
    for key in keys:
        for kjt in kjts:
            jt = kjt[key]
            values.append(jt.values())
            lengths.append(jt.lengths())
    return KeyedJaggedTensor(keys=keys, values=torch.cat(values), lengths=torch.cat(lengths))


def _segment_rows(offsets: torch.Tensor, rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(value indices, lengths) of segments `rows` of jagged values with these offsets [n+1], in that order."""
    offsets = offsets.to(torch.int64)
    sel_len = offsets[1:][rows] - offsets[:-1][rows]
    total = int(sel_len.sum())
    starts = torch.cumsum(sel_len, 0) - sel_len
    # value index = start of its segment + position inside it
    idx = torch.repeat_interleave(offsets[:-1][rows] - starts, sel_len, output_size=total) + torch.arange(total)
    return idx, sel_len


def _kjt_take_rows(kjt: KeyedJaggedTensor, rows: torch.Tensor, batch: int) -> KeyedJaggedTensor:
    """Examples `rows` (int64 [b]) of a KJT of `batch` examples, in that order, for every key."""
    keys = kjt.keys()
    if not keys:
        return kjt
    flat = (torch.arange(len(keys), dtype=torch.int64)[:, None] * batch + rows[None, :]).reshape(-1)
    idx, sel_len = _segment_rows(lengths_to_offsets(kjt.lengths()), flat)
    return KeyedJaggedTensor(keys=keys, values=kjt.values()[idx], lengths=sel_len.to(kjt.lengths().dtype))


def _history_lengths(batch: Batch) -> list[torch.Tensor]:
    return [(o[1:] - o[:-1]).to(torch.int64) for o in batch.history_offsets]


def concat_batches(batches: Sequence[Batch]) -> Batch:
    """One Batch holding the batches' examples in order (every history's offsets and times carried)."""
    if len(batches) == 1:
        return batches[0]
    per_history = zip(*(_history_lengths(b) for b in batches))
    requests = {}
    if any(b.cand_offsets is not None for b in batches):
        ids = [b.request_ids for b in batches]
        requests = request_fields(torch.cat([_candidate_counts(b) for b in batches]),
                                  None if any(i is None for i in ids) else torch.cat(ids))
    return Batch(
        sequence=_kjt_concat_rows([b.sequence for b in batches]),
        sparse=_kjt_concat_rows([b.sparse for b in batches]),
        dense=torch.cat([b.dense for b in batches]),
        labels=torch.cat([b.labels for b in batches]),
        **history_fields([torch.cat(n) for n in per_history]),
        history_times=tuple(torch.cat(t) for t in zip(*(b.history_times for b in batches))),
        **requests,
    )


def take_rows(batch: Batch, rows: Any) -> Batch:
    """The examples `rows` of a batch (indices, in that order) as a Batch of their own."""
    rows = torch.as_tensor(rows, dtype=torch.int64).reshape(-1)
    r = batch.num_requests
    labels, requests = batch.labels[rows], {}
    if batch.cand_offsets is not None:  # a request's candidates travel with it
        labels = batch.labels[_segment_rows(batch.cand_offsets, rows)[0]]
        ids = batch.request_ids
        requests = request_fields(_candidate_counts(batch)[rows], None if ids is None else ids[rows])
    return Batch(
        sequence=_kjt_take_rows(batch.sequence, rows, r),
        sparse=_kjt_take_rows(batch.sparse, rows, r),
        dense=batch.dense[rows],
        labels=labels,
        **history_fields([lengths[rows] for lengths in _history_lengths(batch)]),
        history_times=tuple(t[_segment_rows(o, rows)[0]] for o, t in zip(batch.history_offsets, batch.history_times)),
        **requests,
    )


def _candidate_counts(batch: Batch) -> torch.Tensor:
    if batch.cand_offsets is None:
        return torch.ones(batch.num_requests, dtype=torch.int64)
    o = batch.cand_offsets.to(torch.int64)
    return o[1:] - o[:-1]


def example_lengths(batch: Batch, histories: Sequence[str]) -> dict[str, torch.Tensor]:
    """{history name: lengths [B]} of a batch whose histories are `histories` (schema order): what a cost model
    reads."""
    lengths = _history_lengths(batch)
    if len(lengths) != len(histories):
        raise ValueError(f"the batch has {len(lengths)} histories, the schema {len(histories)} ({list(histories)})")
    return dict(zip(histories, lengths))


# ---- the balanced stream ---------------------------------------------------------------------------------------
class BalancedDataset(IterableDataset):
    """Rank `source.rank`'s balanced share of every global batch of `source`.

    `source`: a dataset of one rank of `source.world_size` whose `batch(index, rank=q)` is rank q's batch number
    `index` (the synthetic and Parquet datasets). Global batch i = the ranks' batches i, in rank order; this rank's
    share = its part of `partition(cost(example_lengths(global batch, ...)), world_size)`, rows in global order. The
    position (`state_dict`) is the source's: balancing changes which rank trains an example, never which step.
    """

    def __init__(self, source, cost: CostFn) -> None:
        super().__init__()
        self.source, self.cost = source, cost
        self.rank, self.world_size = source.rank, source.world_size
        self.schema = source.schema

    @property
    def _position(self) -> int:  # stream_batches moves the source's position
        return self.source._position

    @_position.setter
    def _position(self, value: int) -> None:
        self.source._position = value

    def split(self, index: int) -> tuple[Batch, np.ndarray, np.ndarray]:
        """(global batch `index`, each example's part, each example's cost)."""
        whole = concat_batches([self.source.batch(index, rank=q) for q in range(self.world_size)])
        lengths = example_lengths(whole, self.schema.history_names)
        # requests: the cost counts each request's candidates too
        cost = self.cost(lengths) if whole.cand_offsets is None else self.cost(lengths, _candidate_counts(whole))
        costs = cost.detach().to("cpu", torch.float64).numpy()
        return whole, partition(costs, self.world_size), costs

    def batch(self, index: int) -> Batch:
        whole, part, _ = self.split(index)
        return take_rows(whole, np.flatnonzero(part == self.rank))

    def __iter__(self) -> Iterator[Batch]:
        try:
            end = len(self.source)
        except TypeError:  # endless
            end = None
        return stream_batches(self, end)

    def __len__(self) -> int:
        return len(self.source)

    def state_dict(self) -> dict[str, Any]:
        return self.source.state_dict()

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.source.load_state_dict(state)
