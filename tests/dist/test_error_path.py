"""One error path for every rank: a data error that only rank 1 meets mid-run is printed once, as one line naming
file:row; rank 0, whose collective breaks, leaves without a trace; scripts/train.sh exits with status 2."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pyarrow.parquet as pq

from tests.train._util import ROOT, SMALL, compose, env

BATCH = 8


def _files(tmp_path):
    from gem.data import DataConfig, SyntheticDataset
    from gem.data.parquet import write_parquet

    data = DataConfig.from_dict(compose(SMALL).data)
    src = SyntheticDataset(data.schema, seed=0, batch_size=BATCH)
    good, bad = tmp_path / "eval.parquet", tmp_path / "train.parquet"
    write_parquet(src, str(good), 4)
    src.load_state_dict({"batch_index": 0})
    write_parquet(src, str(bad), 8)  # 8 row groups of 8 rows: global batch g is row group g
    t = pq.read_table(bad)
    labels = t.column("click").to_pylist()
    row = 3 * BATCH + 5  # global batch 3: rank 1's second batch; not in a sampled row group (first, last)
    labels[row] = 3.0
    t = t.set_column(t.column_names.index("click"), "click", [labels])
    pq.write_table(t, bad, row_group_size=BATCH)
    return bad, good, row


def _checkout_with_this_venv(tmp_path: Path) -> Path:
    """A tree where scripts/train.sh finds its environment already set up: the repository's files linked, and a
    .venv that is this interpreter's venv (its site-packages linked) with the setup stamp _env.sh expects."""
    repo = tmp_path / "repo"
    repo.mkdir()
    for name in ("scripts", "gem", "requirements", "pyproject.toml"):
        (repo / name).symlink_to(ROOT / name)
    venv = repo / ".venv"
    (venv / "bin").mkdir(parents=True)
    shutil.copy(Path(sys.prefix) / "pyvenv.cfg", venv / "pyvenv.cfg")
    (venv / "lib").symlink_to(Path(sys.prefix) / "lib")
    (venv / "bin" / "python").symlink_to(os.path.realpath(sys.executable))
    want = subprocess.run(["bash", "-c", f'ROOT={repo}; REQ=$ROOT/requirements; '
                                         f'eval "$(grep "^WANT=" {ROOT}/scripts/_env.sh)"; echo "$WANT"'],
                          capture_output=True, text=True, check=True).stdout.strip()
    assert len(want) == 12, want  # the stamp: a hash of the pinned requirements and pyproject.toml
    (venv / ".gem-stack").write_text(want + "\n")
    return repo


def test_user_error_on_one_rank_prints_one_line_and_no_traces(tmp_path):
    bad, good, row = _files(tmp_path)
    repo = _checkout_with_this_venv(tmp_path)
    args = [*SMALL, f"data.batch_size={BATCH}", "data.source=parquet", f"+data.paths=[{bad}]",
            f"+data.eval_paths=[{good}]", "data.eval_batches=1", "train.steps=4", "train.warmup_steps=10",
            "train.eval_every=0", "hydra.run.dir=run"]
    e = env(tmp_path)
    e.pop("GEM_CONFIG_DIR")  # the script's own
    p = subprocess.run(["bash", str(repo / "scripts" / "train.sh"), "--nproc", "2", *args], cwd=tmp_path, env=e,
                       capture_output=True, text=True, timeout=300, check=False)
    out = p.stdout + p.stderr
    assert "setting up" not in out  # the environment was found, nothing installed
    assert out.count("warming up over all 4 steps") == 1, out[-3000:]  # the clamped warmup (10 > 4), said once
    assert p.returncode == 2, out[-3000:]
    lines = [ln for ln in out.splitlines() if "gem-train: error:" in ln]
    want = f"gem-train: error: {bad}:{row}: label 'click' must be 0 or 1 (got 3.0)"
    assert lines == [want], out[-4000:]
    # no rank's trace: torchrun's own summary (one traceback of torch/distributed/run.py) is all that follows
    assert out.count("Traceback") <= 1 and "/gem/" not in out.split("Traceback")[-1], out[-4000:]
    assert "Connection closed" not in out and "DistBackendError" not in out, out[-4000:]
    assert "rank      : 1 (local_rank: 1)\n  exitcode  : 2" in out, out[-3000:]  # the root cause: the rank that found it
