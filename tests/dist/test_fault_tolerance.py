"""Fault tolerance: a rank killed mid-run under `torchrun --max-restarts=1` comes back in the same run dir, resumes
from the last checkpoint (`train.resume=auto`) and logs the same per-step losses as an uninterrupted run."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from tests.train._util import SMALL, compose, env, read_jsonl

STEPS, EVERY, FAULT_STEP, FAULT_RANK = 24, 8, 13, 1
ARGS = [
    "experiment=tiny_cpu",
    *SMALL,
    "data.batch_size=16",
    "data.eval_batches=1",
    f"train.steps={STEPS}",
    f"train.checkpoint.every={EVERY}",
    "train.eval_every=0",
    "train.log_every=1",
]


def _torchrun(tmp_path: Path, args: list[str], entry: list[str] | None = None) -> subprocess.CompletedProcess:
    """`entry`: what torchrun runs (default `-m gem.train`)."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", "--max-restarts=1"]
    e = env(tmp_path)  # TMPDIR inside tmp_path, OMP_NUM_THREADS=1, gloo on loopback
    for k in ("TORCHELASTIC_RESTART_COUNT", "TORCHELASTIC_RUN_ID"):
        e.pop(k, None)
    return subprocess.run(
        [*cmd, *(entry or ["-m", "gem.train"]), *ARGS, *args],
        cwd=tmp_path,
        env=e,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )


def _loss_records(run_dir: Path) -> list[dict]:
    return [r for r in read_jsonl(run_dir / "metrics.jsonl") if "train/loss" in r]


def test_killed_rank_restarts_and_resumes_the_same_trajectory(tmp_path):
    ref = _torchrun(tmp_path, ["hydra.run.dir=ref"])
    assert ref.returncode == 0, ref.stderr[-4000:]
    straight = {r["step"]: r["train/loss"] for r in _loss_records(tmp_path / "ref")}
    assert sorted(straight) == list(range(1, STEPS + 1))
    assert max(straight.values()) - min(straight.values()) > 1e-3  # the loss moves, so equality means something

    # The default run dir (outputs/<GEM_RUN_ID>): the restarted attempt must find the first attempt's.
    # gem.train with a hook that kills rank FAULT_RANK after step FAULT_STEP of the first attempt
    faulty = [
        str(Path(__file__).with_name("run_faulty_train.py")),
        f"--fault-step={FAULT_STEP}",
        f"--fault-rank={FAULT_RANK}",
    ]
    faulted = _torchrun(tmp_path, [], faulty)
    out = faulted.stdout + faulted.stderr
    assert faulted.returncode == 0, out[-6000:]
    assert f"rank {FAULT_RANK} exits after step {FAULT_STEP}" in out, out[-6000:]  # the fault did happen
    runs = sorted(p.parent for p in (tmp_path / "outputs").rglob("metrics.jsonl"))
    assert len(runs) == 1, runs  # both attempts wrote to one run dir
    run = runs[0]
    resumed = [ln for ln in out.splitlines() if "resumed from" in ln]
    assert len(resumed) == 1 and str(run / "checkpoints" / f"step_{EVERY}") in resumed[0], out[-6000:]
    assert "torchrun restart 1" in resumed[0]

    steps = [r["step"] for r in _loss_records(run)]
    # the second attempt redid steps EVERY+1..13 and dropped their first records: each step is logged once
    assert steps == list(range(1, STEPS + 1)), steps
    final = {r["step"]: r["train/loss"] for r in _loss_records(run)}
    for s in range(1, STEPS + 1):
        assert final[s] == pytest.approx(straight[s], abs=1e-6), s
    ckpts = sorted(p.name for p in (run / "checkpoints").iterdir())
    assert ckpts == [f"step_{STEPS - EVERY}", f"step_{STEPS}"], ckpts


@pytest.fixture
def own_process_group():
    """The Trainer creates a one-rank group in this process: destroy it after, so later tests that fork workers
    do not inherit it."""
    import torch.distributed as dist

    yield
    if dist.is_initialized():
        dist.destroy_process_group()


def test_resume_auto_starts_fresh_in_a_new_run_dir_and_continues_in_an_old_one(tmp_path, own_process_group):
    from gem.train.trainer import Trainer

    base = [*SMALL, "train.steps=6", "train.eval_every=0", "data.batch_size=8"]

    def trainer(run_dir, *extra):
        return Trainer(compose([*base, *extra]), run_dir=str(run_dir) if run_dir else None)

    t = trainer(tmp_path / "a", "train.stop_at_step=2", "train.checkpoint.every=2")
    assert t.tcfg.resume == "auto" and t.step == 0  # the default; a new run dir starts fresh
    t.fit()
    t.close()
    for resume, step in (("auto", 2), ("true", 2), ("false", 0)):
        t = trainer(tmp_path / "a", f"train.resume={resume}")
        assert t.step == step, resume
        t.close()
    trainer(None).close()  # auto needs no run dir
    with pytest.raises(ValueError, match="train.checkpoint.dir"):
        trainer(None, "train.resume=true")


@pytest.mark.parametrize("value", ["maybe", "1", "null"])
def test_bad_resume_value_names_the_key(tmp_path, monkeypatch, capsys, value):
    from gem.train.__main__ import main

    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    assert main(["train.steps=20", f"train.resume={value}"]) == 2
    lines = [ln for ln in capsys.readouterr().err.splitlines() if ln.strip()]
    assert len(lines) == 1 and "train.resume" in lines[0] and "true, false or auto" in lines[0], lines
