"""The training stream (gem.data.loader): same batches in stream order from any position, inline or made in
DataLoader workers; a bad batch raises at the step that would consume it; close() stops the workers."""

from __future__ import annotations

import multiprocessing

import pytest
import torch

from gem.data import BadBatchError, Batch, SyntheticDataset, TrainBatches
from gem.data.loader import InOrder
from tests.data._util import assert_batches_equal, make_schema


def test_in_order_puts_a_worker_stream_back_in_order():
    # 3 workers from position 7: worker w makes i = w mod 3, the loader takes turns 0, 1, 2.
    per_worker = [[i for i in range(7, 20) if i % 3 == w] for w in range(3)]
    arrivals = [(i, f"b{i}") for turn in zip(*per_worker) for i in turn]
    assert [i for i, _ in arrivals][:3] == [9, 7, 8]
    assert list(InOrder(iter(arrivals), 7)) == [f"b{i}" for i in range(7, 19)]
    # a finite stream's held tail comes out in order; unindexed items pass straight through
    assert list(InOrder(iter([(2, "c"), (1, "b"), (None, "x"), (0, "a")]), 0)) == ["x", "a", "b", "c"]
    assert list(InOrder(iter([]), 0)) == []


def _tokens(b: Batch) -> float:
    return float(b.seq_offsets[-1])


@pytest.mark.parametrize("workers", [0, 2])
def test_train_batches_continue_the_stream_at_a_position(workers):
    schema = make_schema()
    ds = SyntheticDataset(schema, seed=4, batch_size=8)
    want = [ds.batch(i) for i in range(5, 10)]
    before = torch.get_rng_state()
    it = TrainBatches(ds, schema, _tokens, position=5, first_step=3, num_workers=workers, seed=1)
    try:
        assert it.workers_running == (workers > 0)
        got = [next(it) for _ in range(5)]
    finally:
        it.close()
    for a, b in zip(got, want):
        assert_batches_equal(a, b)
    assert list(it.flops) == [_tokens(b) for b in want]  # one entry per batch handed out, in order
    assert torch.equal(torch.get_rng_state(), before)  # the workers' seeds don't draw from the global RNG
    assert not it.workers_running and not multiprocessing.active_children()


class _NanAt:
    """A dataset whose batch `at` has a NaN label."""

    def __init__(self, ds, at: int) -> None:
        self.ds, self.at = ds, at

    def __iter__(self):
        for b in self.ds:
            if self.ds.state_dict()["batch_index"] - 1 == self.at:
                labels = b.labels.clone()
                labels[0, 0] = float("nan")
                b = Batch(b.sequence, b.sparse, b.dense, labels, b.seq_offsets, b.max_seq_len)
            yield b

    def state_dict(self):
        return self.ds.state_dict()

    def load_state_dict(self, state):
        self.ds.load_state_dict(state)


def test_a_bad_batch_raises_when_its_step_comes():
    schema = make_schema()
    it = TrainBatches(
        _NanAt(SyntheticDataset(schema, seed=4, batch_size=8), at=3), schema, _tokens, position=1, first_step=10
    )
    next(it), next(it)  # batches 1 and 2: steps 11 and 12
    with pytest.raises(BadBatchError, match=r"^training batch of step 13: labels"):
        next(it)
