"""4 gloo ranks train the tiny GEM model under FSDP + HSDP + expert parallelism + 2D embedding groups; the bytes
every collective moves per step must equal gem.plan's formulas (gem/plan/comm.py), kind by kind."""

from __future__ import annotations

import json

import pytest

from gem.parallel.dims import ParallelConfig, validate
from gem.plan import comm
from gem.plan.memory import fsdp_units
from tests.dist._common import model_cfg, torchrun

LAYOUT = {"dense": "fsdp", "dp_replicate": 2, "dp_shard": 2, "ep": 2, "emb_shard_group": 2, "emb_sync_every": 2}
STEPS = 2  # counted after one warm-up step; the embedding replicas sync after the first of them


@pytest.fixture(scope="module")
def measured(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("comm")
    return torchrun("run_comm_bytes.py", 4, ["--parallel", json.dumps(LAYOUT), "--steps", str(STEPS)], tmp)


def _tables(plan: dict, cfg) -> list[comm.TableShards]:
    by_name = {t.name: t for t in cfg.tables}
    return [comm.TableShards(name, by_name[name].kind, by_name[name].num_embeddings, by_name[name].embedding_dim,
                             list(by_name[name].features), ps["sharding_type"], [tuple(s) for s in ps["shards"]])
            for mp in plan.values() for name, ps in mp.items()]


def _per_step(rank: dict, key: str) -> float:
    return rank["bytes"].get(key, 0.0) / STEPS


@pytest.mark.slow
def test_collective_bytes_match_the_plan_formulas(measured):
    cfg = model_cfg(moe_every=2)
    par = validate(ParallelConfig.from_any(LAYOUT), 4)
    ranks = measured["ranks"]
    groups = comm.layout_groups(par, 4, 4)
    for r in ranks:
        assert not any(k.startswith("uncounted/") or "/other:" in k for k in r["calls"]), r["calls"]

    # FSDP / HSDP / router: the same on every rank, independent of the data
    dense: dict[tuple[str, str], float] = {}
    for c in comm.dense_collectives(fsdp_units(cfg, par.ep), par, groups, 4, 4):
        dense[(c.op, c.group)] = dense.get((c.op, c.group), 0.0) + c.bytes
    expected_router = [c for c in comm.expert_collectives(cfg, par, groups, 0, 4) if c.op == comm.ALL_REDUCE]
    for r in ranks:
        assert _per_step(r, "all_gather/dp_shard") == dense[(comm.ALL_GATHER, "dp_shard")]
        assert _per_step(r, "reduce_scatter/dp_shard") == dense[(comm.REDUCE_SCATTER, "dp_shard")]
        assert _per_step(r, "all_reduce/dp_replicate") == dense[(comm.ALL_REDUCE, "dp_replicate")]
        assert _per_step(r, "all_reduce/ep") == expected_router[0].bytes

    # all-to-alls: what one rank sends depends on where its ids / tokens went; a group's total does not
    tables = _tables(measured["plan"], cfg)
    for group in ([0, 1], [2, 3]):
        got_exp = sum(_per_step(ranks[r], "all_to_all/ep") for r in group)
        want_exp = sum(c.bytes for r in group for c in comm.expert_collectives(
            cfg, par, groups, ranks[r]["tokens"] / STEPS, 4) if c.op == comm.ALL_TO_ALL)
        assert got_exp == pytest.approx(want_exp, rel=1e-12)
        got_emb = sum(_per_step(ranks[r], "all_to_all/emb_shard") for r in group)
        want_emb = 0.0
        for r in group:
            b = ranks[r]["batch"]
            ids = {f: n / STEPS / b for f, n in ranks[r]["ids"].items()}
            want_emb += sum(c.bytes for c in comm.embedding_collectives(tables, groups, b, ids))
        assert got_emb == pytest.approx(want_emb, rel=1e-12)

    # replica sync: every local shard and its row-wise Adagrad state, once per emb_sync_every steps
    elems = comm.local_table_elements(tables, "rowwise_adagrad")
    for r, rank in enumerate(ranks):
        assert _per_step(rank, "all_reduce/emb_replicate") == 4.0 * elems[r % 2] / par.emb_sync_every
    sync = comm.replica_sync_collectives(tables, groups, "rowwise_adagrad", par.emb_sync_every)
    assert sync[0].bytes == max(_per_step(rank, "all_reduce/emb_replicate") for rank in ranks)
