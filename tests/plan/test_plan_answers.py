"""gem plan's cost figures and the FLOP model behind them against numbers worked out by hand from their definitions:
FLOPs per candidate form (gem.model.flops), the embedding all-to-all sizes of row- and column-wise tables
(gem.plan.comm), the step-time bounds and the HBM check of an estimate, and the search's memory limit."""

from __future__ import annotations

import pytest
import torch

from gem.model import flops as F
from gem.plan import comm
from gem.plan.comm import ALL_REDUCE, ALL_TO_ALL, Collective, TableShards
from gem.plan.estimate import Estimate
from gem.plan.memory import DenseMemory
from gem.plan.topology import GB, ClusterSpec
from tests.model._batches import tiny_cfg

# gem_tiny (configs/model/gem_tiny.yaml over configs/data/synthetic.yaml) by hand: d_model 32; history features
# hist_item and hist_action (16 each, concatenated); tower of 2 blocks, 2 heads x 16 (kv 2), block 0 SwiGLU d_ff 64,
# block 1 MoE of 4 experts, top 2, d_ff 32; interaction 2 heads x 16; query tokens: cand_item (16), user_segment (8),
# context (8), the dense token and the summary token; 8 dense features; over_arch [64]; 2 tasks with hidden [32].
D = 32
INPUT = (16 + 16) * D
QKVO = D * (2 + 2 * 2) * 16 + 2 * 16 * D
BLOCKS = (QKVO + 3 * D * 64) + (QKVO + D * 4 + 2 * 3 * D * 32)  # the MoE: router + the 2 active experts
KV = D * 2 * 2 * 16  # the interaction's k and v of every history token
PAIR = 3 * 4 * 2 * 16 * 2  # tower attention per visible (query, key) pair: fwd + bwd, 2 blocks
GDPA = 3 * 4 * 2 * 16 * 5  # interaction per (query token, history token) pair, 5 query tokens
# per candidate, outside the towers: query projections, dense-token MLP 8 -> 32 -> 32, dense path 8 -> 32, heads
_OUTSIDE = (16 + 8 + 8) * D + (8 * 32 + 32 * D) + 8 * 32 + 2 * (64 * 32 + 32 * 1)
WEX_ROWS = _OUTSIDE + 5 * (D * 32 + 32 * D) + (5 * D + 32) * 64  # interaction q / out per query token
WEX_TARGETS = _OUTSIDE + 5 * D * D + (D + 32) * 64  # query tokens -> the target token; over_arch reads it alone


def _flops(form: str, lengths: list[int], counts: list[int]) -> list[float]:
    cfg = tiny_cfg()
    cfg.candidates = form
    cfg.validate()
    return F.example_flops(cfg, {"events": torch.tensor(lengths)}, torch.tensor(counts)).tolist()


# requests: (history 0, 1 candidate), (0, 3), (5, 1), (5, 3)
LENGTHS, COUNTS = [0, 0, 5, 5], [1, 3, 1, 3]


def test_rows_form_flops_copy_the_tower_per_candidate_but_not_the_input_projection():
    f = _flops("rows", LENGTHS, COUNTS)
    assert f[0] == 6 * WEX_ROWS and f[1] == 3 * 6 * WEX_ROWS
    per_copy = 6 * (BLOCKS + KV) * 5 + PAIR * 5 * 5 / 2 + GDPA * 5
    assert f[2] - f[0] == 6 * INPUT * 5 + per_copy
    # two more candidates: two more copies of the history through the blocks, attention and interaction only
    assert f[3] - f[2] - (f[1] - f[0]) == 2 * per_copy


def test_interaction_form_runs_the_history_once_and_the_gdpa_per_candidate():
    f = _flops("interaction", LENGTHS, COUNTS)
    assert f[0] == 6 * WEX_ROWS and f[1] == 3 * 6 * WEX_ROWS
    assert f[2] - f[0] == 6 * (INPUT + BLOCKS + KV) * 5 + PAIR * 5 * 5 / 2 + GDPA * 5
    assert f[3] - f[2] - (f[1] - f[0]) == 2 * GDPA * 5


