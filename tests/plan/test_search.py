"""gem plan --search on a 2 x 2 topology with gem_tiny: every allowed layout is tried, the ones that fit are ranked
by estimated step time, and the printed overrides give back the same layout."""

from __future__ import annotations

import dataclasses

import pytest

from gem.cli.plan import compose, main
from gem.parallel.dims import validate
from gem.plan.estimate import PlanOptions, estimate, ref_rate
from gem.plan.search import search
from gem.plan.topology import ClusterSpec, PlanError

BASE = ["parallel=full_5d", "parallel.sharding_types=[table_wise]"]


def _cluster(hbm_gb: float) -> ClusterSpec:
    return ClusterSpec(hosts=2, gpus_per_host=2, hbm_gb=hbm_gb, ddr_gb=64, intra_gbps=100, inter_gbps=10)


@pytest.fixture(scope="module")
def cfgs():
    return compose(BASE)


def _layouts_by_hand() -> set[tuple[int, int, int, int, int]]:
    # world 4: dp_shard in {1, 2, 4}; ep divides dp_shard and the 4 experts; embedding groups of 2 (two groups:
    # sync every 1, 2, 4, 8 or 16 steps) or 4 (one group)
    out = set()
    for shard in (1, 2, 4):
        for ep in (e for e in (1, 2, 4) if shard % e == 0):
            out |= {(4 // shard, shard, ep, 2, k) for k in (1, 2, 4, 8, 16)} | {(4 // shard, shard, ep, 4, 1)}
    return out


def _key(p) -> tuple[int, int, int, int, int]:
    return p.dp_replicate, p.dp_shard, p.ep, p.emb_shard_group, p.emb_sync_every


def test_search_ranks_every_layout_that_fits(cfgs):
    cluster = _cluster(80)
    rate = ref_rate(cfgs, 100.0)
    res = search(cfgs, cluster, rate, PlanOptions())
    assert not res.rejected
    assert {_key(e.par) for e in res.fits} == _layouts_by_hand()
    steps = [e.step_ms for e in res.fits]
    assert steps == sorted(steps)
    # the winner's figures are those of a plain plan of its layout
    best = res.fits[0]
    again = estimate(cfgs, best.par, cluster, rate)
    assert again.step_ms == pytest.approx(best.step_ms, rel=1e-12)
    assert again.hbm == best.hbm
    # more replicas synced more often cost more: for one dense layout, sync every step is the slowest 2-group one
    same = [e for e in res.fits if _key(e.par)[:3] == _key(best.par)[:3] and e.par.emb_shard_group == 2]
    assert max(same, key=lambda e: e.step_ms).par.emb_sync_every == 1


def test_printed_overrides_give_back_the_layout(capsys):
    # a setting of the user's survives; a layout key the search chooses is replaced
    user = [*BASE, "train.param_dtype=bf16", "parallel.dp_replicate=4"]
    args = ["topology.hosts=2", "topology.gpus_per_host=2", "topology.hbm_gb=80", "plan.top=3", *user]
    assert main(["--search", *args]) == 0
    out = capsys.readouterr().out
    lines = [ln.split(": ", 1)[1] for ln in out.splitlines() if ln.startswith(("  1: ", "  2: ", "  3: "))]
    assert len(lines) == 3 and "torchrun --nnodes 2 --nproc-per-node 2" in out
    cfgs = compose(user)
    res = search(cfgs, _cluster(80), ref_rate(cfgs, 100.0), PlanOptions())
    for line, est in zip(lines, res.fits):
        assert "train.param_dtype=bf16" in line
        assert sum(w.startswith("parallel.dp_replicate=") for w in line.split()) == 1
        back_cfgs = compose(line.split())
        assert back_cfgs.train.param_dtype == "bf16"
        back = validate(back_cfgs.parallel, 4)
        assert dataclasses.replace(back, sharding_types=None) == dataclasses.replace(est.par, sharding_types=None)


def test_layouts_that_overflow_are_left_out():
    cfgs = compose([*BASE, "model.tower.d_ff=4096"])  # a dense part that weighs: 16 bytes per parameter
    rate = ref_rate(cfgs, 100.0)
    roomy = search(cfgs, _cluster(80), rate, PlanOptions())
    # HBM between the lightest and the heaviest dense part: the heavy layouts go (tables may move to host memory)
    dense = sorted(e.dense.total for e in roomy.fits)
    cluster = _cluster((dense[0] + dense[-1]) / 2 / 1e9)
    res = search(cfgs, cluster, rate, PlanOptions(top=100))  # every layout that overflows is planned again
    assert res.fits and res.rejected and not res.skipped
    assert all(max(e.hbm.values()) <= cluster.hbm_bytes for e in res.fits)
    assert {_key(e.par) for e in res.fits} | {_key(p) for p, _ in res.rejected} == _layouts_by_hand()
    # with the default top 5, some of those are not planned again: they are slower than the 5th best anyway
    few = search(cfgs, cluster, rate, PlanOptions())
    assert [_key(e.par) for e in few.fits[:5]] == [_key(e.par) for e in res.fits[:5]]
    assert len(few.fits) + len(few.rejected) + len(few.skipped) == len(_layouts_by_hand())
    for p, why in res.rejected:
        assert why.startswith("rank ") and " bytes of HBM" in why
        with pytest.raises(PlanError):
            estimate(cfgs, p, cluster, rate)


def test_no_layout_fits_is_one_line(capsys):
    # HBM for the dense part only and no host memory: the tables fit nowhere
    assert main(["--search", "topology.hosts=2", "topology.gpus_per_host=2", "topology.hbm_gb=0.0106",
                 "topology.ddr_gb=0", *BASE]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("gem-plan: error: no layout fits on 4 ranks of 10600000 bytes")
