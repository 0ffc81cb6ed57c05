"""Training batches made in DataLoader workers (`data.num_workers`): same stream, exact resume, same errors."""

from __future__ import annotations

import multiprocessing
from pathlib import Path

import pytest
import torch
from torch.utils.data import get_worker_info
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from gem.data import Batch, DataConfig
from gem.train.checkpoint import list_checkpoints
from gem.train.trainer import BadBatchError, Trainer
from tests.train._util import SMALL, compose, drop_process_group_after_module, small_trainer

COMMON = ("train.eval_every=0", "train.seed=5")


_own_process_group = pytest.fixture(autouse=True, scope="module")(drop_process_group_after_module)


def _trainer(run_dir: Path | None, *overrides: str):
    return small_trainer(run_dir, *COMMON, *overrides)


def _fit(run_dir: Path | None, *overrides: str):
    t = _trainer(run_dir, *overrides)
    try:
        return t.fit(), t
    finally:
        t.close()


def test_workers_give_the_same_losses_as_the_training_thread():
    inline, _ = _fit(None, "train.steps=9", "data.num_workers=0")
    rng_inline = torch.get_rng_state()
    workers, t = _fit(None, "train.steps=9", "data.num_workers=2")
    assert len(inline.losses) == 9 and max(inline.losses) - min(inline.losses) > 1e-3  # the loss moves
    assert workers.losses == inline.losses  # bit for bit: same batches, same order
    # the loader's worker seeds do not draw from the training RNG stream (it is checkpointed)
    assert torch.equal(torch.get_rng_state(), rng_inline)
    assert t.batches is None and not multiprocessing.active_children()  # the workers are shut down when fit() returns


def test_workers_feed_the_sparse_dist_pipeline():
    """torchrec's pipeline pulls batches ahead of the step it runs; an evaluation in the middle detaches it."""
    common = ("train.steps=6", "train.eval_every=3")
    plain, _ = _fit(None, *common, "train.pipeline=none", "data.num_workers=0")
    piped, t = _fit(None, *common, "train.pipeline=sparse_dist", "data.num_workers=2")
    assert t.loop == "sparse_dist" and t.pipeline_fallback is None
    torch.testing.assert_close(torch.tensor(piped.losses), torch.tensor(plain.losses), rtol=0, atol=1e-6)
    assert plain.eval_metrics
    for k, v in plain.eval_metrics.items():
        assert piped.eval_metrics[k] == pytest.approx(v, abs=1e-6), k


def test_resume_with_workers_continues_the_uninterrupted_run(tmp_path):
    straight, _ = _fit(None, "train.steps=14", "data.num_workers=0")
    # An odd stop: on resume the stream starts at batch 5, which is not worker 0's turn in a round of 2 workers.
    first, _ = _fit(
        tmp_path, "train.steps=14", "data.num_workers=2", "train.stop_at_step=5", "train.checkpoint.every=5"
    )
    assert first.losses == straight.losses[:5]
    assert [s for s, _ in list_checkpoints(tmp_path / "checkpoints")] == [5]
    second, t = _fit(tmp_path, "train.steps=14", "data.num_workers=2", "train.resume=true")
    assert t.step == 14 and second.losses == straight.losses[5:]
    # resuming that checkpoint with a different worker count gives the same run too
    third, _ = _fit(tmp_path, "train.steps=14", "data.num_workers=3", "train.resume=true")
    assert third.losses == straight.losses[5:]


class _CorruptInWorker(torch.utils.data.IterableDataset):
    """Wraps the training dataset; batch `at` of the stream is corrupted. `in_worker`: that must happen in a
    DataLoader worker process. Picklable, so the workers get it."""

    def __init__(self, ds, at: int, kind: str, card: int, in_worker: bool) -> None:
        super().__init__()
        self.ds, self.at, self.kind, self.card, self.in_worker = ds, at, kind, card, in_worker

    def __iter__(self):
        for b in self.ds:
            if self.ds.state_dict()["batch_index"] - 1 != self.at:
                yield b
                continue
            assert (get_worker_info() is not None) == self.in_worker
            if self.kind == "raise":
                raise ValueError("parquet file 'x.parquet': column 'click' is not numeric")
            yield _corrupt(b, self.kind, self.card)

    def state_dict(self):
        return self.ds.state_dict()

    def load_state_dict(self, state):
        self.ds.load_state_dict(state)


def _corrupt(b: Batch, kind: str, card: int) -> Batch:
    if kind == "nan_label":
        labels = b.labels.clone()
        labels[3, 1] = float("nan")
        return Batch(b.sequence, b.sparse, b.dense, labels, b.seq_offsets, b.max_seq_len)
    kjt = b.sparse
    keys, values = list(kjt.keys()), kjt.values().clone()
    values[sum(kjt.length_per_key()[: keys.index("context")])] = card  # one past the table
    sparse = KeyedJaggedTensor(keys=keys, values=values, lengths=kjt.lengths())
    return Batch(b.sequence, sparse, b.dense, b.labels, b.seq_offsets, b.max_seq_len)


def _run_to_failure(run_dir: Path, workers: int, kind: str) -> tuple[Exception, Trainer]:
    t = _trainer(run_dir, "train.steps=8", "train.checkpoint.every=2", f"data.num_workers={workers}")
    card = t.schema.cardinalities()["context"]
    t.train_data = _CorruptInWorker(t.train_data, at=4, kind=kind, card=card, in_worker=workers > 0)
    steps_taken = []
    real_step = t.optimizer.step

    def step():
        real_step()
        steps_taken.append(t.step + 1)

    t.optimizer.step = step
    try:
        with pytest.raises(ValueError) as err:
            t.fit()
    finally:
        t.close()
    assert t.step == 4 and steps_taken == [1, 2, 3, 4]  # no optimizer step for the bad batch
    assert [s for s, _ in list_checkpoints(run_dir / "checkpoints")] == [2, 4]  # none after the bad batch
    return err.value, t


@pytest.mark.parametrize("kind", ["id", "nan_label", "raise"])
def test_a_bad_batch_made_in_a_worker_raises_the_same_error(tmp_path, kind):
    inline, _ = _run_to_failure(tmp_path / "inline", 0, kind)
    worker, t = _run_to_failure(tmp_path / "workers", 2, kind)
    assert type(worker) is type(inline) and str(worker) == str(inline)
    msg = str(worker)
    assert "\n" not in msg and "DataLoader" not in msg and "Traceback" not in msg
    if kind == "raise":
        assert not isinstance(worker, BadBatchError) and "column 'click'" in msg
    else:
        assert isinstance(worker, BadBatchError) and msg.startswith("training batch of step 5: ")
        assert (
            ("'context'" in msg and str(t.schema.cardinalities()["context"]) in msg)
            if kind == "id"
            else ("labels" in msg and "nan" in msg)
        )


def test_num_workers_config_is_checked():
    cfg = compose(SMALL)
    data = dict(cfg.data)
    assert DataConfig.from_dict(data).num_workers == 0
    assert DataConfig.from_dict({**data, "num_workers": 3}).num_workers == 3
    with pytest.raises(ValueError, match=r"data.num_workers: must be >= 0 \(got -1\)"):
        DataConfig.from_dict({**data, "num_workers": -1})
    with pytest.raises(ValueError, match="num_worker"):  # unknown keys still fail
        DataConfig.from_dict({**data, "num_worker": 2})
    assert compose(SMALL + ["experiment=gpu_base"]).data.num_workers > 0
