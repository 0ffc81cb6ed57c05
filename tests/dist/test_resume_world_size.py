"""The Trainer resumes a checkpoint at another world size (2 -> 1 and 1 -> 2 ranks) at the right data position,
and its first step after resuming equals the run that never stopped on the same batch.

Synthetic stream: rank r of W trains on global batches r, r + W, ... (data.batch_size rows each), so a checkpoint
after k steps at world W has consumed k * W global batches, and a world W' resumes rank r at global batch
k * W + r. The loss of that first step (the checkpointed model on that batch) is the never-stopped run's loss on the
same batch: 2 -> 1: rank 0 of the 2-rank run at step k + 1 (global batch 2k); 1 -> 2: the 1-rank run at step k + 1
(global batch k) for rank 0.
"""

from __future__ import annotations

import json
import shutil

import pytest

from tests.dist._common import torchrun
from tests.dist.run_resume import run_job
from tests.train._util import SMALL

pytestmark = pytest.mark.slow

K, STEPS, BATCH = 2, 4, 8
# data.balance=none: each rank trains the stream's own batches, so a step's batch is known by its global index
# (balanced shares resume at the same position: tests/dist/test_balance_dist.py)
COMMON = SMALL + ["data.batch_size=8", "data.eval_batches=0", "train.eval_every=0", f"train.steps={STEPS}",
                  "train.checkpoint.every=2", "train.checkpoint.keep=3", "train.seed=5", "data.balance=none"]


def _global_rows(gs: list[int]) -> list[list[float]]:
    """The first dense row of global batches `gs` of the synthetic stream the jobs train on."""
    from gem.data import SyntheticDataset
    from gem.train.trainer import build_configs
    from tests.train._util import compose

    data = build_configs(compose(COMMON)).data
    ds = SyntheticDataset(data.schema, data.seed, BATCH)
    return [ds.global_batch(g).dense[0].tolist() for g in gs]


def test_resume_at_another_world_size(tmp_path, process_group):
    one, two = tmp_path / "one", tmp_path / "two"
    # the 1-rank run that never stops (checkpoints at steps 2 and 4)
    ref1 = run_job(COMMON, str(one))
    shutil.rmtree(one / "checkpoints" / f"step_{STEPS}")  # as if it had stopped after step K
    jobs = [{"run_dir": str(one), "overrides": COMMON + ["train.resume=true"]},  # 1 -> 2
            {"run_dir": str(two), "overrides": COMMON}]  # the 2-rank run that never stops
    resumed2, ref2 = torchrun("run_resume.py", 2, ["--jobs", json.dumps(jobs)], tmp_path, timeout=300)
    shutil.rmtree(two / "checkpoints" / f"step_{STEPS}")
    resumed1 = run_job(COMMON + ["train.resume=true"], str(two))  # 2 -> 1

    # the runs trained, and every step's batch was the stream's
    assert ref1["rows"] == _global_rows(list(range(STEPS)))
    assert ref2[1]["rows"] == _global_rows([1, 3, 5, 7])
    assert max(ref1["losses"]) - min(ref1["losses"]) > 1e-3

    # 1 -> 2: K global batches done; rank r goes on at global batch K + r, then K + 2 + r
    for r in (0, 1):
        assert resumed2[r]["first_step"] == K and resumed2[r]["position"] == K // 2
        assert resumed2[r]["rows"] == _global_rows([K + r, K + 2 + r]), r
    assert resumed2[0]["losses"][0] == pytest.approx(ref1["losses"][K], abs=1e-5, rel=0)

    # 2 -> 1: 2K global batches done; the single rank goes on at global batch 2K
    assert resumed1["first_step"] == K and resumed1["position"] == 2 * K
    assert resumed1["rows"] == _global_rows([2 * K, 2 * K + 1])
    assert resumed1["losses"][0] == pytest.approx(ref2[0]["losses"][K], abs=1e-5, rel=0)
