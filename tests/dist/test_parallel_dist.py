"""Multi-rank (torchrun, gloo, fp32) checks of gem.parallel on the tiny GEM model.

Parity: k steps on N ranks, each on its slice of the same global batch, give the losses and first-step dense
gradients of one rank on the whole batch (rank losses are local means; DDP/FSDP average gradients, TorchRec
averages embedding gradients over the world). With several embedding groups the replicas are averaged every
`emb_sync_every` steps: with SGD and a sync every step that is exactly the one-rank update.
"""

from __future__ import annotations

import json

import pytest

from tests.dist._common import torchrun

pytestmark = pytest.mark.slow

GRAD_RTOL = 1e-4  # fp32, different reduction order


def _train(tmp_path, nproc: int, parallel: dict, sparse_opt: str, groups: dict | None = None, **kw) -> dict:
    """`groups`: the compile / activation_checkpoint groups ({group: mapping})."""
    args = ["--parallel", json.dumps(parallel), "--sparse-opt", sparse_opt, "--lr", "0.5", "--steps", "3"]
    for group, value in (groups or {}).items():
        args += [f"--{group.replace('_', '-')}", json.dumps(value)]
    for k, v in kw.items():
        args += [f"--{k.replace('_', '-')}"] + ([] if v is True else [str(v)])
    return torchrun("run_train.py", nproc, args, tmp_path)


@pytest.fixture(scope="module")
def ref_adagrad(tmp_path_factory):
    return _train(tmp_path_factory.mktemp("ref_adagrad"), 1, {}, "rowwise_adagrad")


@pytest.fixture(scope="module")
def ref_sgd(tmp_path_factory):
    return _train(tmp_path_factory.mktemp("ref_sgd"), 1, {}, "sgd")


def assert_parity(ref: dict, got: dict, loss_atol: float = 2e-6) -> None:
    assert got["losses"] == pytest.approx(ref["losses"], abs=loss_atol, rel=0)
    assert got["grads"].keys() == ref["grads"].keys()
    for name, g_ref in ref["grads"].items():
        g = got["grads"][name]
        scale = max(max(abs(x) for x in g_ref), 1e-12)
        err = max(abs(a - b) for a, b in zip(g, g_ref))
        assert err <= GRAD_RTOL * scale, f"{name}: max |grad diff| {err:.3g} vs max |grad| {scale:.3g}"
    # the run trained: losses moved
    assert abs(ref["losses"][-1] - ref["losses"][0]) > 1e-3


ROW_WISE_BAG = {"item": ["row_wise"], "action": ["column_wise"], "user_segment": ["row_wise"],
                "context": ["column_wise", "table_wise"]}


@pytest.mark.parametrize("nproc,parallel,groups", [
    pytest.param(2, {"dense": "ddp", "sharding_types": ROW_WISE_BAG}, {}, id="ddp_constrained_plan"),
    pytest.param(2, {"dense": "fsdp", "dp_replicate": 2}, {"activation_checkpoint": {"mode": "selective", "every": 2}},
                 id="hsdp_2x1_selective_ac"),
    pytest.param(2, {"dense": "fsdp", "ep": 2, "reshard_after_forward": False},
                 {"activation_checkpoint": {"mode": "full"}}, id="fsdp_ep2_full_ac"),
    # the blocks' compiled regions (the CUDA default) traced over FSDP2 and expert-sharded DTensor weights; aot_eager:
    # Inductor's CPU code generation for two ranks on two cores took a minute, its numerics are tests/model's
    pytest.param(2, {"dense": "fsdp", "ep": 2}, {"compile": {"enabled": True, "backend": "aot_eager"}},
                 id="fsdp_ep2_compiled"),
])
def test_parity_with_one_rank(tmp_path, ref_adagrad, nproc, parallel, groups):
    got = _train(tmp_path, nproc, parallel, "rowwise_adagrad", groups)
    assert_parity(ref_adagrad, got)
    for table, allowed in parallel.get("sharding_types", {}).items():
        assert got["plan"][table] in allowed, (table, got["plan"][table])


