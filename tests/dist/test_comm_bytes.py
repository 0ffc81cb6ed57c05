"""4 gloo ranks train the tiny GEM model; the bytes every collective moves per step must equal gem.plan's formulas
(gem/plan/comm.py), kind by kind. Two layouts: HSDP 2 x 2 in bf16 + expert parallelism + two host-local embedding
groups synced every 2 steps; FSDP over 4 + two strided embedding groups with row-, column- and table-wise tables."""

from __future__ import annotations

import json

import pytest

from gem.parallel.dims import ParallelConfig, ParallelDims, validate
from gem.plan import comm
from gem.plan.memory import fsdp_units
from tests.dist._common import model_cfg, torchrun

HSDP_EP = {"dense": "fsdp", "dp_replicate": 2, "dp_shard": 2, "ep": 2, "emb_shard_group": 2, "emb_sync_every": 2}
FSDP_MIXED = {"dense": "fsdp", "dp_shard": 4, "emb_shard_group": 2, "emb_group_layout": "strided",
              "sharding_types": {"user_segment": ["row_wise"], "context": ["column_wise"],
                                 "item": ["column_wise"], "action": ["table_wise"]}}
STEPS = 2  # counted after one warm-up step


def _tables(plan: dict, cfg) -> list[comm.TableShards]:
    by_name = {t.name: t for t in cfg.tables}
    return [comm.TableShards(name, by_name[name].kind, by_name[name].num_embeddings, by_name[name].embedding_dim,
                             list(by_name[name].features), ps["sharding_type"], [tuple(s) for s in ps["shards"]])
            for mp in plan.values() for name, ps in mp.items()]


def _per_step(rank: dict, key: str) -> float:
    return rank["bytes"].get(key, 0.0) / STEPS


def _sum(colls, op: str) -> float:
    return sum(c.bytes for c in colls if c.op == op)


@pytest.mark.slow
# HSDP_EP in bf16 (train.param_dtype): all-gathers and expert rows in bf16, gradients reduced in fp32
@pytest.mark.parametrize("layout,param_dtype", [(HSDP_EP, "bf16"), (FSDP_MIXED, "fp32")],
                         ids=["hsdp_ep_2d", "fsdp_strided_mixed"])
def test_collective_bytes_match_the_plan_formulas(tmp_path, layout, param_dtype):
    measured = torchrun("run_comm_bytes.py", 4, ["--parallel", json.dumps(layout), "--param-dtype", param_dtype,
                                                 "--steps", str(STEPS)], tmp_path)
    cfg = model_cfg(moe_every=2)
    par = validate(ParallelConfig.from_any(layout), 4)
    ranks = measured["ranks"]
    groups = comm.layout_groups(par, 4, 4)
    for r in ranks:
        assert not any(k.startswith("uncounted/") or "/other:" in k for k in r["calls"]), r["calls"]

    # FSDP / HSDP / router: the same on every rank, independent of the data
    dense: dict[tuple[str, str], float] = {}
    act = 2 if param_dtype == "bf16" else 4  # the blocks compute in the all-gathered params' dtype
    for c in comm.dense_collectives(fsdp_units(cfg, par.ep), par, groups, act, 4):
        dense[(c.op, c.group)] = dense.get((c.op, c.group), 0.0) + c.bytes
    router = _sum(comm.expert_collectives(cfg, par, groups, 0, 4), comm.ALL_REDUCE)
    for r in ranks:
        got = {tuple(k.split("/")): v / STEPS for k, v in r["bytes"].items()
               if k.split("/")[1] in ("dp_shard", "dp_replicate", "dp_shard_mod_ep")}
        assert got == dense
        assert _per_step(r, "all_reduce/ep") == router

    # all-to-alls: what one rank sends depends on where its ids / tokens went; a group's total does not
    tables = _tables(measured["plan"], cfg)
    dims = ParallelDims(cfg=par, world_size=4, rank=0, local_world_size=4, device=None)
    layout_t = dims.emb_layout()
    for group in layout_t.tolist():
        want: dict[str, float] = {}
        for r in group:
            b = ranks[r]["batch"]
            ids = {f: n / STEPS / b for f, n in ranks[r]["ids"].items()}
            for c in comm.embedding_collectives(tables, groups, b, ids):
                want[c.op] = want.get(c.op, 0.0) + c.bytes
        for op in (comm.ALL_TO_ALL, comm.REDUCE_SCATTER, comm.ALL_GATHER):
            got = sum(_per_step(ranks[r], f"{op}/emb_shard") for r in group)
            assert got == pytest.approx(want.get(op, 0.0), rel=1e-12), op
    if par.ep > 1:
        for group in ([0, 1], [2, 3]):
            got = sum(_per_step(ranks[r], "all_to_all/ep") for r in group)
            want_exp = sum(_sum(comm.expert_collectives(cfg, par, groups, ranks[r]["tokens"] / STEPS, act),
                                comm.ALL_TO_ALL) for r in group)
            assert got == pytest.approx(want_exp, rel=1e-12)

    # replica sync: each local shard and its row-wise Adagrad state, once per emb_sync_every steps; the plan's
    # placements are group 0's, the rank at the same position of another group holds the same shards
    elems = comm.local_table_elements(tables, "rowwise_adagrad")
    for r, rank in enumerate(ranks):
        pos = (layout_t == r).nonzero()[0, 1]
        twin = int(layout_t[0, pos])
        assert _per_step(rank, "all_reduce/emb_replicate") == 4.0 * elems.get(twin, 0) / par.emb_sync_every
    sync = comm.replica_sync_collectives(tables, groups, "rowwise_adagrad", par.emb_sync_every)
    assert sync[0].bytes == max(_per_step(rank, "all_reduce/emb_replicate") for rank in ranks)
