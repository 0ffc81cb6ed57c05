"""A non-editable install works away from the checkout: the wheel carries the configs and the console scripts."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def installed(tmp_path_factory) -> Path:
    """The wheel built from a copy of the checkout (the checkout stays clean), installed into a target folder."""
    base = tmp_path_factory.mktemp("wheel")
    src = base / "src"
    src.mkdir()
    for name in ("pyproject.toml", "setup.py", "README.md", "MANIFEST.in"):
        shutil.copy(ROOT / name, src / name)
    for name in ("gem", "configs", "requirements"):
        shutil.copytree(ROOT / name, src / name, ignore=shutil.ignore_patterns("__pycache__"))
    pip = [sys.executable, "-m", "pip", "--disable-pip-version-check", "-q"]
    build = subprocess.run(pip + ["wheel", "--no-deps", "--no-build-isolation", "-w", str(base / "dist"), str(src)],
                           capture_output=True, text=True, timeout=180, check=False)
    assert build.returncode == 0, build.stdout + build.stderr
    wheels = list((base / "dist").glob("gem-*.whl"))
    assert len(wheels) == 1, wheels
    names = set(zipfile.ZipFile(wheels[0]).namelist())
    assert "gem/configs/config.yaml" in names and "gem/configs/experiment/tiny_cpu.yaml" in names
    # The benchmark ships as package code (gem/bench), not as a link to a script.
    assert {"gem/bench/runner.py", "gem/bench/__main__.py", "gem/plan/reference.json"} <= names
    assert not any(n.startswith("gem/cli/_bench") for n in names)
    target = base / "site"
    inst = subprocess.run(pip + ["install", "--no-deps", "--no-compile", "--target", str(target), str(wheels[0])],
                          capture_output=True, text=True, timeout=180, check=False)
    assert inst.returncode == 0, inst.stdout + inst.stderr
    return target


def _run(cmd: list[str], target: Path, cwd: Path) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "GEM_CONFIG_DIR", "GEM_RUN_ID")}
    env.update(PYTHONPATH=str(target), OMP_NUM_THREADS="1")
    return subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=240, check=False)


@pytest.mark.slow
def test_installed_gem_runs_outside_the_checkout(installed, tmp_path):
    where = _run([sys.executable, "-c", "import gem, gem.config as c; print(gem.__file__); print(c.default_config_dir())"],
                 installed, tmp_path)
    assert where.returncode == 0, where.stderr
    module, config_dir = where.stdout.split()
    assert Path(module).is_relative_to(installed) and Path(config_dir) == installed / "gem" / "configs"

    check = _run([str(installed / "bin" / "gem-train"), "--check", "train.steps=70"], installed, tmp_path)
    assert check.returncode == 0, check.stdout + check.stderr
    assert check.stdout.strip() == "gem-train: config ok"

    bad = _run([sys.executable, "-m", "gem.train", "--check", "experiment=no_such"], installed, tmp_path)
    assert bad.returncode == 2
    assert bad.stderr.strip().startswith("gem-train: error: experiment=no_such: no such config (options:")
    assert "tiny_cpu" in bad.stderr  # the options listed are the shipped presets
    assert list(tmp_path.iterdir()) == []  # --check writes nothing

    # A short real run: Hydra finds the packaged configs and writes its run dir under the working directory.
    small = ["model.kernel=reference", "data.batch_size=16", "data.eval_batches=1", "data.histories.events.max_len=16",
             "train.steps=2", "train.warmup_steps=1", "train.log_every=1", "train.tensorboard=false"]
    run = _run([str(installed / "bin" / "gem-train"), *small], installed, tmp_path)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-2000:]
    assert "gem-train summary: steps 2" in run.stdout
    (run_dir,) = (tmp_path / "outputs").glob("*/*")
    assert (run_dir / ".hydra" / "config.yaml").is_file() and (run_dir / "metrics.jsonl").is_file()


def test_installed_bench_entry_point(installed, tmp_path):
    out = _run([str(installed / "bin" / "gem-bench"), "--help"], installed, tmp_path)
    assert out.returncode == 0, out.stderr
    assert "--single-gpu-json" in out.stdout and "Hydra overrides" in out.stdout


def test_installed_gem_command_dispatches(installed, tmp_path):
    """`gem plan ...` as the docs write it, `gem train --check`, and one line for an unknown command."""
    gem = str(installed / "bin" / "gem")
    plan = _run([gem, "plan", "--help"], installed, tmp_path)
    assert plan.returncode == 0, plan.stderr
    assert "topology." in plan.stdout
    check = _run([gem, "train", "--check", "train.steps=70"], installed, tmp_path)
    assert check.returncode == 0 and check.stdout.strip() == "gem-train: config ok", check.stderr
    bad = _run([gem, "serve"], installed, tmp_path)
    assert bad.returncode == 2
    assert bad.stderr.strip() == "gem: error: unknown command 'serve' (expected train, plan or bench)"


def test_own_config_dir_trains_own_parquet_with_the_installed_package(installed, tmp_path):
    """A team's DIR/data/ours.yaml and DIR/experiment/ours.yaml (outside the checkout) over its own Parquet file:
    its column names, two histories of different lengths, a candidate sharing the history's item table, a dense
    list column and two labels; 20 steps with the installed package, from another directory."""
    import yaml

    from tests.data.test_inputs import OURS, _rows, _write

    team = tmp_path / "team"
    (team / "conf" / "data").mkdir(parents=True)
    (team / "conf" / "experiment").mkdir()
    files = [_write(team / f"part-{i}.parquet", _rows(seed=i)) for i in range(2)]
    (team / "conf" / "data" / "ours.yaml").write_text(yaml.safe_dump(
        {"source": "parquet", "paths": [files[0]], "eval_paths": [files[1]], "batch_size": 4, "eval_batches": 1,
         **OURS}))
    (team / "conf" / "experiment" / "ours.yaml").write_text("# @package _global_\n" + yaml.safe_dump(
        {"defaults": [{"override /data": "ours"}, {"override /model": "gem_tiny"}],
         "model": {"kernel": "reference", "towers": {"search": {"num_blocks": 1, "attention": "swa", "window": 2}},
                   "heads": {"weights": {"purchase": 2.0}}},
         "train": {"steps": 20, "warmup_steps": 2, "log_every": 10, "eval_every": 0, "tensorboard": False}}))
    work = tmp_path / "elsewhere"
    work.mkdir()
    gem_train = str(installed / "bin" / "gem-train")
    conf = str(team / "conf")
    check = _run([gem_train, "--check", f"hydra.searchpath=[file://{conf}]", "experiment=ours"], installed, work)
    assert check.returncode == 0 and check.stdout.strip() == "gem-train: config ok", check.stdout + check.stderr
    run = _run([gem_train, "--config-dir", conf, "experiment=ours"], installed, work)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-2000:]
    assert "gem-train summary: steps 20" in run.stdout
    assert "click NE" in run.stdout and "purchase NE" in run.stdout
