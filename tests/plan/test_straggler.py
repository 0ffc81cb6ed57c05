"""gem plan's straggler factor (gem/plan/straggler.py) against expectations worked out by hand."""

from __future__ import annotations

import itertools

import pytest
import torch

from gem.cli.plan import compose, format_report
from gem.model.flops import example_flops
from gem.plan.estimate import estimate, ref_rate, workload
from gem.plan.straggler import Straggler, simulate
from gem.plan.topology import ClusterSpec

# lengths 0 or 1, each with probability 1/2 (uniform law, sparsity 0.5 on max_len 1)
TWO_LENGTHS = ["data.histories.events.max_len=1", "data.histories.events.min_len=0",
               "data.histories.events.distribution=uniform", "data.histories.events.sparsity=0.5"]


@pytest.fixture(scope="module")
def two_lengths():
    cfgs = compose(TWO_LENGTHS)
    c0, c1 = example_flops(cfgs.model, {"events": torch.tensor([0, 1])}).tolist()
    assert c1 > c0 > 0
    return cfgs, c0, c1


def _expected(c0: float, c1: float, batch: int) -> Straggler:
    """Two ranks: E[max] / E[mean] by enumerating every draw of the 2 x batch lengths; balanced = the best
    equal-count split of each draw."""
    world, n = 2, 2 * batch
    max_none = max_best = 0.0
    for draw in itertools.product((c0, c1), repeat=n):
        ranks = [sum(draw[r * batch:(r + 1) * batch]) for r in range(world)]
        max_none += max(ranks)
        ones = sum(x == c1 for x in draw)  # equal counts: spread the long ones as evenly as the counts allow
        best = min(max(k * c1 + (batch - k) * c0, (ones - k) * c1 + (batch - ones + k) * c0)
                   for k in range(max(0, ones - batch), min(batch, ones) + 1))
        max_best += best
    mean = (c0 + c1) / 2 * batch
    return Straggler(none=max_none / 2**n / mean, cost=max_best / 2**n / mean)


@pytest.mark.parametrize("batch", [1, 2, 3])
def test_straggler_factor_by_hand(two_lengths, batch):
    cfgs, c0, c1 = two_lengths
    got = simulate(cfgs.model, cfgs.data.schema, batch, 2, batches=6000, seed=1)
    want = _expected(c0, c1, batch)
    assert got.none == pytest.approx(want.none, rel=0.01)
    assert got.cost == pytest.approx(want.cost, rel=0.01)
    if batch == 1:  # one example per rank: nothing to balance; E[max] = c0/4 + 3 c1/4
        assert want.cost == want.none == pytest.approx((c0 + 3 * c1) / 2 / (c0 + c1))
    else:
        assert want.cost < want.none


@pytest.mark.parametrize("form", ["interaction", "targets", "rows"])
def test_candidate_counts_make_stragglers(form):
    """Histories of one fixed length, 1 or 2 candidates per request (each with probability 1/2): the counts alone
    spread the ranks' costs, as two lengths do above."""
    cfgs = compose(["data.histories.events.max_len=3", "data.histories.events.min_len=3",
                    "data.histories.events.distribution=uniform", "data.max_candidates=2", f"model.candidates={form}"])
    c1, c2 = example_flops(cfgs.model, {"events": torch.tensor([3, 3])}, torch.tensor([1, 2])).tolist()
    assert c2 > c1 > 0
    got = simulate(cfgs.model, cfgs.data.schema, 2, 2, batches=6000, seed=1, max_candidates=2)
    want = _expected(c1, c2, 2)
    assert got.none == pytest.approx(want.none, rel=0.01)
    assert got.cost == pytest.approx(want.cost, rel=0.01)
    assert got.cost < got.none


def test_one_rank_has_no_straggler(two_lengths):
    cfgs, _, _ = two_lengths
    assert simulate(cfgs.model, cfgs.data.schema, 4, 1) == Straggler(1.0, 1.0)


@pytest.mark.parametrize("balance", ["none", "cost"])
def test_plan_folds_the_factor_into_compute(balance):
    cfgs = compose(["data.histories.events.distribution=zipf", "data.histories.events.alpha=1.1",
                    f"data.balance={balance}"])
    cluster = ClusterSpec(hosts=1, gpus_per_host=8, hbm_gb=80, ddr_gb=64)
    par = cfgs.parallel
    from gem.parallel.dims import validate

    par = validate(par, cluster.world)
    rate = ref_rate(compose([]), 100.0)
    work = workload(cfgs, 0, cluster.world, 32)
    s = work.straggler
    assert s.none > 1.05 and 1.0 <= s.cost < s.none  # a heavy tail on 8 ranks: balancing helps
    est = estimate(cfgs, par, cluster, rate, work=work)
    assert est.compute_ms == pytest.approx(work.flops / rate * (s.cost if balance == "cost" else s.none), rel=1e-12)
    report = format_report(est, cfgs)
    assert f"{s.none:.3f} as drawn, {s.cost:.3f} with data.balance=cost" in report
    assert f"(data.balance={balance})" in report
