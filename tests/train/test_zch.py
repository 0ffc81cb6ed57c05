"""`hash: zch` tables in training: TorchRec's managed-collision state is checkpointed and resumed exactly, with
evictions happening, and torchrec's sparse-dist pipeline trains them like the plain loop."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from gem.model.embeddings import zch_modules
from gem.train.trainer import Trainer
from tests.train._util import SMALL, compose

# The item table holds 40 rows (39 ids and the row of ids not in the map) for far more distinct items in the
# stream, so ids are evicted every step; the history and the candidate share it.
ZCH = ["+data.tables.item.ids=raw", "+data.tables.item.hash=zch", "data.tables.item.num_embeddings=40"]


def _fit(run_dir: Path, *overrides: str):
    t = Trainer(compose(SMALL + ZCH + list(overrides)), run_dir=str(run_dir))
    try:
        return t.fit(), t
    finally:
        t.close()


def _state(t: Trainer) -> dict[str, torch.Tensor]:
    """The id maps and counters of every zch module (one rank: the whole table)."""
    return {f"{i}.{k}": v.clone() for i, m in enumerate(zch_modules(t.inner)) for k, v in m.state_dict().items()}


@pytest.mark.parametrize("interval", [1, 3])
def test_resume_continues_the_same_trajectory_through_evictions(tmp_path, interval):
    """Stopped after step 6 (a multiple of the eviction interval) and resumed, a run redoes steps 7..9 with the
    losses, id maps and eviction counters of the uninterrupted run."""
    common = ("train.steps=9", "train.eval_every=0", "train.seed=5",
              f"+data.tables.item.zch_eviction_interval={interval}")
    straight, ts = _fit(tmp_path / "a", *common)
    first, _ = _fit(tmp_path / "b", *common, "train.stop_at_step=6", "train.checkpoint.every=6")
    second, tr = _fit(tmp_path / "b", *common, "train.resume=true", "train.checkpoint.every=0")
    assert first.steps == 6 and second.steps == 9 and len(second.losses) == 3
    assert max(straight.losses) - min(straight.losses) > 1e-3
    torch.testing.assert_close(torch.tensor(second.losses), torch.tensor(straight.losses[6:]), rtol=0, atol=1e-6)
    (m,) = zch_modules(ts.inner)
    assert int(m.open_slots()) == 0  # the map is full: ids were evicted on the way
    a, b = _state(ts), _state(tr)
    assert a.keys() == b.keys() and any("_mch_sorted_raw_ids" in k for k in a)
    for k in a:
        assert torch.equal(a[k], b[k]), k


def test_a_signal_between_id_map_updates_stops_at_the_next_and_resumes_exactly(tmp_path):
    """Interval 3, a stop signal noted during step 4: every rank trains on to step 6 (the ids of steps 4..6 are in
    the map by then), writes its checkpoint there, and the resumed run follows the uninterrupted one."""
    from gem.train.stop import StopSignals

    common = ("train.steps=9", "train.eval_every=0", "train.seed=5", "+data.tables.item.zch_eviction_interval=3")
    straight, _ = _fit(tmp_path / "a", *common)
    signals = StopSignals()  # not installed: the hook below stands in for the signal

    def signal_at_4(trainer):
        if trainer.step == 4:
            signals.requested = "SIGTERM"

    t = Trainer(compose(SMALL + ZCH + list(common) + ["train.checkpoint.every=3"]), run_dir=str(tmp_path / "b"),
                stop=signals, hooks=(signal_at_4,))
    try:
        first = t.fit()
    finally:
        t.close()
    assert first.stopped_by == "SIGTERM" and first.steps == 6
    assert first.last_checkpoint.endswith("step_6")
    second, _ = _fit(tmp_path / "b", *common, "train.resume=true", "train.checkpoint.every=0")
    assert second.steps == 9 and len(second.losses) == 3
    torch.testing.assert_close(torch.tensor(second.losses), torch.tensor(straight.losses[6:]), rtol=0, atol=1e-6)


def test_sparse_dist_pipeline_matches_the_plain_loop(tmp_path):
    """torchrec's TrainPipelineSparseDist runs the managed-collision collection (its input_dist ahead of the step)
    and trains the same losses as the plain loop."""
    from torchrec.distributed.train_pipeline.utils import PipelinedForward

    common = ("train.steps=5", "train.eval_every=3")
    plain, _ = _fit(tmp_path / "plain", *common, "train.pipeline=none")
    piped, t = _fit(tmp_path / "piped", *common, "train.pipeline=sparse_dist")
    assert t.loop == "sparse_dist"
    assert isinstance(t.inner.get_submodule("mc_ec").forward, PipelinedForward)
    assert max(plain.losses) - min(plain.losses) > 1e-3
    torch.testing.assert_close(torch.tensor(piped.losses), torch.tensor(plain.losses), rtol=0, atol=1e-6)
    for k, v in plain.eval_metrics.items():
        assert piped.eval_metrics[k] == pytest.approx(v, abs=1e-6), k


def test_checkpoints_must_fall_on_id_map_updates():
    """With an eviction interval k, the ids seen since the last update live outside the state dict: checkpoints
    every multiple of k only, and a planned stop (`train.stop_at_step`) there too (one line naming both keys)."""
    from gem.train.trainer import build_configs

    ok = build_configs(compose(ZCH + ["+data.tables.item.zch_eviction_interval=4", "train.checkpoint.every=8"]))
    assert ok.data.schema.table["item"].zch.eviction_interval == 4
    with pytest.raises(ValueError, match=r"^train.checkpoint.every: must be a multiple of data.tables.item."
                                         r"zch_eviction_interval=4, .* \(got 6\)$"):
        build_configs(compose(ZCH + ["+data.tables.item.zch_eviction_interval=4", "train.checkpoint.every=6"]))
    with pytest.raises(ValueError, match=r"^train.stop_at_step: must be a multiple of data.tables.item."
                                         r"zch_eviction_interval=4, .* \(got 6\)$"):
        build_configs(compose(ZCH + ["+data.tables.item.zch_eviction_interval=4", "train.checkpoint.every=8",
                                     "train.stop_at_step=6"]))


@pytest.mark.parametrize("override,match", [
    ("parallel.emb_shard_group=1", (r"^parallel.emb_shard_group: hash: zch tables \(item\) are sharded over every "
                                    r"rank: .* \(set it to the world size 2\) \(got 1\)$")),
    ("+parallel.sharding_types={item: [table_wise]}",
     (r"^parallel.sharding_types: table 'item' is hash: zch, which TorchRec shards row_wise only "
      r"\(got \['table_wise'\]\)$")),
])
def test_layouts_zch_tables_cannot_take_are_refused(override, match):
    """What `gem-train --check` reports for a world of 2 ranks, before any rank starts."""
    from gem.train.trainer import build_configs

    assert build_configs(compose(ZCH), world_size=2).parallel.emb_shard_group == 2
    with pytest.raises(ValueError, match=match) as e:
        build_configs(compose(ZCH + [override]), world_size=2)
    assert "\n" not in str(e.value)
