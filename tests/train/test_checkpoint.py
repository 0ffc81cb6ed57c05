"""Atomic DCP checkpoints: complete step_N dirs only, interrupted saves leave nothing loadable behind."""

import pytest
import torch
import torch.distributed.checkpoint as dcp

from gem.train import checkpoint as ckpt_mod
from gem.train.checkpoint import Checkpointer, check_tensor_leaves, latest_checkpoint, list_checkpoints


def _state(v: float) -> dict:
    return {
        "model": {"w": torch.full((3, 2), v), "b": torch.full((2,), -v)},
        "progress": {"step": torch.tensor(int(v))},
    }


def test_save_load_roundtrip_and_keep(tmp_path):
    c = Checkpointer(tmp_path / "ck", keep=2)
    for step in (1, 2, 3):
        path = c.save(step, _state(float(step)))
        assert path.name == f"step_{step}"
    assert [s for s, _ in list_checkpoints(tmp_path / "ck")] == [2, 3]  # the oldest pruned
    step, path = latest_checkpoint(tmp_path / "ck")
    assert step == 3
    into = _state(0.0)
    c.load(path, into)
    assert torch.equal(into["model"]["w"], torch.full((3, 2), 3.0))
    assert torch.equal(into["model"]["b"], torch.full((2,), -3.0))
    assert int(into["progress"]["step"]) == 3
    assert not any(p.name.startswith(".tmp-") for p in (tmp_path / "ck").iterdir())


def test_interrupted_save_leaves_no_step_dir(tmp_path, monkeypatch):
    c = Checkpointer(tmp_path, keep=3)
    c.save(5, _state(5.0))
    real_save = dcp.save

    def failing_save(state, checkpoint_id):
        real_save(state, checkpoint_id=checkpoint_id)  # shards written ...
        raise RuntimeError("disk full")  # ... but the save never finishes

    monkeypatch.setattr(ckpt_mod.dcp, "save", failing_save)
    with pytest.raises(RuntimeError, match="disk full"):
        c.save(6, _state(6.0))
    assert not (tmp_path / "step_6").exists()
    assert (tmp_path / ".tmp-step_6").exists()
    step, path = latest_checkpoint(tmp_path)
    assert step == 5  # the previous one is still the newest complete checkpoint, and it loads
    into = _state(0.0)
    c.load(path, into)
    assert torch.equal(into["model"]["w"], torch.full((3, 2), 5.0))

    monkeypatch.setattr(ckpt_mod.dcp, "save", real_save)
    c.save(7, _state(7.0))
    assert not (tmp_path / ".tmp-step_6").exists()  # leftovers cleaned by the next save
    assert [s for s, _ in list_checkpoints(tmp_path)] == [5, 7]


def test_step_dir_without_metadata_is_ignored(tmp_path):
    (tmp_path / "step_9").mkdir()  # e.g. created by hand: no DCP metadata, not a checkpoint
    assert latest_checkpoint(tmp_path) is None
    assert latest_checkpoint(tmp_path / "missing") is None


def test_non_tensor_state_is_refused(tmp_path):
    with pytest.raises(TypeError, match="progress.step"):
        check_tensor_leaves({"progress": {"step": 3}})
    with pytest.raises(TypeError, match=r"opt\.groups\[1\]"):
        Checkpointer(tmp_path).save(1, {"opt": {"groups": [torch.ones(1), "x"]}})
    assert not (tmp_path / "step_1").exists()
    with pytest.raises(ValueError, match="keep"):
        Checkpointer(tmp_path, keep=0)
