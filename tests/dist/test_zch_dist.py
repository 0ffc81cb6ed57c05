"""A `hash: zch` table on 2 gloo ranks (torchrec's managed-collision sharder, row-wise) trains as 1 rank on the same
global batches: the same losses, every id held by exactly one rank's map, with the embedding the 1-rank run
trained for it (tests/dist/run_zch.py)."""

from __future__ import annotations

import pytest

from tests.dist._common import torchrun


def test_two_ranks_train_as_one(tmp_path):
    (tmp_path / "one").mkdir()
    (tmp_path / "two").mkdir()
    one = torchrun("run_zch.py", 1, [], tmp_path / "one")
    two = torchrun("run_zch.py", 2, [], tmp_path / "two")
    assert one["plan"]["item"] == two["plan"]["item"] == "row_wise"
    assert one["rows"] == 500 and two["rows"] == 250  # each rank's map covers its half of the rows
    assert abs(one["losses"][-1] - one["losses"][0]) > 1e-3
    assert two["losses"] == pytest.approx(one["losses"], abs=2e-6, rel=0)
    assert two["ids"].keys() == one["ids"].keys() and len(one["ids"]) > 50
    assert {rank for rank, _ in two["ids"].values()} == {0, 1}  # the hashed ids spread over both ranks
    for h, (_, emb) in one["ids"].items():
        assert two["ids"][h][1] == pytest.approx(emb, abs=1e-5), h