def test_targets_form_counts_each_target_seeing_the_history_and_itself():
    f = _flops("targets", LENGTHS, COUNTS)
    # no history: each target token passes the blocks and sees itself (half the diagonal, as every row)
    per_target = 6 * WEX_TARGETS + 6 * BLOCKS + PAIR / 2
    assert f[0] == per_target and f[1] == 3 * per_target
    assert f[2] - f[0] == 6 * (INPUT + BLOCKS) * 5 + PAIR * 5 * 5 / 2 + PAIR * 5
    assert f[3] - f[2] - (f[1] - f[0]) == 2 * PAIR * 5


def test_embedding_all_to_alls_of_row_and_column_wise_tables():
    """A group of 4 ranks, 5 examples per rank: a pooled table row-wise over the 4 (3 ids per example, dim 8) and a
    sequence table column-wise in 2 shards of 8 columns (10 ids per example, dim 16)."""
    groups = {"emb_shard": (0, 1, 2, 3)}
    tables = [TableShards("u", "bag", 100, 8, ["u"], "row_wise", [(r, 25, 8) for r in range(4)]),
              TableShards("h", "sequence", 1000, 16, ["h"], "column_wise", [(0, 1000, 8), (2, 1000, 8)])]
    got = {c.name: (c.op, c.bytes) for c in comm.embedding_collectives(tables, groups, 5, {"u": 3.0, "h": 10.0})}
    assert got == {
        # the row-wise ids split by row range (each sent once); both column shards need every id
        "embedding input dist (ids)": (ALL_TO_ALL, 8 * (5 * 3 + 2 * 5 * 10)),
        # one length per example to every rank of the group (row-wise) or to each column shard; then two (kind,
        # sharding type) pairs exchange 3 int64 split sizes with each of the 4 ranks
        "embedding input dist (lengths, splits)": (ALL_TO_ALL, 8 * (4 * 5 + 2 * 5) + 2 * 4 * 3 * 8),
        "sequence embedding all-to-all (fwd+bwd)": (ALL_TO_ALL, 2 * 5 * 10 * 16 * 4),
        # the row-wise partial sums of all 4 ranks' examples, forward and their gradients backward
        "pooled embedding reduce-scatter (fwd)": ("reduce_scatter", 4 * 5 * 8 * 4),
        "pooled embedding all-gather (bwd)": ("all_gather", 4 * 5 * 8 * 4),
    }


def _estimate(cluster: ClusterSpec, compute_ms: float, colls: list[Collective], hbm: dict[int, int]) -> Estimate:
    return Estimate(par=None, cluster=cluster, work=None, dense=DenseMemory(0, 0, 0, 0, 0), emb=None,
                    collectives=colls, compute_ms=compute_ms, hbm=hbm, ddr={r: 0 for r in hbm})


def test_step_time_bounds_and_the_hbm_check_of_the_fullest_rank():
    cluster = ClusterSpec(hosts=2, gpus_per_host=2, hbm_gb=80, ddr_gb=64, intra_gbps=100, inter_gbps=10)
    # 1 GB all-reduced in a host: 2 x 1/2 of it on the wire at 100 GB/s = 10 ms; 1 GB all-to-all over 4 ranks on
    # two hosts: 3/4 of it at 10 GB/s = 75 ms
    colls = [Collective("a", ALL_REDUCE, "x", (0, 1), 1e9), Collective("b", ALL_TO_ALL, "y", (0, 1, 2, 3), 1e9)]
    for compute, overlapped in ((40.0, 85.0), (100.0, 100.0)):
        est = _estimate(cluster, compute, colls, {0: GB, 1: 2 * GB})
        assert est.comm_ms == pytest.approx(85.0, rel=1e-12)
        assert est.step_ms == pytest.approx(compute + 85.0, rel=1e-12)
        assert est.overlapped_ms == pytest.approx(overlapped, rel=1e-12)
        assert est.overflow() is None
    # rank 1 holds 81 GB of an 80 GB GPU while rank 0 has room to spare
    est = _estimate(cluster, 1.0, colls, {0: GB, 1: 81 * GB})
    assert est.overflow() == f"rank 1 needs {81 * GB} bytes of HBM (dense 0 + tables {81 * GB}); it has {80 * GB}"


