"""scripts/launch_multinode.sh: two launchers on one machine (2 nodes x 2 ranks, c10d rendezvous on loopback, gloo)
train a few steps of the five-dimensional layout as one world of 4; only rank 0 writes to the console."""

from __future__ import annotations

import json
import math
import os
import re
import socket
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
LAUNCH = ROOT / "scripts" / "launch_multinode.sh"
TINY = ["model.kernel=reference", "data.batch_size=16", "data.eval_batches=1", "data.histories.events.max_len=16",
        "train.warmup_steps=1", "train.log_every=1", "train.eval_every=0", "train.tensorboard=false"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _env(tmp_path: Path, node_rank: int, port: int, **extra: str) -> dict:
    scratch = tmp_path / "tmp"
    scratch.mkdir(exist_ok=True)
    env = {k: v for k, v in os.environ.items() if k not in ("GEM_RUN_ID", "GEM_LOG_ALL_RANKS", "RANK_LOG_DIR")}
    env.update(NNODES="2", NODE_RANK=str(node_rank), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
               NPROC_PER_NODE="2", PYTHON=sys.executable, OMP_NUM_THREADS="1", GLOO_SOCKET_IFNAME="lo",
               TMPDIR=str(scratch), RDZV_ID=f"test{port}", **extra)
    return env


@pytest.mark.slow
def test_two_launchers_train_full_5d_as_one_world(tmp_path):
    port, run_dir = _free_port(), tmp_path / "run"
    args = ["parallel=full_5d", "train.steps=3", f"hydra.run.dir={run_dir}", *TINY]
    nodes = [subprocess.Popen(["bash", str(LAUNCH), *args], cwd=tmp_path, env=_env(tmp_path, r, port),
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for r in (0, 1)]
    outs = []
    try:
        for p in nodes:
            out, err = p.communicate(timeout=240)
            outs.append(out + err)
    finally:
        for p in nodes:
            if p.poll() is None:
                p.kill()
    for p, out in zip(nodes, outs):
        assert p.returncode == 0, out[-4000:]
    console = "\n".join(outs)
    # One world of 4 in the full layout: 2 replicas x 2 shards, experts over 2, tables over groups of 2 per host.
    layout = [ln for ln in console.splitlines() if "training steps 0..3 of 3" in ln]
    assert len(layout) == 1 and "world 4" in layout[0], console[-4000:]
    assert "dp_replicate=2 dp_shard=2 ep=2 emb_shard_group=2 (x2 replicas, host_local" in layout[0]
    # Only rank 0 reaches the console: each step logged once, no other rank's tagged lines.
    assert [int(m) for m in re.findall(r"step (\d+)/3 \| loss", console)] == [1, 2, 3]
    assert console.count("gem-train summary: steps 3") == 1
    assert not re.search(r"^\[rank[123]\]", console, re.MULTILINE), console[-4000:]
    logs = tmp_path / "outputs" / "rank_logs"
    assert sorted(f.name for f in logs.iterdir()) == ["rank1.log", "rank2.log", "rank3.log"]
    losses = [r["train/loss"] for r in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines())
              if "train/loss" in r]
    assert len(losses) == 3 and all(math.isfinite(x) for x in losses)


def test_dry_run_quiets_other_ranks_unless_asked(tmp_path):
    def command(*flags: str) -> str:
        p = subprocess.run(["bash", str(LAUNCH), "--dry-run", "--bench", *flags, "parallel=full_5d"], cwd=tmp_path,
                           env=_env(tmp_path, 1, 29400), capture_output=True, text=True, timeout=120, check=False)
        assert p.returncode == 0, p.stderr
        return p.stdout

    quiet, loud = command(), command("--log-all-ranks")
    for cmd in (quiet, loud):
        assert "--nnodes=2 --nproc_per_node=2" in cmd and "--rdzv_endpoint=127.0.0.1:29400" in cmd
        assert cmd.rstrip().endswith("scripts/bench_train.py parallel=full_5d")
    assert "rank\\$RANK.log" in quiet or "rank$RANK.log" in quiet
    assert "RANK.log" not in loud and "bash" not in loud
    assert not (tmp_path / "outputs").exists()  # a dry run creates nothing


def test_bad_environment_is_one_line(tmp_path):
    env = _env(tmp_path, 2, 29400)
    p = subprocess.run(["bash", str(LAUNCH), "parallel=full_5d"], cwd=tmp_path, env=env, capture_output=True,
                       text=True, timeout=60, check=False)
    assert p.returncode == 2 and p.stderr == "launch_multinode.sh: NODE_RANK=2: must be < NNODES=2\n"
