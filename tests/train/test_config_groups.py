"""The `compile`, `activation_checkpoint` and `comm` groups and the precision keys in `train`: the keys that moved
there from `parallel` say where they went (one line, exit 2, on the command line and in a config file), and the new
keys reach what they control."""

from __future__ import annotations

import pytest

from gem.config import MOVED_KEYS, ConfigError
from gem.parallel.dims import ParallelConfig
from tests.train._util import SMALL, compose

OLD_VALUES = {  # a value the old key took
    "parallel.compile": "true",
    "parallel.compile_backend": "eager",
    "parallel.activation_checkpoint": "full",
    "parallel.ac_every": "2",
    "parallel.timeout_s": "60",
    "parallel.param_dtype": "bf16",
    "parallel.reduce_dtype": "fp32",
}


def test_every_moved_key_is_covered():
    assert set(OLD_VALUES) == set(MOVED_KEYS)


@pytest.mark.parametrize("old", sorted(OLD_VALUES))
@pytest.mark.parametrize("plus", ["", "+"])
def test_old_key_on_the_command_line_says_where_it_went(tmp_path, monkeypatch, capsys, old, plus):
    from gem.train.__main__ import main

    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    assert main(["--check", f"{plus}{old}={OLD_VALUES[old]}"]) == 2
    lines = [ln for ln in capsys.readouterr().err.splitlines() if ln.strip()]
    assert lines == [f"gem-train: error: {old}: moved to {MOVED_KEYS[old]}"]
    assert not (tmp_path / "outputs").exists()


@pytest.mark.parametrize("old", sorted(OLD_VALUES))
def test_old_key_in_a_config_file_says_where_it_went(old):
    import yaml

    key = old.split(".", 1)[1]
    with pytest.raises(ConfigError) as e:
        ParallelConfig.from_any({"dense": "ddp", key: yaml.safe_load(OLD_VALUES[old])})
    assert str(e.value) == f"{old}: moved to {MOVED_KEYS[old]}"


def test_the_new_keys_take_effect(monkeypatch):
    """compile.enabled / compile.backend reach the compiler, activation_checkpoint.mode / every wrap those blocks,
    comm.timeout_s is the process group's timeout (no GPU: compile is off by default here)."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointWrapper

    from gem.parallel import api
    from gem.train import trainer

    compiled, timeouts = [], []
    real_init = trainer.init_distributed
    monkeypatch.setattr(api, "apply_compile", lambda inner, blocks, **kw: compiled.append(kw))
    monkeypatch.setattr(trainer, "init_distributed", lambda t, store=None: (timeouts.append(t), real_init(t))[1])
    t = trainer.Trainer(compose([*SMALL, "model.tower.num_blocks=3", "compile.enabled=true", "compile.backend=eager",
                                 "activation_checkpoint.mode=selective", "activation_checkpoint.every=2",
                                 "comm.timeout_s=42"]))
    assert compiled == [{"backend": "eager"}]
    assert [isinstance(b, CheckpointWrapper) for b in t.inner.blocks] == [True, False, True]
    assert timeouts == [42.0]
    t = trainer.Trainer(compose([*SMALL, "activation_checkpoint.mode=full"]))
    assert compiled == [{"backend": "eager"}]  # compile.enabled: auto, off on the CPU
    assert all(isinstance(b, CheckpointWrapper) for b in t.inner.blocks)
    assert timeouts == [42.0, 600.0]


def test_fsdp_mixed_precision_comes_from_train():
    import torch

    from gem.train.trainer import Trainer

    def dtypes(t):
        groups = [g for m in t.inner.blocks for g in m._get_fsdp_state()._fsdp_param_groups]
        return {(g.mp_policy.param_dtype, g.mp_policy.reduce_dtype) for g in groups}

    t = Trainer(compose([*SMALL, "parallel.dense=fsdp", "train.param_dtype=bf16", "train.reduce_dtype=fp32"]))
    assert dtypes(t) == {(torch.bfloat16, torch.float32)}
    t = Trainer(compose([*SMALL, "parallel.dense=fsdp"]))
    assert dtypes(t) == {(torch.float32, torch.float32)}


def test_checkpoint_saved_with_the_old_keys_resumes(tmp_path):
    """A checkpoint whose saved config still holds the keys that left `parallel` (with other values than now) is
    resumed; a value that decides the state still stops the run."""
    import torch

    from gem.train.checkpoint import Checkpointer, CheckpointError, run_config
    from gem.train.preflight import check_resume
    from gem.train.trainer import build_configs

    cfgs = build_configs(compose([*SMALL, "train.resume=true"]))
    old = {"parallel.compile": True, "parallel.compile_backend": "eager", "parallel.activation_checkpoint": "full",
           "parallel.ac_every": 2, "parallel.timeout_s": 60.0, "parallel.param_dtype": "bf16",
           "parallel.reduce_dtype": "bf16"}
    assert set(old) == set(MOVED_KEYS)
    state = {"model": {"w": torch.ones(2)}, "progress": {"step": torch.tensor(1)}}
    Checkpointer(tmp_path / "a", config={**run_config(cfgs), **old}).save(1, state)
    check_resume(cfgs, str(tmp_path / "a"))
    Checkpointer(tmp_path / "b", config={**run_config(cfgs), **old, "model.d_model": 64}).save(1, state)
    with pytest.raises(CheckpointError, match=r"model\.d_model=64 \(got 32\)$"):
        check_resume(cfgs, str(tmp_path / "b"))


def test_bad_precision_dtype_is_one_line():
    from gem.train.config import TrainConfig, TrainConfigError

    with pytest.raises(TrainConfigError, match=r"^train\.param_dtype: must be fp32, bf16 or fp16 \(got fp8\)$"):
        TrainConfig.from_dict({"param_dtype": "fp8"})