def test_search_replans_a_layout_whose_dense_part_leaves_no_room_for_the_shared_tables():
    """gem_tiny on 2 x 2 ranks, embedding groups of 2, table-wise: HBM 400 kB above the heaviest dense part (full
    replication). The shared plan keeps HBM for the lightest dense part and puts the 640 kB item table on a GPU; the
    heavier layouts overflow it there and must be planned again (the item table in host memory) or left out."""
    from gem.cli.plan import compose
    from gem.plan.estimate import PlanOptions, ref_rate
    from gem.plan.search import search

    cfgs = compose(["parallel=full_5d", "parallel.sharding_types=[table_wise]"])
    roomy = ClusterSpec(hosts=2, gpus_per_host=2, hbm_gb=80, ddr_gb=64, intra_gbps=100, inter_gbps=10)
    options = PlanOptions(emb_groups=(2,), sync_every=(1,), top=100)
    rate = ref_rate(cfgs, 100.0)
    dense = {(e.par.dp_shard, e.par.ep): e.dense.total for e in search(cfgs, roomy, rate, options).fits}
    assert len(dense) == 6  # dp_shard 1, 2, 4 with every ep that divides it and the 4 experts
    heaviest = max(dense, key=dense.get)
    assert heaviest == (1, 1) and dense[heaviest] - min(dense.values()) > 640_000
    tight = ClusterSpec(hosts=2, gpus_per_host=2, hbm_gb=(dense[heaviest] + 400_000) / 1e9, ddr_gb=64,
                        intra_gbps=100, inter_gbps=10)
    res = search(cfgs, tight, rate, options)
    assert {(e.par.dp_shard, e.par.ep) for e in res.fits} | {(p.dp_shard, p.ep) for p, _ in res.rejected} == set(dense)
    for e in res.fits:
        assert max(e.hbm.values()) <= tight.hbm_bytes, (e.par, e.hbm)
    heavy = next(e for e in res.fits if (e.par.dp_shard, e.par.ep) == heaviest)
    assert sorted(heavy.ddr.values()) == [0, 10000 * 16 * 4]  # the item table's fp32 rows, in host memory


@pytest.mark.parametrize("opt, state", [("sgd", (0, 0)), ("rowwise_adagrad", (30, 30)), ("adagrad", (240, 200)),
                                        ("adam", (480, 400))])
def test_replica_sync_carries_the_fullest_ranks_weights_and_optimizer_state(opt, state):
    """Two replicas of a group of 2: rank 0 holds 30 rows of 8 columns, rank 1 20 rows of 8 and 10 rows of 4.
    `state`: each rank's fused optimizer state, by hand: none (sgd), one value per row (row-wise Adagrad), one per
    element (Adagrad), two per element (Adam's two moments). Synced in fp32 every 4 steps: per step, a quarter of
    the fullest rank's weights and state x 4 bytes."""
    tables = [TableShards("a", "bag", 50, 8, ["a"], "row_wise", [(0, 30, 8), (1, 20, 8)]),
              TableShards("b", "bag", 10, 4, ["b"], "table_wise", [(1, 10, 4)])]
    rank0, rank1 = 30 * 8 + state[0], 20 * 8 + 10 * 4 + state[1]
    (c,) = comm.replica_sync_collectives(tables, {"emb_replicate": (0, 2)}, opt, 4)
    assert (c.op, c.ranks, c.bytes) == (ALL_REDUCE, (0, 2), 4.0 * max(rank0, rank1) / 4)
    assert comm.replica_sync_collectives(tables, {"emb_replicate": (0,)}, opt, 4) == []
