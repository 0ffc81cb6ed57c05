"""`gem plan`'s do-not-fit errors: tables that no placement fits, and tables in host memory beyond a rank's share.

gem_tiny on 2 x 2 ranks: the dense part needs ~14.45 MB per rank and the tables 645 kB per sharding group of 2 (the
item table, which the history and the candidate share, 640 kB of it); at 14.6 MB of HBM per GPU the item table only
fits with a UVM (host-memory) kernel.
"""

from __future__ import annotations

import re

import pytest

from gem.cli.plan import compose, main
from gem.parallel.dims import validate
from gem.plan.estimate import estimate, ref_rate
from gem.plan.topology import ClusterSpec, PlanError

LAYOUT = ["parallel=full_5d", "parallel.emb_sync_every=2", "parallel.sharding_types=[table_wise]"]
TIGHT = {"hosts": 2, "gpus_per_host": 2, "hbm_gb": 0.0146}
# fp32 rows: item 10000 x 16, action 4 x 16, user_segment 100 x 8, context 50 x 8
ITEM_BYTES = 10000 * 16 * 4
TABLE_BYTES = ITEM_BYTES + (4 * 16 + 100 * 8 + 50 * 8) * 4


@pytest.fixture(scope="module")
def cfgs():
    return compose(LAYOUT)


def test_tables_that_fit_nowhere_are_one_line(capsys):
    args = [f"topology.{k}={v}" for k, v in TIGHT.items()] + ["topology.ddr_gb=0", *LAYOUT]
    assert main(args) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1, err
    m = re.fullmatch(r"gem-plan: error: embedding tables do not fit: torchrec's planner found no placement on rank "
                     rf"0's sharding group \(ranks 0-1\) for {TABLE_BYTES} bytes of table weights; it has (\d+) bytes of "
                     r"HBM \+ DDR left after (\d+) bytes of dense state per rank \(PlannerError\)", err[0])
    assert m, err[0]
    have, dense = int(m[1]), int(m[2])
    # no DDR: what is left is the two ranks' HBM beyond the dense state, too little for the item table
    assert have == 2 * (int(TIGHT["hbm_gb"] * 1e9) - dense) and 0 < have < ITEM_BYTES, (have, dense)


def test_tables_in_host_memory_beyond_a_ranks_share(cfgs):
    par = validate(cfgs.parallel, 4)
    rate = ref_rate(cfgs, 100.0)
    roomy = estimate(cfgs, par, ClusterSpec(**TIGHT, ddr_gb=64), rate)
    # the item table went to host memory (a UVM kernel) on one rank of the sharding group; the small ones stay in HBM
    assert sorted(roomy.ddr.values()) == [0, ITEM_BYTES], roomy.ddr
    assert {t: "uvm" in k for t, k in roomy.emb.kernels.items()} == {
        "item": True, "action": False, "user_segment": False, "context": False}, roomy.emb.kernels
    need = max(roomy.ddr.values())
    small = ClusterSpec(**TIGHT, ddr_gb=2 * (need - 1) / 1e9)  # a rank's share: one byte short
    with pytest.raises(PlanError) as e:
        estimate(cfgs, par, small, rate, emb=roomy.emb)
    assert str(e.value) == (f"rank {max(roomy.ddr, key=roomy.ddr.get)} needs {need} bytes of host memory for tables; "
                            f"it has {small.ddr_bytes_per_rank}")
    fits = ClusterSpec(**TIGHT, ddr_gb=2 * need / 1e9)
    assert estimate(cfgs, par, fits, rate, emb=roomy.emb).overflow() is None
