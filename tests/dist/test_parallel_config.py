"""Single-process checks of the `parallel:` config: validation messages, degree resolution, group layouts."""

from __future__ import annotations

import pytest
import torch

from gem.config import ConfigError
from gem.parallel.dims import (
    ActivationCheckpointConfig,
    CommConfig,
    CompileConfig,
    ParallelConfig,
    ParallelConfigError,
    ParallelDims,
    validate,
)
from gem.parallel.embedding import sparse_optimizer_spec


def _v(world: int, **kw) -> ParallelConfig:
    return validate(ParallelConfig.from_any(kw), world)


@pytest.mark.parametrize("world,kw,msg", [
    (4, dict(dp_shard=3), "parallel.dp_shard: dp_replicate (1) x dp_shard must be the world size 4 (got 3)"),
    (4, dict(dp_replicate=3), "parallel.dp_replicate: must divide the world size 4 (got 3)"),
    (8, dict(dp_replicate=2, dp_shard=2), "parallel.dp_shard: dp_replicate (2) x dp_shard must be the world size 8"),
    (4, dict(ep=3), "parallel.ep: must divide dp_shard (4) (got 3)"),
    (8, dict(dp_replicate=2, ep=8), "parallel.ep: must divide dp_shard (4) (got 8)"),
    (4, dict(emb_shard_group=3), "parallel.emb_shard_group: must divide the world size 4 (got 3)"),
    (4, dict(emb_shard_group=0), "parallel.emb_shard_group: must be >= 1 or -1 (got 0)"),
    (4, dict(emb_sync_every=0), "parallel.emb_sync_every: must be >= 1 (got 0)"),
    (4, dict(dp_shard=2.0), "parallel.dp_shard: expected an integer (got 2.0)"),
    (4, dict(ep=True), "parallel.ep: expected an integer (got true)"),
    (4, dict(emb_group_layout="diagonal"), "parallel.emb_group_layout: must be host_local or strided (got diagonal)"),
    (4, dict(dense="zero3"), "parallel.dense: must be auto, ddp or fsdp (got zero3)"),
    (4, dict(dense="ddp", dp_replicate=2), "parallel.dense: HSDP (dp_replicate=2) needs fsdp or auto (got ddp)"),
    (4, dict(dense="ddp", ep=2), "parallel.dense: expert parallelism (ep=2) needs fsdp or auto (got ddp)"),
    (4, dict(reshard_after_forward=0), "parallel.reshard_after_forward: expected true, false or an int >= 1 (got 0)"),
    (4, dict(sharding_types=["diagonal"]), "parallel.sharding_types: must be table_wise,"),
    (4, dict(sharding_types={"item": []}), "parallel.sharding_types: expected a non-empty list of types"),
    (4, dict(sharding_types=["data_parallel"]), "parallel.sharding_types: data_parallel is not offered"),
])
def test_bad_configs_give_one_line_naming_the_key(world, kw, msg):
    with pytest.raises(ParallelConfigError) as e:
        _v(world, **kw)
    text = str(e.value)
    assert text.startswith(msg), text
    assert "\n" not in text


def test_unknown_key_is_named():
    with pytest.raises(ParallelConfigError, match=r"^parallel\.dp_sahrd: unknown key"):
        ParallelConfig.from_any({"dp_sahrd": 2})


@pytest.mark.parametrize("cls,kw,msg", [
    (CompileConfig, dict(enabled="yes"), "compile.enabled: expected true or false or auto (got yes)"),
    (CompileConfig, dict(backend="tvm"), "compile.backend: must be inductor, aot_eager or eager (got tvm)"),
    (CompileConfig, dict(mode="max-autotune"), "compile.mode: unknown key (expected one of backend, enabled)"),
    (ActivationCheckpointConfig, dict(mode="some"), "activation_checkpoint.mode: must be none, full or selective"),
    (ActivationCheckpointConfig, dict(every=0), "activation_checkpoint.every: must be >= 1 (got 0)"),
    (ActivationCheckpointConfig, dict(every=True), "activation_checkpoint.every: expected an integer (got true)"),
    (CommConfig, dict(timeout_s=0), "comm.timeout_s: must be a number of seconds > 0 (got 0.0)"),
    (CommConfig, dict(timeout_s="10m"), "comm.timeout_s: expected a number (got 10m)"),
])
def test_bad_compile_checkpoint_and_comm_values_give_one_line(cls, kw, msg):
    with pytest.raises(ConfigError) as e:
        cls.from_any(kw)
    assert str(e.value).startswith(msg) and "\n" not in str(e.value), str(e.value)


