"""Checks a Batch against the schema; every problem raises one BatchError (a ValueError) naming the field.

Vectorised: a few reductions per feature, so it can run on every step (on CPU, before the batch is moved).
"""

from __future__ import annotations

import torch
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from gem.config import UserError
from gem.data.batch import Batch
from gem.data.schema import Schema


class BatchError(UserError):
    """A batch that does not fit the schema (bad input data, not a bug): one line naming the field and example."""


def _first_bad(mask: torch.Tensor) -> tuple[int, ...]:
    return tuple(int(i) for i in mask.nonzero()[0])


def _check_keys(kind: str, kjt: KeyedJaggedTensor, expected: list[str]) -> None:
    keys = list(kjt.keys())
    for k in keys:
        if k not in expected:
            raise BatchError(f"{kind}: unknown feature '{k}' (schema {kind} features: {expected})")
    for k in expected:
        if k not in keys:
            raise BatchError(f"{kind}: missing feature '{k}'")
    if len(keys) != len(set(keys)):
        raise BatchError(f"{kind}: duplicate feature keys {keys}")


def _check_kjt(kind: str, kjt: KeyedJaggedTensor, batch_size: int, cards: dict[str, int]) -> torch.Tensor:
    """Checks lengths and the id ranges of the features in `cards`; returns lengths as [num_keys, B]."""
    keys = list(kjt.keys())
    lengths = kjt.lengths()
    if lengths.numel() != len(keys) * batch_size:
        raise BatchError(
            f"{kind}: lengths has {lengths.numel()} entries, expected {len(keys)} keys x {batch_size} examples"
        )
    lengths = lengths.view(len(keys), batch_size)
    if lengths.numel() and bool((lengths < 0).any()):
        k, b = _first_bad(lengths < 0)
        raise BatchError(f"{kind} feature '{keys[k]}': negative length {int(lengths[k, b])} at example {b}")
    per_key = lengths.sum(1).tolist()
    values = kjt.values()
    if values.numel() != sum(per_key):
        raise BatchError(f"{kind}: {values.numel()} values but the lengths sum to {sum(per_key)}")
    if values.is_floating_point():
        raise BatchError(f"{kind}: ids must be integers, got {values.dtype}")
    for key, chunk in zip(keys, torch.split(values, per_key)):
        card = cards.get(key)
        if chunk.numel() == 0 or card is None:  # None: a zch table's raw ids, any int64
            continue
        lo, hi = torch.aminmax(chunk)
        if int(lo) < 0 or int(hi) >= card:
            bad = (chunk < 0) | (chunk >= card)
            i = _first_bad(bad)[0]
            raise BatchError(
                f"{kind} feature '{key}': id {int(chunk[i])} at position {i} is outside its table's range [0, {card})"
            )
    return lengths


def _check_float(name: str, t: torch.Tensor, shape: tuple[int, int]) -> None:
    if tuple(t.shape) != shape:
        raise BatchError(f"{name}: expected shape {list(shape)}, got {list(t.shape)}")
    if not t.is_floating_point():
        raise BatchError(f"{name}: expected a float tensor, got {t.dtype}")
    finite = torch.isfinite(t)
    if not bool(finite.all()):
        idx = _first_bad(~finite)
        raise BatchError(f"{name}: non-finite value {float(t[idx])} at index {list(idx)}")


def _check_requests(batch: Batch, nreq: int) -> torch.Tensor:
    """The request fields (gem.data.Batch): cand_offsets [R+1] from 0, at least one candidate per request,
    max_candidates its largest count, request_ids [R]. Returns candidates per request [R]."""
    co = batch.cand_offsets
    if co is None:
        if batch.request_ids is not None:
            raise BatchError("request_ids: given without cand_offsets")
        return torch.ones(nreq, dtype=torch.int64)
    if co.dim() != 1 or co.is_floating_point() or co.numel() != nreq + 1:
        raise BatchError(f"cand_offsets: expected an int tensor [{nreq + 1}], got {co.dtype} {list(co.shape)}")
    counts = (co[1:] - co[:-1]).to(torch.int64)
    if int(co[0]) != 0:
        raise BatchError(f"cand_offsets: must start at 0, got {int(co[0])}")
    if bool((counts < 1).any()):
        r = _first_bad(counts < 1)[0]
        raise BatchError(f"cand_offsets: request {r} has {int(counts[r])} candidates; every request needs one")
    if batch.max_candidates != int(counts.max()):
        raise BatchError(f"max_candidates: {batch.max_candidates} but the most candidates of a request is "
                         f"{int(counts.max())}")
    if batch.request_ids is not None and tuple(batch.request_ids.shape) != (nreq,):
        raise BatchError(f"request_ids: expected shape [{nreq}], got {list(batch.request_ids.shape)}")
    return counts


