"""Atomic DCP checkpoints: complete step_N dirs only, interrupted saves leave nothing loadable behind."""

import json

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


class _RunsCode:
    """A pickle payload that would create a file when unpickled by a plain unpickler."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        import pathlib

        return (pathlib.Path.touch, (pathlib.Path(self.marker),))


class _RunsCommand:
    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        import os

        return (os.system, (f"touch {self.marker}",))


@pytest.mark.parametrize("payload", [_RunsCode, _RunsCommand])
def test_crafted_metadata_runs_no_code(tmp_path, payload):
    """A checkpoint whose .metadata would run code when unpickled is refused with one line; no code runs."""
    import pickle

    from gem.train.checkpoint import CheckpointError

    c = Checkpointer(tmp_path / "ck")
    path = c.save(1, _state(1.0))
    marker = tmp_path / "pwned"
    crafted = pickle.dumps(payload(marker))
    pickle.loads(crafted)  # the payload is real: a plain unpickler runs it
    assert marker.exists()
    marker.unlink()
    (path / ".metadata").write_bytes(crafted)
    assert latest_checkpoint(tmp_path / "ck")[1] == path
    with pytest.raises(CheckpointError) as e:
        c.load(path, _state(0.0))
    assert not marker.exists()
    msg = str(e.value)
    assert "\n" not in msg and msg.startswith(str(path / ".metadata")) and "disallowed" in msg, msg
    # DCP's own entry point with the safe reader refuses it too
    from gem.train.checkpoint import SafeFileSystemReader

    with pytest.raises(BaseException):  # noqa: B017 - DCP's CheckpointException is a BaseException
        dcp.load(_state(0.0), storage_reader=SafeFileSystemReader(str(path)))
    assert not marker.exists()


def test_metadata_with_a_bytes_entry_or_outside_file_is_refused(tmp_path):
    """DCP would torch.load a bytes entry without weights_only; a storage path may not leave the directory."""
    import pickle

    from torch.distributed.checkpoint.metadata import BytesStorageMetadata

    from gem.train.checkpoint import CheckpointError, load_metadata

    path = Checkpointer(tmp_path / "ck").save(1, _state(1.0))
    good = load_metadata(path)
    assert "model.w" in good.state_dict_metadata and list(good.state_dict_metadata["model.w"].size) == [3, 2]

    md = load_metadata(path)
    md.state_dict_metadata["model.w"] = BytesStorageMetadata()
    (path / ".metadata").write_bytes(pickle.dumps(md))
    with pytest.raises(CheckpointError, match="'model.w' is not a tensor"):
        load_metadata(path)

    md = good
    info = next(iter(md.storage_data.values()))
    info.relative_path = "../../etc/passwd"
    (path / ".metadata").write_bytes(pickle.dumps(md))
    with pytest.raises(CheckpointError, match="outside the checkpoint directory"):
        load_metadata(path)


def test_mismatched_model_names_the_config_values(tmp_path):
    """A checkpoint of another model fails before loading, with one line listing the config values that differ;
    keys marked as free (parallel degrees) are not listed."""
    from gem.train.checkpoint import CheckpointError

    saved_cfg = {"model.d_model": 2, "model.tower.num_blocks": 2, "parallel.dp_shard": 2}
    Checkpointer(tmp_path, config=saved_cfg).save(3, _state(3.0))
    _, path = latest_checkpoint(tmp_path)
    assert json.loads((path / "gem_config.json").read_text()) == saved_cfg

    now = {"model.d_model": 4, "model.tower.num_blocks": 2, "parallel.dp_shard": 1}
    into = {"model": {"w": torch.zeros(3, 4), "b": torch.zeros(2)}, "progress": {"step": torch.tensor(0)}}
    c = Checkpointer(tmp_path, config=now, ignore=("parallel.dp_shard",))
    with pytest.raises(CheckpointError) as e:
        c.load(path, into)
    msg = str(e.value)
    assert "\n" not in msg and "model.d_model=2 (got 4)" in msg and "dp_shard" not in msg and "num_blocks" not in msg
    assert torch.equal(into["model"]["b"], torch.zeros(2))  # nothing was loaded

    # a missing key, no saved config: the key is named
    (path / "gem_config.json").unlink()
    into = {"model": {"w": torch.zeros(3, 2), "extra": torch.zeros(1)}}
    with pytest.raises(CheckpointError, match="'model.extra' is not in the checkpoint"):
        c.load(path, into)
    # only the degrees differ: it loads (DCP reshards)
    Checkpointer(tmp_path / "b", config=saved_cfg).save(1, _state(1.0))
    c = Checkpointer(tmp_path / "b", config={**saved_cfg, "parallel.dp_shard": 1}, ignore=("parallel.dp_shard",))
    into = _state(0.0)
    c.load(latest_checkpoint(tmp_path / "b")[1], into)
    assert torch.equal(into["model"]["w"], torch.full((3, 2), 1.0))


def test_load_failure_past_the_model_check_names_the_config_values(tmp_path):
    """Optimizer state of another sparse optimizer (the model's tensors match): DCP's failure becomes one line
    naming the differing value, and without a saved config one line quoting DCP."""
    from gem.train.checkpoint import CheckpointError

    saved = {"train.sparse_optimizer.name": "rowwise_adagrad"}
    Checkpointer(tmp_path, config=saved).save(1, _state(1.0))
    path = latest_checkpoint(tmp_path)[1]
    into = {**_state(0.0), "optim": {"momentum": torch.zeros(3)}}
    with pytest.raises(CheckpointError) as e:
        Checkpointer(tmp_path, config={"train.sparse_optimizer.name": "adam"}).load(path, into)
    msg = str(e.value)
    assert "\n" not in msg and "train.sparse_optimizer.name=rowwise_adagrad (got adam)" in msg, msg
    with pytest.raises(CheckpointError) as e:
        Checkpointer(tmp_path).load(path, into)
    assert "\n" not in str(e.value) and "cannot load it (" in str(e.value) and "optim.momentum" in str(e.value)


# ---- background saves, retention, damaged checkpoints ---------------------------------------------------------------


def _random_state(seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {"model": {"w": torch.randn(64, 33, generator=g), "b": torch.randn(7, generator=g)},
            "optim": {"m": torch.randn(64, 33, generator=g).to(torch.bfloat16)},
            "progress": {"step": torch.tensor(seed)}}


def _zeros_like(state: dict) -> dict:
    return {k: _zeros_like(v) if isinstance(v, dict) else torch.zeros_like(v) for k, v in state.items()}


def _flat(state: dict, prefix: str = "") -> dict:
    out = {}
    for k, v in state.items():
        out.update(_flat(v, f"{prefix}{k}.") if isinstance(v, dict) else {f"{prefix}{k}": v})
    return out


def test_background_save_equals_the_inline_save_bit_for_bit(tmp_path):
    """The state is copied when `save` returns: training may change it at once, the checkpoint keeps the values
    of the step; what loads back equals an inline save of the same state, bit for bit."""
    state = _random_state(3)
    expect = {k: v.clone() for k, v in _flat(state).items()}
    background = Checkpointer(tmp_path / "bg", async_save=True)
    path = background.save(3, state)
    for v in _flat(state).values():  # the next optimizer step
        v.add_(1)
    assert background.wait() is None
    assert path.is_dir() and latest_checkpoint(tmp_path / "bg")[0] == 3
    inline = Checkpointer(tmp_path / "inline")
    inline.save(3, {k: v if not isinstance(v, dict) else {n: expect[f"{k}.{n}"] for n in v} for k, v in state.items()})
    a, b = _zeros_like(state), _zeros_like(state)
    background.load(path, a)
    inline.load(tmp_path / "inline" / "step_3", b)
    for k, v in _flat(a).items():
        assert v.dtype == expect[k].dtype and torch.equal(v, expect[k]) and torch.equal(v, _flat(b)[k]), k
    background.close()


def test_failing_background_save_keeps_the_previous_checkpoint(tmp_path, monkeypatch):
    from torch.distributed.checkpoint import FileSystemWriter

    c = Checkpointer(tmp_path, async_save=True)
    c.save(1, _random_state(1))
    assert c.wait() is None

    def full_disk(self, plan, planner):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(FileSystemWriter, "write_data", full_disk)
    c.save(2, _random_state(2))
    failure = c.wait()
    assert failure is not None and failure.startswith("checkpoint step_2 failed in the background (") and \
        "No space left on device" in failure, failure
    assert "\n" not in failure and c.wait() is None  # reported once
    assert [s for s, _ in list_checkpoints(tmp_path)] == [1]
    into = _zeros_like(_random_state(1))
    c.load(tmp_path / "step_1", into)
    assert torch.equal(into["model"]["w"], _random_state(1)["model"]["w"])
    monkeypatch.undo()
    c.save(3, _random_state(3))  # the next save works and clears the failed one's leftovers
    assert c.wait() is None
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step_1", "step_3"]
    c.close()


def test_keep_and_keep_steps(tmp_path):
    c = Checkpointer(tmp_path, keep=2, keep_steps=[2])
    for step in range(1, 6):
        c.save(step, _random_state(step))
    assert [s for s, _ in list_checkpoints(tmp_path)] == [2, 4, 5]


def test_damage_names_what_is_wrong(tmp_path):
    from gem.train.checkpoint import damage

    c = Checkpointer(tmp_path)
    path = c.save(1, _random_state(1))
    assert damage(path) is None
    data = min(p for p in path.iterdir() if p.suffix == ".distcp")
    data.write_bytes(data.read_bytes()[:10])
    assert damage(path).startswith(f"{data.name}: 10 bytes, the metadata expects "), damage(path)
    data.unlink()
    assert damage(path) == f"{data.name}: missing"
    (path / ".metadata").write_bytes(b"garbage")
    assert damage(path).startswith(f"{path / '.metadata'}: unreadable DCP metadata")


def test_background_save_seen_ending_at_different_steps_keeps_collectives_paired(tmp_path):
    """`poll` runs no collective: a rank that sees the background save end a step before its peer must not enter a
    barrier that pairs with the peer's training collective."""
    from tests.dist._common import torchrun

    got = torchrun("run_async_poll.py", 2, ["--dir", str(tmp_path / "ckpt")], tmp_path, timeout=120)["ranks"]
    assert got[0]["seen"] == [False, True] and got[1]["seen"] == [True, True]
    for r in got:
        assert r["sum"] == 3.0 and r["failure"] is None and r["published"] == ["step_1"], r
