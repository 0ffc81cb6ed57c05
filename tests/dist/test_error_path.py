"""One error path for every rank: a data error that only rank 1 meets mid-run is printed once, as one line naming
file:row; rank 0, whose collective breaks, leaves without a trace; torchrun reports one failed worker."""

from __future__ import annotations

import subprocess
import sys

import pyarrow.parquet as pq

from tests.train._util import SMALL, compose, env

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


def test_user_error_on_one_rank_prints_one_line_and_no_traces(tmp_path):
    bad, good, row = _files(tmp_path)
    args = [*SMALL, f"data.batch_size={BATCH}", "data.source=parquet", f"+data.paths=[{bad}]",
            f"+data.eval_paths=[{good}]", "data.eval_batches=1", "train.steps=4", "train.eval_every=0",
            "hydra.run.dir=run"]
    e = env(tmp_path)
    e["GEM_ERROR_FILE"] = str(tmp_path / "error")
    p = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
                        "-m", "gem.train", *args], cwd=tmp_path, env=e, capture_output=True, text=True,
                       timeout=300, check=False)
    out = p.stdout + p.stderr
    assert p.returncode != 0, out[-3000:]
    lines = [ln for ln in out.splitlines() if "gem-train: error:" in ln]
    want = f"gem-train: error: {bad}:{row}: label 'click' must be 0 or 1 (got 3.0)"
    assert lines == [want], out[-4000:]
    # no rank's trace: torchrun's own summary (one traceback of torch/distributed/run.py) is all that follows
    assert out.count("Traceback") <= 1 and "/gem/" not in out.split("Traceback")[-1], out[-4000:]
    assert "Connection closed" not in out and "DistBackendError" not in out, out[-4000:]
    assert "rank      : 1 (local_rank: 1)\n  exitcode  : 2" in out, out[-3000:]  # the root cause: the rank that found it
    # the line scripts/train.sh turns into exit status 2
    assert (tmp_path / "error").read_text().strip() == want.removeprefix("gem-train: error: ")
