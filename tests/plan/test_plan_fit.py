"""`gem plan`'s do-not-fit errors: tables that no placement fits, and tables in host memory beyond a rank's share.

gem_tiny on 2 x 2 ranks: the dense part needs ~14.4 MB per rank and the tables 1.29 MB per sharding group of 2; at
14.6 MB of HBM per GPU they only fit with UVM (host-memory) kernels.
"""

from __future__ import annotations

import pytest

from gem.parallel.dims import validate
from gem.cli.plan import compose, main
from gem.plan.estimate import estimate, ref_rate
from gem.plan.topology import ClusterSpec, PlanError

LAYOUT = ["parallel=full_5d", "parallel.emb_sync_every=2", "parallel.sharding_types=[table_wise]"]
TIGHT = {"hosts": 2, "gpus_per_host": 2, "hbm_gb": 0.0146}


@pytest.fixture(scope="module")
def cfgs():
    return compose(LAYOUT)


def test_tables_that_fit_nowhere_are_one_line(capsys):
    args = [f"topology.{k}={v}" for k, v in TIGHT.items()] + ["topology.ddr_gb=0", *LAYOUT]
    assert main(args) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1, err
    assert err[0].startswith("gem-plan: error: embedding tables do not fit: torchrec's planner found no placement on "
                             "rank 0's sharding group (ranks 0-1) for 1285056 bytes of table weights"), err[0]


def test_tables_in_host_memory_beyond_a_ranks_share(cfgs):
    par = validate(cfgs.parallel, 4)
    rate = ref_rate(cfgs, 100.0)
    roomy = estimate(cfgs, par, ClusterSpec(**TIGHT, ddr_gb=64), rate)
    assert min(roomy.ddr.values()) > 0, roomy.ddr  # the big tables went to host memory (UVM kernels)
    assert any("uvm" in k for k in roomy.emb.kernels.values()), roomy.emb.kernels
    need = max(roomy.ddr.values())
    small = ClusterSpec(**TIGHT, ddr_gb=2 * (need - 1) / 1e9)  # a rank's share: one byte short
    with pytest.raises(PlanError) as e:
        estimate(cfgs, par, small, rate, emb=roomy.emb)
    assert str(e.value) == (f"rank {max(roomy.ddr, key=roomy.ddr.get)} needs {need} bytes of host memory for tables; "
                            f"it has {small.ddr_bytes_per_rank}")
    fits = ClusterSpec(**TIGHT, ddr_gb=2 * need / 1e9)
    assert estimate(cfgs, par, fits, rate, emb=roomy.emb).overflow() is None