@pytest.mark.parametrize("make,key", [
    (lambda: CompileConfig(enabled="yes"), "compile.enabled"),
    (lambda: CompileConfig(backend="tvm"), "compile.backend"),
    (lambda: ActivationCheckpointConfig(mode="some"), "activation_checkpoint.mode"),
    (lambda: ActivationCheckpointConfig(every=0), "activation_checkpoint.every"),
    (lambda: CommConfig(timeout_s=-1), "comm.timeout_s"),
])
def test_groups_built_in_code_are_checked_too(make, key):
    with pytest.raises(ConfigError, match=rf"^{key}: "):
        make()


@pytest.mark.parametrize("kw,dense", [
    (dict(dp_replicate=2, dp_shard=2), "fsdp"),  # HSDP without naming parallel.dense
    (dict(ep=2), "fsdp"),
    (dict(), "ddp"),
    (dict(dense="fsdp"), "fsdp"),
])
def test_degrees_imply_the_dense_layout(kw, dense):
    c = _v(4, **kw)
    assert c.dense == dense
    assert validate(c, 4) == c  # resolving twice changes nothing


def test_omegaconf_and_presets_load():
    from hydra import compose, initialize_config_dir

    from tests.dist._common import ROOT

    expect = {"single": (1, 4, 1, 4), "ddp": (1, 4, 1, 4), "default": (1, 4, 1, 4), "hsdp": (2, 2, 1, 4),
              "hsdp_ep": (2, 2, 2, 4), "full_5d": (2, 2, 2, 2)}
    with initialize_config_dir(config_dir=str(ROOT / "configs/parallel"), version_base="1.3"):
        for name, (rep, shard, ep, g) in expect.items():
            c = validate(ParallelConfig.from_any(compose(config_name=name)), 4)
            assert (c.dp_replicate, c.dp_shard, c.ep, c.emb_shard_group) == (rep, shard, ep, g), name
    full = validate(ParallelConfig.from_any({"dp_replicate": 2, "ep": 2}), 8)
    assert (full.dp_shard, full.emb_shard_group) == (4, 8)


def _dims(world: int, rank: int, **kw) -> ParallelDims:
    return ParallelDims(cfg=_v(world, **kw), world_size=world, rank=rank, local_world_size=4,
                        device=torch.device("cpu"))


