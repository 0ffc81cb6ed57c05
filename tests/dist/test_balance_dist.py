"""data.balance=cost on 2 and 4 gloo ranks trains exactly like one rank on the same global batches (synthetic and
Parquet), and a run resumed from a checkpoint continues with the same losses (tests/dist/run_balance.py)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from gem.data import SyntheticDataset
from gem.data.parquet import write_parquet
from tests.dist._common import ROOT, torchrun
from tests.train._util import env

LOSS_ATOL = 2e-5  # fp32, other reduction orders, 20 steps


@pytest.fixture(scope="module")
def parquet_file(tmp_path_factory):
    from omegaconf import OmegaConf

    from gem.data import DataConfig

    c = OmegaConf.to_container(OmegaConf.load(ROOT / "configs/data/synthetic.yaml"))
    c["histories"]["events"].update(max_len=32, distribution="zipf")
    schema = DataConfig.from_dict(c).schema
    path = tmp_path_factory.mktemp("balance_pq") / "train.parquet"
    write_parquet(SyntheticDataset(schema, seed=5, batch_size=16), str(path), 21)
    return str(path)


@pytest.fixture(scope="module")
def reference(tmp_path_factory, parquet_file):
    d = tmp_path_factory.mktemp("balance_ref")
    out = d / "ref.json"
    r = subprocess.run([sys.executable, str(ROOT / "tests/dist/run_balance.py"), "--out", str(out), "--dir", str(d),
                        "--parquet", parquet_file, "--reference", "2", "4"],
                       env=env(d), capture_output=True, text=True, timeout=600, cwd=str(d), check=False)
    assert r.returncode == 0, r.stderr[-6000:]
    return json.loads(out.read_text())


@pytest.mark.parametrize("world", [2, 4])
def test_balanced_ranks_equal_one_rank_and_resume(tmp_path, reference, parquet_file, world):
    got = torchrun("run_balance.py", world, ["--dir", str(tmp_path), "--parquet", parquet_file], tmp_path, timeout=600)
    assert got["synthetic"] == pytest.approx(reference[f"synthetic_{world}"], abs=LOSS_ATOL, rel=0)
    # stopped at step 10 with a checkpoint, resumed in a new process group's trainer to step 20
    assert got["parquet_resumed"] == pytest.approx(reference["parquet"], abs=LOSS_ATOL, rel=0)
    for losses in (got["synthetic"], got["parquet_resumed"]):
        assert len(losses) == 20 and abs(losses[-1] - losses[0]) > 1e-2  # it trained
    # logged every 5 steps: the window's mean of max / mean of the ranks' step FLOPs
    assert got["imbalance"] == pytest.approx(got["imbalance_expected"], rel=1e-9)
    assert len(got["imbalance"]) == 4 and all(x >= 1.0 for x in got["imbalance"])
