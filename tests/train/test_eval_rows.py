"""Evaluation covers every row of the eval files: the whole batches, then the last partial round split over the
ranks (padded to one size on every rank, the padding not counted)."""

from __future__ import annotations

import pyarrow.parquet as pq
import pytest
import torch

from tests.train._util import SMALL, compose


def _file(tmp_path, rows: int):
    from gem.data import DataConfig, SyntheticDataset
    from gem.data.parquet import write_parquet

    data = DataConfig.from_dict(compose([*SMALL, "data=parquet"]).data)
    path = tmp_path / "eval.parquet"
    write_parquet(SyntheticDataset(data.schema, 0, rows), str(path), 1)
    return data.schema, path


@pytest.mark.parametrize("rows,batch,world", [(200, 32, 1), (200, 32, 2), (200, 32, 3), (130, 32, 4), (64, 32, 2)])
def test_last_rows_cover_the_rest_once(tmp_path, rows, batch, world):
    from gem.data.parquet import ParquetDataset

    schema, path = _file(tmp_path, rows)
    labels = torch.tensor(pq.read_table(path).column("click").to_pylist())
    seen, sizes = [], set()
    for rank in range(world):
        ds = ParquetDataset(schema, [str(path)], batch, rank, world)
        for b in ds:
            seen.append(b.labels[:, 0])
        tail = ds.last_rows()
        whole = ds.batches_per_pass * world * batch
        if whole == rows:
            assert tail is None
            continue
        b, real = tail
        sizes.add(b.labels.shape[0])
        seen.append(b.labels[:real, 0])
    assert len(sizes) <= 1  # the same batch size on every rank
    got = torch.cat(seen)
    assert got.shape[0] == rows
    assert torch.equal(torch.sort(got).values, torch.sort(labels).values)


def test_evaluation_counts_every_row_and_says_so(tmp_path, monkeypatch):
    import torch.distributed as dist

    from gem.train.trainer import Trainer, TrainResult, summary_line

    _, path = _file(tmp_path, 200)
    cfg = compose([*SMALL, "data=parquet", f"data.paths=[{path}]", f"data.eval_paths=[{path}]", "data.eval_batches=100",
                   "train.steps=1", "train.eval_every=0"])
    t = Trainer(cfg)
    try:
        metrics = t.evaluate()
    finally:
        t.close()
        if dist.is_initialized():
            dist.destroy_process_group()
    assert metrics["num_samples"] == 200  # 6 whole batches of 32 and the last 8 rows
    line = summary_line(TrainResult(steps=1, eval_metrics=metrics), t.tasks)
    assert "eval on 200 rows" in line, line
