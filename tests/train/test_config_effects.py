"""Config keys and what they do: each test changes one key of the small config and checks the effect the key's
documentation promises, worked out by hand."""

from __future__ import annotations

import math

import pytest
import torch

from gem.config import ConfigError
from tests.train._util import SMALL, compose, drop_process_group_after_module, read_jsonl, small_trainer

_own_process_group = pytest.fixture(autouse=True, scope="module")(drop_process_group_after_module)


def _fit(run_dir, *overrides: str):
    t = small_trainer(run_dir, *overrides)
    try:
        return t.fit(), t
    finally:
        t.close()


def _train_records(run_dir) -> list[dict]:
    return [r for r in read_jsonl(run_dir / "metrics.jsonl") if "train/loss" in r]


def test_log_every_logs_its_multiples_and_the_last_step(tmp_path):
    """train.log_every=3 over 7 steps (no evaluation before the end): training scalars at steps 3, 6 and 7."""
    _fit(tmp_path, "train.steps=7", "train.log_every=3", "train.eval_every=0")
    assert [r["step"] for r in _train_records(tmp_path)] == [3, 6, 7]


def test_checkpoint_keep_and_keep_steps_choose_what_stays(tmp_path):
    """A checkpoint every step over 4 steps with keep=1 and keep_steps=[1]: the newest (4) and step 1."""
    from gem.train.checkpoint import list_checkpoints

    _fit(tmp_path, "train.steps=4", "train.eval_every=0", "train.checkpoint.every=1", "train.checkpoint.keep=1",
         "train.checkpoint.keep_steps=[1]", "train.checkpoint.async=false")
    assert [s for s, _ in list_checkpoints(tmp_path / "checkpoints")] == [1, 4]


def test_an_evaluation_reads_eval_batches_of_batch_size():
    """data.batch_size=16 and data.eval_batches=3 on one rank, one candidate per example: 48 examples scored."""
    result, _ = _fit(None, "train.steps=1", "data.batch_size=16", "data.eval_batches=3")
    assert result.eval_metrics["num_samples"] == 48


def test_tensorboard_false_writes_no_events(tmp_path):
    """train.tensorboard=false: metrics.jsonl only, no TensorBoard directory (true writes <run dir>/tb)."""
    _fit(tmp_path / "off", "train.steps=1", "data.eval_batches=0", "train.tensorboard=false")
    _fit(tmp_path / "on", "train.steps=1", "data.eval_batches=0", "train.tensorboard=true")
    assert (tmp_path / "off" / "metrics.jsonl").is_file()
    assert not (tmp_path / "off" / "tb").exists()
    assert any((tmp_path / "on" / "tb").iterdir())


@pytest.mark.parametrize("check", [True, False])
def test_check_finite_stops_on_a_non_finite_loss(check):
    """A NaN weight makes the first loss NaN: train.check_finite=true raises before backward, false trains on."""
    t = small_trainer(None, "train.steps=1", "data.eval_batches=0", f"train.check_finite={str(check).lower()}")
    try:
        with torch.no_grad():
            t.inner.summary_token.fill_(float("nan"))
        if check:
            with pytest.raises(FloatingPointError, match="non-finite loss nan at step 1"):
                t.fit()
        else:
            result = t.fit()
            assert result.steps == 1 and math.isnan(result.losses[0])
    finally:
        t.close()


# -- per-history tower keys and per-kind feature keys --------------------------------------------------------------

def test_a_history_tower_override_of_seq_combine_sets_its_input():
    """model.towers.<history> overrides any key of model.tower for that history (docs/DATA.md): seq_combine=sum
    there adds the history's two 16-wide embeddings (item, action), so its input projection reads 16 features,
    as it does with model.tower.seq_combine=sum."""
    from gem.model.gem import GEMModel
    from gem.train.trainer import build_configs

    for override in ("model.tower.seq_combine=sum", "+model.towers.events.seq_combine=sum"):
        model = GEMModel(build_configs(compose(SMALL + [override])).model)
        assert model.input_projs["events"].in_features == 16, override
    result, _ = _fit(None, "+model.towers.events.seq_combine=sum", "train.steps=1", "train.eval_every=0")
    assert result.steps == 1 and math.isfinite(result.losses[0])  # the forward sums what the projection expects


@pytest.mark.parametrize("override", ["+data.features.hist_item.max_hot=5", "+data.features.hist_item.min_hot=0",
                                      "+data.features.dense.max_hot=4"])
def test_hot_counts_are_refused_where_a_feature_has_none(override):
    """max_hot / min_hot bound a sparse feature's ids per example; a sequence feature has one id per event and a
    dense feature none, so setting them there is refused like `size` on a non-dense feature."""
    from gem.train.trainer import build_configs

    key = override.lstrip("+").split("=")[0]
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        build_configs(compose(SMALL + [override]))


def test_param_dtype_under_ddp_is_not_dropped_silently(caplog):
    """On one rank parallel.dense=auto is DDP, which keeps fp32 parameters: train.param_dtype=bf16 says in one line
    that it is unused, and `gem plan` counts fp32 activations for it on a CPU cluster (2 bytes only under FSDP2)."""
    import logging

    from gem.plan.estimate import activation_bytes
    from gem.plan.topology import ClusterSpec
    from gem.train.trainer import build_configs

    with caplog.at_level(logging.WARNING, logger="gem.train"):
        t = small_trainer(None, "train.param_dtype=bf16")
        t.close()
    said = [r.getMessage() for r in caplog.records if "param_dtype" in r.getMessage()]
    assert said == [("train.param_dtype=bf16: FSDP2's mixed precision, unused here: parallel.dense=ddp keeps fp32 "
                     "parameters and gradients (train.autocast sets the compute dtype)")], said
    cpu = ClusterSpec(hosts=1, gpus_per_host=1, compute_device="cpu")
    for dense, size in (("ddp", 4), ("fsdp", 2)):
        cfgs = build_configs(compose(SMALL + ["train.param_dtype=bf16", "train.autocast=none",
                                              f"parallel.dense={dense}"]))
        assert activation_bytes(cfgs, cpu) == size, dense