@pytest.mark.parametrize("world,g", [(8, 2), (8, 4), (8, 8), (8, 1), (6, 3), (1, 1), (12, 4)])
@pytest.mark.parametrize("layout", ["host_local", "strided"])
def test_embedding_groups_partition_the_world(world, g, layout):
    n = world // g
    groups, replicas = set(), set()
    for r in range(world):
        d = _dims(world, r, emb_shard_group=g, emb_group_layout=layout)
        grp, rep = d.emb_group_ranks(), d.emb_replica_ranks()
        assert r in grp and r in rep and len(grp) == g and len(rep) == n
        assert len(set(grp) & set(rep)) == 1  # a group and a replica set meet in this rank only
        if layout == "host_local":
            assert grp == list(range(r // g * g, r // g * g + g))
        else:
            assert grp == [x for x in range(world) if x % n == r % n]
        # local index inside the group is what torchrec's 2D env computes (rank % g, or rank // n strided)
        assert grp.index(r) == (r % g if layout == "host_local" else r // n)
        groups.add(tuple(grp))
        replicas.add(tuple(rep))
    assert sorted(x for grp in groups for x in grp) == list(range(world))
    assert sorted(x for rep in replicas for x in rep) == list(range(world))
    # replica sets line up shard positions: the k-th member of every group is in one replica set
    for rep in replicas:
        ks = {_dims(world, r, emb_shard_group=g, emb_group_layout=layout).emb_group_ranks().index(r) for r in rep}
        assert len(ks) == 1


def test_sparse_optimizer_spec():
    from fbgemm_gpu.split_table_batched_embeddings_ops_training import WeightDecayMode
    from torchrec import optim as trec_optim

    assert sparse_optimizer_spec(None) == (trec_optim.RowWiseAdagrad, {"lr": 0.01, "eps": 1e-8})
    assert sparse_optimizer_spec({"name": "sgd", "lr": 0.5}) == (trec_optim.SGD, {"lr": 0.5})
    assert sparse_optimizer_spec({"name": "adam", "lr": 1, "eps": 1e-6})[1] == {"lr": 1.0, "eps": 1e-6}
    # fbgemm's own argument names: beta1 / beta2, and a weight decay only with its mode
    # fbgemm's adam decays decoupled with no mode argument; its rowwise_adagrad takes either mode
    assert sparse_optimizer_spec({"name": "adam", "betas": [0.8, 0.95], "weight_decay": 0.1})[1] == {
        "lr": 0.01, "eps": 1e-8, "beta1": 0.8, "beta2": 0.95, "weight_decay": 0.1}
    for mode, want in ((None, WeightDecayMode.L2), ("l2", WeightDecayMode.L2), ("decoupled", WeightDecayMode.DECOUPLE)):
        cfg = {"name": "rowwise_adagrad", "weight_decay": 0.2, **({"weight_decay_mode": mode} if mode else {})}
        assert sparse_optimizer_spec(cfg)[1] == {"lr": 0.01, "eps": 1e-8, "weight_decay": 0.2,
                                                 "weight_decay_mode": want}
    assert "weight_decay" not in sparse_optimizer_spec({"name": "sgd", "weight_decay": 0})[1]
    for cfg, match in [
        ({"name": "lamb"}, r"^train\.sparse_optimizer\.name: expected one of rowwise_adagrad, .* \(got lamb\)$"),
        ({"name": "adam", "betaz": 1}, r"^train\.sparse_optimizer\.betaz: unknown key \(got 1\)$"),
        ({"name": "sgd", "momentum": 0.9}, r"^train\.sparse_optimizer\.momentum: fbgemm's fused sgd has no momentum"),
        ({"name": "sgd", "weight_decay": 0.1}, r"^train\.sparse_optimizer\.weight_decay: fbgemm's fused sgd has no "),
        ({"name": "adagrad", "weight_decay": 0.1}, r"^train\.sparse_optimizer\.weight_decay: fbgemm's fused adagrad "
                                                   r"has no weight decay"),
        ({"name": "adam", "weight_decay": 0.1, "weight_decay_mode": "l2"},
         r"^train\.sparse_optimizer\.weight_decay_mode: fbgemm's fused adam decays the weights decoupled"),
        ({"name": "adagrad", "weight_decay": 0.1, "weight_decay_mode": "l1"},
         r"^train\.sparse_optimizer\.weight_decay_mode: expected one of l2, decoupled \(got l1\)$"),
        ({"name": "rowwise_adagrad", "betas": [0.9, 0.99]}, r"^train\.sparse_optimizer\.betas: only adam takes"),
        ({"name": "adam", "betas": [0.9]}, r"^train\.sparse_optimizer\.betas: need two values in \[0, 1\)"),
    ]:
        with pytest.raises(ParallelConfigError, match=match):
            sparse_optimizer_spec(cfg)


class _Stop(Exception):
    pass


@pytest.mark.parametrize("entry", ["trainer", "cli"])
def test_timeout_is_the_process_groups(monkeypatch, entry):
    """comm.timeout_s is the collective timeout the process group is created with, by the trainer and by the
    command line (which creates the group before Hydra's job)."""
    from gem.parallel import dims
    from gem.train import trainer
    from gem.train.__main__ import main
    from tests.train._util import SMALL, compose

    seen = []

    def fake(timeout_s=600.0, store=None):
        seen.append(timeout_s)
        raise _Stop

    monkeypatch.setattr(trainer, "init_distributed", fake)
    monkeypatch.setattr(dims, "init_distributed", fake)
    with pytest.raises(_Stop):
        if entry == "trainer":
            trainer.Trainer(compose([*SMALL, "comm.timeout_s=42"]))
        else:
            main(["experiment=tiny_cpu", "comm.timeout_s=42"])
    assert seen == [42.0]
