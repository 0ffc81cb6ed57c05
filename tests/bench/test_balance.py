"""data.balance measured (gem.bench.balance): the one-device rehearsal of W ranks on the tiny CPU model, and the
simulated table."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from gem.bench.balance import Rehearsal, build_trainer, rehearse, shares, simulate_main
from gem.data.balance import concat_batches
from gem.model.flops import train_flops

TINY = ["experiment=tiny_cpu", "model.kernel=reference", "data.batch_size=6", "data.histories.events.max_len=48",
        "data.histories.events.distribution=zipf", "data.eval_batches=0"]


def _rows(batch) -> list[tuple]:
    """Each example as a comparable tuple (dense features, labels, history length): the multiset of examples."""
    L = batch.seq_lengths.tolist()
    return sorted((*batch.dense[i].tolist(), *batch.labels[i].tolist(), L[i]) for i in range(batch.batch_size))


@pytest.fixture(scope="module")
def trainer():
    t = build_trainer(TINY)
    yield t
    t.close()


def test_shares_hold_the_same_examples_and_balance_the_cost(trainer):
    world = 3
    for index in (0, 4):
        s = shares(trainer, world, index)
        assert [b.batch_size for b in s["none"]] == [6] * world == [b.batch_size for b in s["cost"]]
        assert _rows(concat_batches(s["none"])) == _rows(concat_batches(s["cost"]))
        cost = [train_flops(trainer.cfgs.model, b.history_offsets) for b in s["cost"]]
        none = [train_flops(trainer.cfgs.model, b.history_offsets) for b in s["none"]]
        assert max(cost) <= max(none) and sum(cost) == pytest.approx(sum(none), rel=1e-12)
    # the drawn shares are the ranks' own batches of a balance=none run
    from gem.data import SyntheticDataset

    d = trainer.cfgs.data
    rank1 = SyntheticDataset(d.schema, d.seed, d.batch_size, rank=1, world_size=world).batch(4)
    assert torch.equal(shares(trainer, world, 4)["none"][1].dense, rank1.dense)


def test_rehearse_times_every_share_and_trains(trainer):
    before = [p.detach().clone() for p in trainer.par.dense_parameters()]
    r = rehearse(trainer, world=2, batches=2, warmup=1)
    assert {m: len(v) for m, v in r.share_ms.items()} == {"none": 2, "cost": 2}
    assert all(len(s) == 2 and min(s) > 0 for v in r.share_ms.values() for s in v)
    assert any(not torch.equal(a, b.detach()) for a, b in zip(before, trainer.par.dense_parameters()))


def test_each_share_counts_its_fastest_repeat(trainer, monkeypatch):
    import gem.bench.balance as bb

    calls = []

    def fake(tr, batch, step):  # a share's first step is slow (compiling), its repeats fast
        calls.append((batch.batch_size, step))
        return 100.0 + step if len(calls) % 3 == 1 else float(step)

    monkeypatch.setattr(bb, "_timed_step", fake)
    r = rehearse(trainer, world=2, batches=1, warmup=1, repeats=3)
    assert [s for _, s in calls] == list(range(1, 2 * 2 * 2 * 3 + 1))  # (warmup + batches) x modes x world x repeats
    # measured batch 1 runs cost first (modes alternate); each share's repeats are steps 3k+1..3k+3, fastest 3k+2
    assert r.share_ms == {"cost": [[14.0, 17.0]], "none": [[20.0, 23.0]]}


def test_summary_is_the_slowest_share():
    r = Rehearsal(2, {"none": [[3.0, 1.0], [5.0, 4.0]], "cost": [[2.0, 2.5], [4.0, 4.5]]})
    s = r.summary()
    assert s["step_ms_none"] == 4.0 and s["step_ms_cost"] == 3.5
    assert s["even_ms_none"] == np.mean([2.0, 4.5]) and s["speedup"] == pytest.approx(4.0 / 3.5)


def test_simulated_table(capsys):
    assert simulate_main(["--batches", "3", "--worlds", "2,4", "tiny_cpu"]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert lines[0].startswith("| experiment | per-rank batch | W |") and len(lines) == 4
    rows = [ln.strip("|").split("|") for ln in lines[2:]]
    assert [(r[0].strip(), int(r[2]), int(r[3])) for r in rows] == [("tiny_cpu", 2, 256), ("tiny_cpu", 4, 512)]
    # each row recomputed from its definition: the same draws, per-rank FLOPs summed as drawn and as partitioned
    from gem.bench.balance import typed_configs
    from gem.data.balance import partition
    from gem.data.synthetic import sample_lengths
    from gem.model.flops import example_flops

    cfgs = typed_configs(["experiment=tiny_cpu"])
    b, schema = cfgs.data.batch_size, cfgs.data.schema
    for r, w in zip(rows, (2, 4)):
        gen = torch.Generator().manual_seed(0)
        lengths = {h.name: sample_lengths(h, 3 * w * b, gen) for h in schema.histories}
        costs = example_flops(cfgs.model, lengths).numpy().reshape(3, w * b)
        mean = costs.sum() / 3 / w
        none = np.mean([c.reshape(w, b).sum(1).max() for c in costs]) / mean
        cost = np.mean([np.bincount(partition(c, w), weights=c, minlength=w).max() for c in costs]) / mean
        assert float(r[4]) == pytest.approx(none, abs=6e-4) and float(r[5]) == pytest.approx(cost, abs=6e-5)
        assert cost < none
    assert simulate_main(["--worlds", "2", "no_such_preset"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("balance_sim: error: ") and "no_such_preset" in err and "\n" not in err
