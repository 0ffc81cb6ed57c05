"""The Trainer in-process on one rank: resume parity, bad batches, checkpoints, TensorBoard."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from gem.data import Batch
from gem.train.checkpoint import list_checkpoints
from gem.train.trainer import BadBatchError, Trainer
from tests.train._util import SMALL, compose


def _trainer(run_dir: Path, *overrides: str) -> Trainer:
    return Trainer(compose(SMALL + list(overrides)), run_dir=str(run_dir))


def _fit(run_dir: Path, *overrides: str):
    t = _trainer(run_dir, *overrides)
    try:
        return t.fit(), t
    finally:
        t.close()


def test_resume_continues_the_same_trajectory(tmp_path):
    """Resuming from step 5 after a run that reached step 10 redoes steps 6..10 exactly; metrics.jsonl and
    TensorBoard then show each step once."""
    import shutil

    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from tests.train._util import read_jsonl

    common = ("train.steps=20", "train.eval_every=0", "train.seed=3")
    straight, _ = _fit(tmp_path / "a", *common)
    first, _ = _fit(tmp_path / "b", *common, "train.stop_at_step=10", "train.checkpoint.every=5",
                    "train.tensorboard=true")
    assert first.steps == 10
    ckpts = tmp_path / "b" / "checkpoints"
    assert [s for s, _ in list_checkpoints(ckpts)] == [5, 10]
    shutil.rmtree(ckpts / "step_10")  # as if the job had died after step 5's checkpoint
    second, t = _fit(tmp_path / "b", *common, "train.resume=true", "train.checkpoint.every=0",
                     "train.tensorboard=true")
    assert t.step == 20 and second.steps == 20
    assert len(straight.losses) == 20 and len(first.losses) == 10 and len(second.losses) == 15
    # the loss must actually move, or equality would prove nothing
    assert max(straight.losses) - min(straight.losses) > 1e-3
    torch.testing.assert_close(torch.tensor(first.losses), torch.tensor(straight.losses[:10]), rtol=0, atol=1e-6)
    torch.testing.assert_close(torch.tensor(second.losses), torch.tensor(straight.losses[5:]), rtol=0, atol=1e-6)
    for k, v in straight.eval_metrics.items():
        assert second.eval_metrics[k] == pytest.approx(v, abs=1e-6), k
    logged = [r["step"] for r in read_jsonl(tmp_path / "b" / "metrics.jsonl") if "train/loss" in r]
    assert logged == list(range(1, 21))
    acc = EventAccumulator(str(tmp_path / "b" / "tb"))
    acc.Reload()
    assert [e.step for e in acc.Scalars("train/loss")] == list(range(1, 21))


def test_resume_true_without_checkpoint_fails(tmp_path):
    """`train.resume=true` insists: no checkpoint is an error naming the key and the directory, not a fresh run."""
    from gem.train.checkpoint import CheckpointError

    with pytest.raises(CheckpointError) as e:
        _fit(tmp_path, "train.steps=2", "train.resume=true", "train.eval_every=0")
    msg = str(e.value)
    assert msg.startswith("train.resume: no complete checkpoint in") and str(tmp_path) in msg and "\n" not in msg
    result, _ = _fit(tmp_path, "train.steps=2", "train.resume=auto", "train.eval_every=0")
    assert result.steps == 2 and len(result.losses) == 2


def test_resume_with_another_model_names_the_difference(tmp_path):
    from gem.train.checkpoint import CheckpointError

    _fit(tmp_path, "train.steps=2", "train.eval_every=0", "train.checkpoint.every=2")
    with pytest.raises(CheckpointError) as e:
        _fit(tmp_path, "train.steps=4", "train.eval_every=0", "train.resume=true", "model.tower.num_blocks=3")
    msg = str(e.value)
    assert "\n" not in msg and "model.tower.num_blocks=2 (got 3)" in msg, msg
    assert "parallel." not in msg and "model.d_model" not in msg, msg


class _Corrupting:
    """Wraps a dataset: yields its batches, but batch number `at` (0-based) is corrupted by `corrupt`."""

    def __init__(self, ds, at: int, corrupt) -> None:
        self.ds, self.at, self.corrupt = ds, at, corrupt

    def __iter__(self):
        for i, b in enumerate(self.ds):
            yield self.corrupt(b) if i == self.at else b

    def state_dict(self):
        return self.ds.state_dict()


def _out_of_range(feature: str, card: int):
    def corrupt(b: Batch) -> Batch:
        kjt = b.sparse
        values = kjt.values().clone()
        keys = list(kjt.keys())
        per_key = kjt.length_per_key()
        start = sum(per_key[: keys.index(feature)])
        values[start] = card  # one past the table
        sparse = KeyedJaggedTensor(keys=keys, values=values, lengths=kjt.lengths())
        return Batch(b.sequence, sparse, b.dense, b.labels, b.seq_offsets, b.max_seq_len)

    return corrupt


def _nan_label(b: Batch) -> Batch:
    labels = b.labels.clone()
    labels[3, 1] = float("nan")
    return Batch(b.sequence, b.sparse, b.dense, labels, b.seq_offsets, b.max_seq_len)


@pytest.mark.parametrize("kind", ["id", "nan_label"])
def test_bad_batch_raises_before_the_step_and_writes_no_checkpoint(tmp_path, kind):
    t = _trainer(tmp_path, "train.steps=8", "train.eval_every=0", "train.checkpoint.every=2")
    card = t.schema.cardinalities()["context"]
    corrupt = _out_of_range("context", card) if kind == "id" else _nan_label
    t.train_data = _Corrupting(t.train_data, at=4, corrupt=corrupt)  # the batch of step 5
    params_seen = {}
    real_step = t.optimizer.step

    def step_and_snapshot():
        real_step()
        params_seen[t.optimizer.step_count] = [p.detach().clone() for p in t.par.dense_parameters()]

    t.optimizer.step = step_and_snapshot
    try:
        with pytest.raises(BadBatchError) as err:
            t.fit()
    finally:
        t.close()
    msg = str(err.value)
    assert "step 5" in msg
    assert ("'context'" in msg and str(card) in msg) if kind == "id" else ("labels" in msg and "nan" in msg)
    assert "\n" not in msg
    assert t.step == 4 and max(params_seen) == 4  # no optimizer step for the bad batch
    for p, q in zip(params_seen[4], t.par.dense_parameters()):
        assert torch.equal(p, q.detach())
    assert [s for s, _ in list_checkpoints(tmp_path / "checkpoints")] == [2, 4]
    assert not any(p.name.startswith(".tmp-") for p in (tmp_path / "checkpoints").iterdir())


def test_tensorboard_scalars_and_jsonl(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    result, _ = _fit(tmp_path, "train.steps=4", "train.eval_every=2", "train.tensorboard=true")
    acc = EventAccumulator(str(tmp_path / "tb"))
    acc.Reload()
    tags = set(acc.Tags()["scalars"])
    for tag in (
        "train/loss",
        "train/lr",
        "perf/samples_per_s",
        "perf/tflops_per_device",
        "eval/click/ne",
        "eval/click/auc",
        "eval/conversion/calibration",
        "eval/conversion/logloss",
    ):
        assert tag in tags, tag
    assert [e.step for e in acc.Scalars("train/loss")] == [1, 2, 3, 4]
    assert [e.step for e in acc.Scalars("eval/click/auc")] == [2, 4]
    lrs = [e.value for e in acc.Scalars("train/lr")]
    assert lrs[0] < lrs[1]  # warmup
    assert result.eval_metrics["click/auc"] == pytest.approx(acc.Scalars("eval/click/auc")[-1].value, abs=1e-6)


def test_sparse_dist_pipeline_matches_the_plain_loop(tmp_path, monkeypatch):
    """`train.pipeline=sparse_dist` really runs torchrec's TrainPipelineSparseDist (both embedding modules'
    forwards rewritten for it) and trains the same steps as the plain loop, across an evaluation in the middle
    (which detaches and re-attaches the pipeline). The loop is chosen at start-up: a model the pipeline cannot
    trace fails with the pipeline's error, it does not fall back to the plain loop."""
    from torch.fx.proxy import TraceError
    from torchrec.distributed.train_pipeline.utils import PipelinedForward

    from gem.model import GEMModel

    common = ("train.steps=6", "train.eval_every=3")
    plain, tp = _fit(tmp_path / "plain", *common, "train.pipeline=none")
    piped, t = _fit(tmp_path / "piped", *common, "train.pipeline=sparse_dist")
    assert tp.loop == "plain"
    assert t.loop == "sparse_dist" and t.pipeline_fallback is None
    for name in ("ec", "ebc"):
        assert isinstance(t.inner.get_submodule(name).forward, PipelinedForward), name
        assert not isinstance(tp.inner.get_submodule(name).forward, PipelinedForward), name
    assert len(piped.losses) == 6
    assert max(plain.losses) - min(plain.losses) > 1e-3  # the loss moves, so equality says something
    torch.testing.assert_close(torch.tensor(piped.losses), torch.tensor(plain.losses), rtol=0, atol=1e-6)
    assert plain.eval_metrics
    for k, v in plain.eval_metrics.items():
        assert piped.eval_metrics[k] == pytest.approx(v, abs=1e-6), k

    traceable = GEMModel.forward

    def untraceable(self, batch):
        assert list(batch.sparse.keys())  # an fx Proxy cannot be iterated: TraceError
        return traceable(self, batch)

    monkeypatch.setattr(GEMModel, "forward", untraceable)
    tf = _trainer(tmp_path / "untraceable", *common, "train.pipeline=sparse_dist")
    assert tf.loop == "sparse_dist"  # decided before any step
    try:
        with pytest.raises(TraceError):
            tf.fit()
    finally:
        tf.close()
    assert tf.step == 0


@pytest.mark.parametrize(
    ("pipeline", "device", "loop"),
    [
        ("auto", "cpu", "plain"),
        ("auto", "cuda", "sparse_dist"),
        ("sparse_dist", "cpu", "sparse_dist"),
        ("none", "cuda", "plain"),
    ],
)
def test_the_loop_follows_the_config_and_device(pipeline, device, loop):
    from gem.train.step import choose_loop

    cls, why = choose_loop(pipeline, torch.device(device))
    assert cls.name == loop and why is None


def test_hooks_run_after_every_step_with_its_checkpoint_written(tmp_path):
    seen = []

    def hook(trainer):
        seen.append((trainer.step, [s for s, _ in list_checkpoints(tmp_path / "checkpoints")]))

    t = Trainer(
        compose([*SMALL, "train.steps=4", "train.eval_every=0", "train.checkpoint.every=2"]),
        run_dir=str(tmp_path),
        hooks=[hook],
    )
    try:
        t.fit()
    finally:
        t.close()
    assert seen == [(1, []), (2, [2]), (3, [2]), (4, [2, 4])]