def validate_batch(batch: Batch, schema: Schema) -> None:
    """Raises BatchError on the first problem found; returns None for a valid batch."""
    bsz = int(batch.dense.shape[0]) if batch.dense.dim() >= 1 else 0
    if bsz == 0:
        raise BatchError("batch has no users (batch size 0)")
    zch = schema.zch_features()
    cards = {k: v for k, v in schema.cardinalities().items() if k not in zch}
    _check_keys("sequence", batch.sequence, schema.unpooled_names)
    _check_keys("sparse", batch.sparse, schema.sparse_names)
    counts = _check_requests(batch, bsz)

    seq_lengths = _check_kjt("sequence", batch.sequence, bsz, cards)
    row = {k: i for i, k in enumerate(batch.sequence.keys())}
    for name in schema.candidate_names:
        n = seq_lengths[row[name]]
        if bool((n != counts).any()):
            b = _first_bad(n != counts)[0]
            raise BatchError(f"candidate feature '{name}': {int(n[b])} ids at example {b}, which has "
                             f"{int(counts[b])} candidate(s) (one id each)")
    if len(batch.history_offsets) != len(schema.histories) or len(batch.history_max_lens) != len(schema.histories):
        raise BatchError(f"history_offsets: {len(batch.history_offsets)} histories, the schema has "
                         f"{len(schema.histories)}")
    total = torch.zeros(bsz, dtype=torch.int64)
    for h, offsets, max_len in zip(schema.histories, batch.history_offsets, batch.history_max_lens):
        names = schema.history_features(h.name)
        hist = seq_lengths[row[names[0]]]
        for n in names[1:]:
            differ = seq_lengths[row[n]] != hist
            if bool(differ.any()):
                b = _first_bad(differ)[0]
                raise BatchError(
                    f"sequence feature '{n}': length {int(seq_lengths[row[n], b])} at example {b} differs from "
                    f"'{names[0]}' length {int(hist[b])} (the features of history '{h.name}' share its length)"
                )
        if tuple(offsets.shape) != (bsz + 1,):
            raise BatchError(f"history_offsets[{h.name}]: expected shape [{bsz + 1}], got {list(offsets.shape)}")
        if int(offsets[0]) != 0 or not torch.equal(offsets[1:] - offsets[:-1], hist.to(offsets.dtype)):
            raise BatchError(f"history_offsets[{h.name}]: not the cumulative sum of the history lengths from 0")
        longest = int(hist.max())
        if max_len != longest:
            raise BatchError(f"history_max_lens[{h.name}]: {max_len} but the longest history is {longest}")
        if longest > h.max_len:
            b = int(hist.argmax())
            raise BatchError(f"sequence: history '{h.name}' length {longest} at example {b} exceeds "
                             f"data.histories.{h.name}.max_len={h.max_len}")
        total += hist.to(torch.int64)
    if len(batch.history_times) != (len(schema.histories) if schema.has_times else 0):
        raise BatchError(f"history_times: {len(batch.history_times)} histories, expected "
                         f"{len(schema.histories) if schema.has_times else 0} (one per history with a timestamp)")
    for h, offsets, t in zip(schema.histories, batch.history_offsets, batch.history_times):
        if tuple(t.shape) != (int(offsets[-1]),) or not bool(torch.isfinite(t).all()):
            raise BatchError(f"history_times[{h.name}]: expected {int(offsets[-1])} finite times, got shape "
                             f"{list(t.shape)}")
    offsets = batch.seq_offsets
    if tuple(offsets.shape) != (bsz + 1,) or int(offsets[0]) != 0 or not torch.equal(
            offsets[1:] - offsets[:-1], total.to(offsets.dtype)):
        raise BatchError("seq_offsets: not the cumulative sum of the examples' history lengths (all histories) from 0")
    if batch.max_seq_len != int(total.max()):
        raise BatchError(f"max_seq_len: {batch.max_seq_len} but the longest example has {int(total.max())} tokens")

    sparse_lengths = _check_kjt("sparse", batch.sparse, bsz, cards)
    for i, name in enumerate(batch.sparse.keys()):
        f = schema.feature[name]
        n = sparse_lengths[i]
        bad = (n < f.min_hot) | (n > f.max_hot)
        if bool(bad.any()):
            b = _first_bad(bad)[0]
            raise BatchError(f"sparse feature '{name}': {int(n[b])} ids at example {b}, outside "
                             f"[min_hot={f.min_hot}, max_hot={f.max_hot}]")

    _check_float("dense", batch.dense, (bsz, schema.num_dense))
    _check_float("labels", batch.labels, (int(counts.sum()), schema.num_tasks))
    not_binary = (batch.labels != 0) & (batch.labels != 1)
    if bool(not_binary.any()):
        b, t = _first_bad(not_binary)
        raise BatchError(
            f"labels: task '{schema.tasks[t]}' has value {float(batch.labels[b, t])} at example {b}; labels must be 0 or 1"
        )
