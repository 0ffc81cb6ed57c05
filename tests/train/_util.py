"""Helpers for the trainer tests: a small config composed from configs/ and the entry-point command."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
CONFIG_DIR = os.environ.get("GEM_CONFIG_DIR") or str(ROOT / "configs")

# Small and fast on CPU. kernel=reference explicitly: tests run with TRITON_INTERPRET=1, under which `auto`
# would pick the (slow) interpreted Triton kernels.
SMALL = [
    "model.kernel=reference",
    "model.tower.num_blocks=2",
    "data.batch_size=32",
    "data.eval_batches=2",
    "data.histories.events.max_len=16",
    "train.warmup_steps=2",
    "train.log_every=1",
    "train.tensorboard=false",
]


def compose(overrides: list[str]):
    from gem.config import compose as compose_config

    return compose_config(overrides, config_dir=CONFIG_DIR)


def env(tmp_path: Path) -> dict:
    scratch = tmp_path / "tmp"
    scratch.mkdir(exist_ok=True)
    e = dict(os.environ)
    e.update(
        PYTHONPATH=str(ROOT) + (os.pathsep + e["PYTHONPATH"] if e.get("PYTHONPATH") else ""),
        OMP_NUM_THREADS="1",
        GLOO_SOCKET_IFNAME="lo",
        TMPDIR=str(scratch),  # torchrun's torchelastic_* scratch stays in the test's directory
        GEM_CONFIG_DIR=CONFIG_DIR,
    )
    e.pop("GEM_RUN_ID", None)
    return e


def train_cmd(nproc: int) -> list[str]:
    if nproc == 1:
        return [sys.executable, "-m", "gem.train"]
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc_per_node={nproc}",
        "-m",
        "gem.train",
    ]


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def step_losses(run_dir: Path) -> dict:
    """step -> logged training loss (mean over ranks) from <run_dir>/metrics.jsonl."""
    return {r["step"]: r["train/loss"] for r in read_jsonl(run_dir / "metrics.jsonl") if "train/loss" in r}


def drop_process_group_after_module():
    """Generator for a module-scoped autouse fixture: trainers create the one-rank default group in this process;
    drop it after the module, so later tests that fork ranks of their own don't inherit it."""
    import torch.distributed as dist

    was = dist.is_available() and dist.is_initialized()
    yield
    if not was and dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


def small_trainer(run_dir: Path | None, *overrides: str):
    """A Trainer of the SMALL config with `overrides` (run_dir None: no run dir)."""
    from gem.train.trainer import Trainer

    return Trainer(compose(SMALL + list(overrides)), run_dir=str(run_dir) if run_dir else None)
