"""Fault tolerance: a rank killed mid-run under `torchrun --max-restarts=1` comes back in the same run dir, resumes
from the last checkpoint (`train.resume=auto`) and logs the same per-step losses as an uninterrupted run; a job
signalled between checkpoints (SIGTERM or SIGINT to torchrun, which forwards it to every rank) stops every
rank at one step with a checkpoint of that step, says so in one line, and resumes onto the same losses."""

from __future__ import annotations

import re
import signal
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
    """`entry`: what torchrun runs (default `-m gem.train`); torchrun leads its own process group."""
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
        # a shell without job control starts background jobs with SIGINT ignored; a terminal's job has it
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )


def _loss_records(run_dir: Path) -> list[dict]:
    return [r for r in read_jsonl(run_dir / "metrics.jsonl") if "train/loss" in r]


@pytest.fixture(scope="module")
def straight(tmp_path_factory) -> dict:
    """step -> loss of an uninterrupted run."""
    tmp_path = tmp_path_factory.mktemp("straight")
    ref = _torchrun(tmp_path, ["hydra.run.dir=ref"])
    assert ref.returncode == 0, ref.stderr[-4000:]
    losses = {r["step"]: r["train/loss"] for r in _loss_records(tmp_path / "ref")}
    assert sorted(losses) == list(range(1, STEPS + 1))
    assert max(losses.values()) - min(losses.values()) > 1e-3  # the loss moves, so equality means something
    return losses


def test_killed_rank_restarts_and_resumes_the_same_trajectory(tmp_path, straight):

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


SIGNAL_STEP = 11  # between the checkpoints of steps EVERY and 2 * EVERY


def _signalled(tmp_path: Path, sig: str, to: str, *args: str) -> tuple[subprocess.CompletedProcess, int]:
    """A run signalled after step SIGNAL_STEP; returns it and the step it stopped at (from its one line)."""
    entry = [str(Path(__file__).with_name("run_signal_train.py")), f"--send-step={SIGNAL_STEP}", f"--send={sig}",
             f"--to={to}"]
    p = _torchrun(tmp_path, ["hydra.run.dir=run", *args], entry)
    out = p.stdout + p.stderr
    lines = [ln for ln in out.splitlines() if ln.startswith("gem-train:")]
    assert len(lines) == 1, out[-6000:]
    m = re.fullmatch(rf"gem-train: stopped by {sig} at step (\d+); checkpoint step_(\d+) written; resume with the same "
                     "command", lines[0])
    assert m and m.group(1) == m.group(2), lines
    stop = int(m.group(1))
    assert SIGNAL_STEP < stop < 2 * EVERY, stop  # the next step boundary or the one after, not a periodic save
    assert "KeyboardInterrupt" not in out
    # the only trace is torchrun's own report of the signal it got (its agent re-raises it); the ranks print none
    assert out.count("Traceback") == out.count("torch.distributed.elastic.multiprocessing.api.SignalException"), \
        out[-6000:]
    ckpts = {p.name for p in (tmp_path / "run" / "checkpoints").iterdir()}
    assert ckpts == {f"step_{EVERY}", f"step_{stop}"}, ckpts
    steps = [r["step"] for r in _loss_records(tmp_path / "run")]
    assert steps == list(range(1, stop + 1)), steps  # every step up to the stop logged, once
    return p, stop


def test_sigterm_stops_every_rank_at_one_step_and_resumes_the_same_trajectory(tmp_path, straight):
    """SIGTERM to torchrun (what SLURM and Kubernetes send); it forwards the signal to every rank. Checkpoints are
    written in the background: the resumed losses equal those of the uninterrupted run, which saved inline."""
    _, stop = _signalled(tmp_path, "SIGTERM", "agent", "train.checkpoint.async=true")
    again = _torchrun(tmp_path, ["hydra.run.dir=run"])  # the same command
    assert again.returncode == 0, again.stderr[-4000:]
    resumed = f"resumed from {tmp_path / 'run' / 'checkpoints' / f'step_{stop}'} at step {stop}"
    assert resumed in again.stdout + again.stderr
    final = {r["step"]: r["train/loss"] for r in _loss_records(tmp_path / "run")}
    assert sorted(final) == list(range(1, STEPS + 1))
    for s in range(1, STEPS + 1):
        assert final[s] == pytest.approx(straight[s], abs=1e-6), s


def test_sigint_stops_with_one_line_and_no_traces(tmp_path):
    """Ctrl-C: the terminal's SIGINT reaches torchrun (its ranks run in sessions of their own), which forwards it."""
    _signalled(tmp_path, "SIGINT", "agent")


def test_a_second_signal_during_the_stop_checkpoint_aborts_at_once(tmp_path):
    """One process: SIGUSR1 asks for a stop; SIGTERM while its checkpoint is written ends the process at once, with
    one line, and the checkpoint before it stays the newest complete one."""
    cmd = [sys.executable, str(Path(__file__).with_name("run_signal_train.py")), f"--send-step={SIGNAL_STEP}",
           "--send=SIGUSR1", "--to=self", "--again=SIGTERM", *ARGS, "hydra.run.dir=run"]
    p = subprocess.run(cmd, cwd=tmp_path, env=env(tmp_path), capture_output=True, text=True, timeout=300,
                       check=False)
    lines = [ln for ln in (p.stdout + p.stderr).splitlines() if ln.startswith("gem-train:")]
    assert p.returncode == 128 + signal.SIGTERM, p.stderr[-4000:]
    assert len(lines) == 1 and re.fullmatch(
        r"gem-train: aborted by SIGTERM while writing the checkpoint of step 1[123]; the newest complete checkpoint "
        "before it is kept", lines[0]), lines
    assert "Traceback" not in p.stderr
    ckpts = {p.name for p in (tmp_path / "run" / "checkpoints").iterdir() if not p.name.startswith(".")}
    assert ckpts == {f"step_{EVERY}"}, ckpts


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


def test_resume_skips_a_damaged_newest_checkpoint(tmp_path, own_process_group, caplog):
    import logging

    from gem.train.trainer import Trainer

    base = [*SMALL, "train.steps=6", "train.eval_every=0", "data.batch_size=8", "train.checkpoint.every=2",
            "train.checkpoint.keep=3"]
    t = Trainer(compose([*base, "train.stop_at_step=4"]), run_dir=str(tmp_path))
    t.fit()
    t.close()
    newest = tmp_path / "checkpoints" / "step_4"
    shard = min(newest.glob("*.distcp"))
    shard.write_bytes(shard.read_bytes()[:100])  # a save cut short by a full disk, say
    caplog.set_level(logging.WARNING, logger="gem.train")
    t = Trainer(compose(base), run_dir=str(tmp_path))
    t.close()
    assert t.step == 2
    said = [r.getMessage() for r in caplog.records if r.getMessage().startswith("resume: skipped")]
    assert len(said) == 1 and said[0].startswith(f"resume: skipped step_4: {shard.name}: 100 bytes, the metadata "
                                                 "expects "), said


@pytest.mark.parametrize("value", ["maybe", "1", "null"])
def test_bad_resume_value_names_the_key(tmp_path, monkeypatch, capsys, value):
    from gem.train.__main__ import main

    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    assert main(["train.steps=20", f"train.resume={value}"]) == 2
    lines = [ln for ln in capsys.readouterr().err.splitlines() if ln.strip()]
    assert len(lines) == 1 and "train.resume" in lines[0] and "true, false or auto" in lines[0], lines
