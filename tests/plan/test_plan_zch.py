"""gem plan with a `hash: zch` table: row-wise over the whole sharding group, its id maps counted in HBM, and
layouts with embedding replicas refused (one line) or left out of the search."""

from __future__ import annotations

from gem.cli.plan import compose, main
from gem.plan.sharding import plan_embeddings, zch_bytes_per_row
from gem.plan.topology import ClusterSpec

CLUSTER = ClusterSpec(hosts=1, gpus_per_host=2, hbm_gb=80, ddr_gb=64, intra_gbps=100, inter_gbps=10)
ZCH = ["+data.tables.item.ids=raw", "+data.tables.item.hash=zch"]


def test_id_maps_are_counted_beside_the_rows():
    zch = compose(ZCH)
    plain = compose(["+parallel.sharding_types={item: [row_wise]}"])  # the same placement, no id maps
    a = plan_embeddings(zch.model, CLUSTER, 2, 128)
    b = plan_embeddings(plain.model, CLUSTER, 2, 128, plain.parallel.sharding_types)
    assert {so_table for mp in a.plan.plan.values() for so_table, ps in mp.items()
            if ps.sharding_type == "row_wise"} >= {"item"}
    per_rank = 10000 // 2 * zch_bytes_per_row("distance_lfu")  # item: 10000 rows, 32 bytes each
    assert zch_bytes_per_row("distance_lfu") == 32 and zch_bytes_per_row("lru") == zch_bytes_per_row("lfu") == 24
    assert a.zch == {0: per_rank, 1: per_rank}
    assert {r: a.hbm[r] - b.hbm[r] for r in a.hbm} == a.zch


def test_layouts_with_replicas_are_refused_or_skipped(capsys):
    from gem.plan.estimate import PlanOptions
    from gem.plan.search import candidate_layouts

    base = ["topology.hosts=1", "topology.gpus_per_host=2", "topology.hbm_gb=80", *ZCH]
    assert main([*base, "parallel.emb_shard_group=1"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("gem-plan: error: parallel.emb_shard_group: hash: zch tables (item) are sharded over every "
                          "rank") and "\n" not in err
    # --search on 2 hosts of 1 GPU tries groups of 1 and 2 ranks; with a zch table only the group of 2
    two_hosts = ClusterSpec(hosts=2, gpus_per_host=1, hbm_gb=80)
    assert {p.emb_shard_group for p in candidate_layouts(compose([]), two_hosts, PlanOptions())} == {1, 2}
    assert {p.emb_shard_group for p in candidate_layouts(compose(ZCH), two_hosts, PlanOptions())} == {2}
