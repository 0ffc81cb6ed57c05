"""The entry point as users run it: config errors (one line, exit 2) and short end-to-end runs (1 and 2 ranks)."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from tests.train._util import SMALL, compose, env, read_jsonl, step_losses, train_cmd


def _run(tmp_path: Path, args, nproc: int = 1, timeout: int = 240) -> subprocess.CompletedProcess:
    return subprocess.run(
        train_cmd(nproc) + list(args),
        cwd=tmp_path,
        env=env(tmp_path),
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )


def _error_lines(stderr: str):
    return [ln for ln in stderr.splitlines() if ln.startswith("gem-train:")]


def test_config_error_exits_2_with_one_line(tmp_path):
    """The real entry point in a subprocess: an unknown key, one line naming it, exit code 2, no traceback."""
    p = _run(tmp_path, ["train.steps=20", "train.no_such_key=1"], timeout=120)
    assert p.returncode == 2, p.stderr[-2000:]
    lines = _error_lines(p.stderr)
    assert len(lines) == 1 and "train.no_such_key" in lines[0], p.stderr[-2000:]
    assert "Traceback" not in p.stderr and "Traceback" not in p.stdout
    assert not (tmp_path / "outputs").exists()  # failed before any run directory was made


@pytest.mark.parametrize(
    "override,key",
    [
        ("train.no_such_key=1", "train.no_such_key"),  # unknown key (struct mode)
        ("+train.extra=1", "train.extra"),  # a key added with + is still unknown to the trainer
        ("train.stop_at_step=50", "train.stop_at_step"),  # inconsistent with train.steps=20
        ("train.sparse_optimizer.name=lamb", "train.sparse_optimizer.name: must be rowwise_adagrad, adagrad, adam"),
        ("train.sparse_optimizer.lr=-1", "train.sparse_optimizer.lr: must be > 0 (got -1.0)"),
        ("+train.sparse_optimizer.momentum=0.9", "train.sparse_optimizer.momentum: fbgemm's fused sgd has no momentum"),
        ("train.lr=-1", "train.lr: must be > 0 (got -1.0)"),
        ("model.tower.rope_base=-1", "model.tower.rope_base: must be > 0 (got -1.0)"),
        ("model.tower.attention=flash", "model.tower.attention: must be jfa, swa or block (got flash)"),
        ("parallel.dense=zero3", "parallel.dense: must be auto, ddp or fsdp (got zero3)"),
        ("data.histories.events.max_len=0", "data.histories.events.max_len: must be >= 1 (got 0)"),
        ("+model.num_dense=3", "model.num_dense: the dense width is the data's"),  # a key of the old form
        ("data.batch_size=0", "data.batch_size"),
        ("parallel.dp_shard=3", "parallel.dp_shard"),  # cannot lay out on 1 rank
        ("model.tower.num_blocks=???", "model.tower.num_blocks"),  # missing value
        ("train.lr=fast", "train.lr"),  # wrong type
        ("experiment=no_such_experiment", "experiment=no_such_experiment"),
    ],
)
def test_config_errors_name_the_key(tmp_path, monkeypatch, capsys, override, key):
    from gem.train.__main__ import main

    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    assert main(["train.steps=20", override]) == 2
    err = capsys.readouterr().err
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("gem-train: error: ") and key in lines[0], err
    assert not (tmp_path / "outputs").exists()


def test_device_capability_is_checked_up_front(monkeypatch, capsys):
    import torch

    from gem.train.__main__ import main

    if torch.cuda.is_available():
        pytest.skip("checks the CPU-only case")
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    assert main(["--check", "model.kernel=triton"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("gem-train: error: model.kernel: Triton kernels need a CUDA GPU") and err.endswith(
        "(got triton)"), err
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert main(["--check", "model.kernel=triton"]) == 0


def test_short_run_clamps_the_warmup_and_says_so_once(tmp_path, monkeypatch, capsys, caplog):
    """`train.steps=8` with the default (longer) warmup is a valid short run: the warmup is clamped, said once."""
    import logging

    from gem.train.__main__ import main
    from gem.train.config import TrainConfig

    monkeypatch.delenv("WORLD_SIZE", raising=False)
    monkeypatch.delenv("RANK", raising=False)
    monkeypatch.chdir(tmp_path)
    caplog.set_level(logging.WARNING, logger="gem.train")
    assert main(["--check", "train.steps=3", "train.warmup_steps=7"]) == 0
    assert main(["--check", "train.steps=3", "train.warmup_steps=7"]) == 0
    said = [r.getMessage() for r in caplog.records if "warmup" in r.getMessage()]
    assert said == ["train.warmup_steps=7 is longer than train.steps=3: warming up over all 3 steps"], said
    assert TrainConfig.from_dict({"steps": 3, "warmup_steps": 7}).warmup_steps == 3


def test_check_flag_accepts_a_good_config(tmp_path):
    p = _run(tmp_path, ["--check", *SMALL], timeout=120)
    assert p.returncode == 0, p.stderr[-2000:]
    assert "config ok" in p.stdout


def _summary(stdout: str) -> str:
    lines = [ln for ln in stdout.splitlines() if ln.startswith("gem-train summary:")]
    assert len(lines) == 1, stdout[-3000:]
    return lines[0]


def _loss_falls(losses: dict) -> None:
    steps = sorted(losses)
    head = sum(losses[s] for s in steps[:5]) / 5
    tail = sum(losses[s] for s in steps[-5:]) / 5
    assert tail < head - 0.02, (head, tail)


def test_train_one_rank(tmp_path):
    p = _run(tmp_path, [*SMALL, "train.steps=30", "train.eval_every=15", "train.tensorboard=true", "hydra.run.dir=run"])
    assert p.returncode == 0, p.stderr[-3000:]
    line = _summary(p.stdout)
    for part in ("steps 30", "click NE", "AUC", "conversion NE", "samples/s", "run dir"):
        assert part in line, line
    run = tmp_path / "run"
    losses = step_losses(run)
    assert sorted(losses) == list(range(1, 31))
    _loss_falls(losses)
    evals = [r for r in read_jsonl(run / "metrics.jsonl") if "eval/click/auc" in r]
    assert [r["step"] for r in evals] == [15, 30]
    assert (run / ".hydra" / "config.yaml").is_file()
    assert any((run / "tb").iterdir())


def test_train_two_ranks_and_resume(tmp_path):
    """torchrun, 2 ranks on gloo: loss falls, one run directory; resuming from step 10 retraces steps 11..20, logged
    once."""
    import shutil

    args = [*SMALL, "train.steps=20", "train.eval_every=0", "train.checkpoint.every=10", "hydra.run.dir=run"]
    first = _run(tmp_path, args, nproc=2)
    assert first.returncode == 0, first.stderr[-3000:]
    assert "steps 20" in _summary(first.stdout)
    # no third-party warnings (DDP, c10d, torchrec, ...): gem's own lines only
    noise = [ln for ln in (first.stdout + first.stderr).splitlines() if "warn" in ln.lower() and "gem" not in ln]
    assert not noise, noise
    run = tmp_path / "run"
    # one run directory for both ranks (no per-rank timestamp directories)
    assert sorted(p.name for p in tmp_path.iterdir() if p.is_dir() and p.name != "tmp") == ["run"]
    a = [r for r in read_jsonl(run / "metrics.jsonl") if "train/loss" in r]
    assert [r["step"] for r in a] == list(range(1, 21))
    _loss_falls({r["step"]: r["train/loss"] for r in a})
    ckpts = run / "checkpoints"
    assert sorted(p.name for p in ckpts.iterdir()) == ["step_10", "step_20"]

    shutil.rmtree(ckpts / "step_20")  # as if the job had died after step 10's checkpoint
    second = _run(tmp_path, [*args, "train.resume=true"], nproc=2)
    assert second.returncode == 0, second.stderr[-3000:]
    assert "resumed from" in second.stderr + second.stdout
    # the redone steps 11..20 replace their first records: each step once
    b = [r for r in read_jsonl(run / "metrics.jsonl") if "train/loss" in r]
    assert [r["step"] for r in b] == list(range(1, 21))
    assert b[:10] == a[:10]
    for ra, rb in zip(a[10:], b[10:]):
        assert rb["train/loss"] == pytest.approx(ra["train/loss"], abs=1e-6), rb["step"]


def test_help_teaches_and_starts_nothing(tmp_path, capsys, monkeypatch):
    """`scripts/train.sh --help` prints the help once, before any setup and without starting ranks; `python -m
    gem.train --help` prints the same text."""
    import os
    import sys

    from gem.train.__main__ import main
    from tests.train._util import ROOT

    e = dict(env(tmp_path), PYTHON=sys.executable, NPROC="2")
    p = subprocess.run(["bash", str(ROOT / "scripts/train.sh"), "--nproc", "2", "--help"], cwd=tmp_path, env=e,
                       capture_output=True, text=True, timeout=60, check=False)
    assert p.returncode == 0, p.stderr
    assert p.stderr == ""  # no environment setup, no torchrun
    text = p.stdout
    assert text.count("The two commands") == 1
    for part in ("scripts/train.sh", "scripts/test.sh", "--check", "--nproc", "torchrun", "launch_multinode.sh",
                 "gem-train: error:"):
        assert part in text, part
    first = (ROOT / "configs/model/gem_tiny.yaml").read_text().splitlines()[0].lstrip("# ").strip()
    line = next(ln for ln in text.splitlines() if "model=gem_tiny" in ln)
    assert "(default)" in line and first in line, line
    for group in ("data", "experiment", "model", "parallel", "train"):
        assert f"  {group}:" in text, group
    monkeypatch.setitem(os.environ, "GEM_CONFIG_DIR", str(ROOT / "configs"))
    assert main(["--help"]) == 0
    assert capsys.readouterr().out == text


def test_check_on_4_ranks_degrees_imply_hsdp(monkeypatch, capsys):
    """`--check` against WORLD_SIZE: dp_replicate=2 dp_shard=2 on 4 ranks is HSDP without naming parallel.dense;
    naming ddp with it is a contradiction, one line."""
    from gem.train.__main__ import main

    monkeypatch.setenv("WORLD_SIZE", "4")
    monkeypatch.delenv("RANK", raising=False)
    assert main(["--check", "parallel.dp_replicate=2", "parallel.dp_shard=2"]) == 0
    assert "config ok" in capsys.readouterr().out
    assert main(["--check", "parallel.dp_replicate=2", "parallel.dp_shard=2", "parallel.dense=ddp"]) == 2
    err = capsys.readouterr().err.strip()
    assert err == "gem-train: error: parallel.dense: HSDP (dp_replicate=2) needs fsdp or auto (got ddp)", err


def test_run_time_user_error_one_line_exit_2(tmp_path):
    """Past the pre-flight check (here: resume=true with no checkpoint, found when the trainer starts): one line
    naming the key, exit status 2, no trace."""
    p = _run(tmp_path, [*SMALL, "train.steps=2", "train.resume=true", "hydra.run.dir=run"])
    assert p.returncode == 2, p.stderr[-3000:]
    lines = _error_lines(p.stderr)
    want = f"gem-train: error: train.resume: no complete checkpoint in {tmp_path / 'run' / 'checkpoints'}"
    assert len(lines) == 1 and lines[0].startswith(want) and lines[0].endswith("(got true)"), p.stderr[-3000:]
    assert "Traceback" not in p.stderr + p.stdout


# ---- checks before the first step, one job per run dir, unique run dirs ------------------------------------------


def _check_line(monkeypatch, capsys, tmp_path, *args) -> str:
    from gem.cli.train import main

    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    monkeypatch.delenv("RANK", raising=False)
    capsys.readouterr()  # what the test itself printed
    code = main(["--check", *SMALL, *args])
    captured = capsys.readouterr()
    lines = [ln for ln in captured.err.splitlines() if ln.strip()]
    assert code == 2 and len(lines) == 1 and lines[0].startswith("gem-train: error: "), (code, captured)
    return lines[0][len("gem-train: error: "):]


def test_check_finds_data_paths_that_match_no_file(tmp_path, monkeypatch, capsys):
    line = _check_line(monkeypatch, capsys, tmp_path, "data=parquet", f"data.paths=[{tmp_path}/none/*.parquet]")
    assert line.startswith("data.paths: no file matches") and "none/*.parquet" in line, line
    from gem.data import DataConfig, SyntheticDataset
    from gem.data.parquet import write_parquet

    schema = DataConfig.from_dict(compose([*SMALL, "data=parquet"]).data).schema
    (tmp_path / "train").mkdir()
    write_parquet(SyntheticDataset(schema, 0, 32), str(tmp_path / "train" / "a.parquet"), 2)
    line = _check_line(monkeypatch, capsys, tmp_path, "data=parquet", f"data.paths=[{tmp_path}/train/*.parquet]",
                       f"data.eval_paths=[{tmp_path}/eval/*.parquet]")
    assert line.startswith("data.eval_paths: no file matches"), line


@pytest.mark.parametrize("where,key,what", [
    ("/proc/gem-x", "hydra.run.dir", "cannot create /proc/gem-x"),
    ("FILE/run", "hydra.run.dir", "is not a directory"),
])
def test_check_finds_a_run_dir_that_cannot_be_made(tmp_path, monkeypatch, capsys, where, key, what):
    (tmp_path / "FILE").write_text("a file\n")
    where = where.replace("FILE", str(tmp_path / "FILE"))
    line = _check_line(monkeypatch, capsys, tmp_path, f"hydra.run.dir={where}")
    assert line.startswith(f"{key}: ") and what in line, line
    assert sorted(p.name for p in tmp_path.iterdir()) == ["FILE"]  # nothing made


def test_check_finds_a_checkpoint_dir_that_cannot_be_made(tmp_path, monkeypatch, capsys):
    line = _check_line(monkeypatch, capsys, tmp_path, "hydra.run.dir=run", "train.checkpoint.dir=/proc/gem-ckpt")
    assert line.startswith("train.checkpoint.dir: cannot create /proc/gem-ckpt"), line
    assert not (tmp_path / "run").exists()


def test_check_finds_a_checkpoint_that_does_not_fit_the_model(tmp_path, monkeypatch, capsys):
    import torch

    from gem.train.checkpoint import Checkpointer, run_config
    from gem.train.trainer import build_configs

    other = build_configs(compose([*SMALL, "model.tower.num_blocks=3"]), world_size=1)
    Checkpointer(tmp_path / "run" / "checkpoints", config=run_config(other)).save(4, {"w": torch.ones(2)})
    line = _check_line(monkeypatch, capsys, tmp_path, "hydra.run.dir=run")
    assert line.startswith(f"{tmp_path / 'run' / 'checkpoints' / 'step_4'}: saved with other config values: "
                           "model.tower.num_blocks=3 (got 2)"), line
    # the same config passes
    from gem.cli.train import main

    assert main(["--check", *SMALL, "model.tower.num_blocks=3", "hydra.run.dir=run"]) == 0


def test_second_job_in_a_live_run_dir_is_refused_and_a_stale_lock_taken_over(tmp_path):
    import os
    import socket

    from gem.train.rundir import LOCK_FILE, RunDirLock

    held = RunDirLock(tmp_path / "run", "first")
    held.acquire()
    try:
        p = _run(tmp_path, [*SMALL, "train.steps=2", "hydra.run.dir=run"], timeout=120)
    finally:
        held.release()
    assert p.returncode == 2, p.stderr[-3000:]
    lines = _error_lines(p.stderr)
    want = f"gem-train: error: {tmp_path / 'run'}: in use by the job on host {socket.gethostname()} pid {os.getpid()}"
    assert len(lines) == 1 and lines[0].startswith(want), p.stderr[-3000:]
    assert sorted(x.name for x in (tmp_path / "run").iterdir()) == [LOCK_FILE]  # nothing written into it

    # a holder that died without releasing: its record stays, its lock went with it
    (tmp_path / "run" / LOCK_FILE).write_text('{"host": "gone", "pid": 999999, "start": 0, "run_id": "old"}\n')
    p = _run(tmp_path, [*SMALL, "train.steps=2", "train.eval_every=0", "hydra.run.dir=run"], timeout=120)
    assert p.returncode == 0, p.stderr[-3000:]
    assert "took over the stale lock of the job on host gone pid 999999" in p.stdout + p.stderr, p.stderr[-3000:]
    assert (tmp_path / "run" / LOCK_FILE).read_text() == ""  # released at the end


def test_two_launches_in_the_same_second_get_two_run_dirs(tmp_path):
    import time

    from gem.train.rundir import new_run_id

    now = time.time()
    assert new_run_id(now) != new_run_id(now)
    args = train_cmd(1) + [*SMALL, "train.steps=1", "train.eval_every=0"]
    procs = [subprocess.Popen(args, cwd=tmp_path, env=env(tmp_path), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True) for _ in range(2)]
    for p in procs:
        _, err = p.communicate(timeout=180)
        assert p.returncode == 0, err[-3000:]
    runs = sorted(r.parent for r in (tmp_path / "outputs").rglob("metrics.jsonl"))
    assert len(runs) == 2, runs


def test_config_dir_adds_configs(tmp_path, monkeypatch, capsys):
    """Hydra's --config-dir: a directory searched before the shipped configs (an experiment of one's own)."""
    from gem.cli.train import main

    (tmp_path / "extra" / "experiment").mkdir(parents=True)
    (tmp_path / "extra" / "experiment" / "mine.yaml").write_text("# @package _global_\ntrain:\n  steps: 7\n")
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    monkeypatch.delenv("RANK", raising=False)
    for flag in (["--config-dir", str(tmp_path / "extra")], [f"--config-dir={tmp_path / 'extra'}"]):
        assert main(["--check", *flag, "experiment=mine"]) == 0
        assert capsys.readouterr().out.strip() == "gem-train: config ok"
    assert main(["--check", "experiment=mine"]) == 2
    assert "experiment=mine: no such config" in capsys.readouterr().err
    assert main(["--check", "--config-dir", str(tmp_path / "none")]) == 2
    assert capsys.readouterr().err.startswith("gem-train: error: --config-dir: no such directory")