@pytest.mark.slow
@pytest.mark.parametrize("form", ["interaction", "targets"])
def test_request_batches_parity_with_one_rank(tmp_path, form):
    """Requests of 1..5 candidates: the ranks score different numbers of candidates (every KJT has one row per
    request; the candidate ids are jagged on them) and train as one rank on the whole batch, sharded row-, column-
    and table-wise."""
    kw = {"max_candidates": 5, "candidates": form}
    (tmp_path / "one").mkdir()
    (tmp_path / "two").mkdir()
    ref = _train(tmp_path / "one", 1, {}, "rowwise_adagrad", **kw)
    plan = {"item": ["row_wise"], "action": ["column_wise"], "user_segment": ["row_wise"], "context": ["table_wise"]}
    got = _train(tmp_path / "two", 2, {"dense": "ddp", "sharding_types": plan}, "rowwise_adagrad", **kw)
    for table, allowed in plan.items():
        assert got["plan"][table] in allowed, (table, got["plan"][table])
    assert_parity(ref, got)


def test_parity_5d_strided_groups_sync_every_step(tmp_path, ref_sgd):
    par = {"dense": "fsdp", "dp_replicate": 2, "ep": 2, "emb_shard_group": 2, "emb_sync_every": 1,
           "emb_group_layout": "strided"}
    assert_parity(ref_sgd, _train(tmp_path, 4, par, "sgd"))


def test_expert_parallel_matches_unsharded_moe(tmp_path):
    res = torchrun("run_expert.py", 2, [], tmp_path)
    assert set(res) == {"uneven", "empty_rank", "skew_no_rows_to_some", "top1_capacity"}
    for case, errs in res.items():
        for key in ("y", "dx", "w1", "w3", "w2", "router"):
            assert errs[key] < 1e-12, (case, key, errs[key])
        assert min(errs["w1_ref_norm"], errs["w2_ref_norm"], errs["w3_ref_norm"]) > 1e-3, case


FIVE_D = {"dense": "fsdp", "dp_replicate": 2, "ep": 2, "emb_shard_group": 2, "emb_sync_every": 2}


def _dcp(tmp_path, nproc: int, phase: str, ckpt, parallel: dict, *extra: str) -> dict:
    return torchrun("run_dcp.py", nproc, ["--phase", phase, "--ckpt", str(ckpt), "--parallel", json.dumps(parallel),
                                          *extra], tmp_path)


def test_dcp_round_trip_5d_replica_sync_and_reshard_to_2_ranks(tmp_path):
    ckpt = tmp_path / "ckpt"
    saved = _dcp(tmp_path, 4, "save", ckpt, FIVE_D, "--load-here")
    # embedding replicas (weights + row-wise Adagrad state): apart between syncs, identical right after one
    # (steps 1..4; sync every 2 steps, plus the explicit sync before saving after step 2)
    rep = saved["replicas"]
    assert rep[0] > 1e-5 and rep[2] > 1e-5 and rep[1] == 0.0 and rep[3] == 0.0, rep
    # same world and layout, a fresh copy loaded from the checkpoint: the same next steps
    same = saved["same_world"]
    assert same["after"] == pytest.approx(saved["after"], abs=1e-6, rel=0)
    assert abs(same["fresh"] - saved["after"][0]) > 1e-3  # loading changed the model
    # 2 ranks, one embedding group, ep 2 over both ranks: same weights -> same next loss (later steps differ:
    # the saved run's embedding replicas drift apart between syncs, the 2-rank run has a single copy)
    two = _dcp(tmp_path, 2, "load", ckpt, {"dense": "fsdp", "ep": 2})
    assert two["after"][0] == pytest.approx(saved["after"][0], abs=2e-6, rel=0)


def test_dcp_reshard_hsdp_ep_4_ranks_to_fsdp_2_ranks(tmp_path):
    ckpt = tmp_path / "ckpt"
    saved = _dcp(tmp_path, 4, "save", ckpt, {"dense": "fsdp", "dp_replicate": 2, "ep": 2})
    # no ep (experts whole on every rank), and activation checkpointing wrappers that the saver did not have
    two = _dcp(tmp_path, 2, "load", ckpt, {"dense": "fsdp"}, "--activation-checkpoint", '{"mode": "full"}')
    # optimizer state (AdamW + row-wise Adagrad) carried over: the second step matches too
    assert two["after"] == pytest.approx(saved["after"], abs=1e-5, rel=0)
    assert abs(two["fresh"] - saved["after"][0]) > 1e-3
