"""Synthetic requests (data.max_candidates > 1): 1..K candidates per history, labels from the same hidden world."""

import torch

from gem.data import SyntheticDataset, validate_batch
from gem.train.metrics import gauc_with_ties
from tests.data._util import assert_batches_equal, make_schema

SCHEMA = make_schema(max_len=20)


def test_one_candidate_is_the_row_form():
    rows = SyntheticDataset(SCHEMA, seed=3, batch_size=16).batch(2)
    one = SyntheticDataset(SCHEMA, seed=3, batch_size=16, max_candidates=1).batch(2)
    assert one.cand_offsets is None and one.request_ids is None
    assert_batches_equal(rows, one)


def test_requests_have_1_to_k_candidates_one_id_each_on_their_requests_row():
    k = 6
    ds = SyntheticDataset(SCHEMA, seed=0, batch_size=64, max_candidates=k)
    counts = []
    for i in range(4):
        b = ds.batch(i)
        validate_batch(b, SCHEMA)
        n = b.num_candidates
        counts.append(n)
        assert b.num_requests == 64 and b.batch_size == int(n.sum()) and b.max_candidates == int(n.max())
        # the request's own features once per request; the candidate item once per candidate on its request's row
        assert tuple(b.dense.shape) == (64, SCHEMA.num_dense) and b.sparse.stride() == 64
        assert tuple(b.labels.shape) == (b.batch_size, SCHEMA.num_tasks)
        cand = b.sequence["cand_item"]
        assert torch.equal(cand.lengths(), n) and cand.values().numel() == b.batch_size
        first = b.cand_offsets[:-1][torch.repeat_interleave(torch.arange(64), n)]
        assert not torch.equal(cand.values(), cand.values()[first])  # a request's candidates differ
    n = torch.cat(counts)
    assert int(n.min()) == 1 and int(n.max()) == k
    assert abs(n.double().mean() - (k + 1) / 2) < 0.4  # uniform 1..k: mean 3.5, sd of the mean over 256 ~0.1


def test_request_ids_are_global_over_ranks():
    one = SyntheticDataset(SCHEMA, seed=0, batch_size=8, max_candidates=4)
    ranks = [SyntheticDataset(SCHEMA, seed=0, batch_size=8, max_candidates=4, rank=r, world_size=2) for r in (0, 1)]
    ids = torch.cat([ranks[0].batch(0).request_ids, ranks[1].batch(0).request_ids])
    assert torch.equal(ids, torch.cat([one.batch(0).request_ids, one.batch(1).request_ids]))
    assert torch.equal(ids, torch.arange(16))


def test_labels_follow_the_hidden_model_within_requests():
    """The true probabilities explain the labels (rate and ranking inside each request): learning is measurable."""
    ds = SyntheticDataset(SCHEMA, seed=1, batch_size=256, max_candidates=16)
    labels, truth, groups = [], [], []
    for i in range(3):
        b, p = ds.batch(i, return_truth=True)
        labels.append(b.labels)
        truth.append(p)
        groups.append(b.candidate_groups())
    y, p, g = torch.cat(labels), torch.cat(truth), torch.cat(groups)
    n = y.shape[0]
    for t in range(y.shape[1]):
        sd = float((p[:, t] * (1 - p[:, t])).sum().sqrt())
        assert abs(float(y[:, t].sum() - p[:, t].sum())) < 4 * sd
    gauc, counted = gauc_with_ties(p[:, 0], y[:, 0], g)
    assert counted > 100 and gauc > 0.65, (gauc, counted, n)


def test_a_position_resumes_only_with_the_same_max_candidates():
    import pytest

    ds = SyntheticDataset(SCHEMA, seed=0, batch_size=8, max_candidates=4)
    ds.load_state_dict({"batch_index": 3, "seed": 0, "max_candidates": 4})
    assert ds.state_dict()["batch_index"] == 3
    with pytest.raises(ValueError, match="max_candidates 2"):
        ds.load_state_dict({"batch_index": 3, "seed": 0, "max_candidates": 2})


# ---- request-level Parquet: one row per request, candidates and labels as aligned lists ----------------------------

def _request_files(tmp_path, k=5, batches=2, bsz=16):
    import pyarrow.parquet as pq

    from gem.data.parquet import write_parquet

    src = SyntheticDataset(SCHEMA, seed=2, batch_size=bsz, max_candidates=k)
    path = str(tmp_path / "requests.parquet")
    assert write_parquet(src, path, batches) == batches * bsz
    return path, [src.batch(i) for i in range(batches)], pq.read_table(path)


def _assert_same_requests(a, b):
    assert_batches_equal(a, b)
    assert torch.equal(a.cand_offsets, b.cand_offsets) and a.max_candidates == b.max_candidates


def test_request_parquet_round_trip_and_layout(tmp_path):
    import pyarrow as pa

    from gem.data import build_dataset
    from tests.data._util import schema_dict

    path, ref, table = _request_files(tmp_path)
    assert pa.types.is_list(table.schema.field("cand_item").type)
    assert pa.types.is_list(table.schema.field("click").type)
    row = table.slice(0, 1).to_pylist()[0]
    assert len(row["cand_item"]) == len(row["click"]) == int(ref[0].num_candidates[0])
    assert len(row["user_segment"]) == 1 and len(row["dense"]) == 4  # the request's own features, once
    cfg = {"source": "parquet", "batch_size": 16, "max_candidates": 5, "eval_batches": 2, "paths": [path],
           "eval_paths": [path], **schema_dict(max_len=20)}
    got = list(build_dataset(cfg, split="eval"))
    assert len(got) == 2
    for a, b in zip(ref, got):
        _assert_same_requests(a, b)
        validate_batch(b, SCHEMA)


def test_request_parquet_last_partial_round_counts_candidates(tmp_path):
    from gem.data.parquet import ParquetDataset

    path, ref, _ = _request_files(tmp_path, batches=2, bsz=16)
    reader = ParquetDataset(SCHEMA, path, batch_size=12, max_candidates=5)  # 32 requests: 2 batches + 8 requests
    tail, real = reader.last_rows()
    assert tail.num_requests == 8 and real == tail.batch_size
    assert torch.equal(tail.labels, ref[1].labels[int(ref[1].cand_offsets[8]):])


def test_request_parquet_errors_name_file_row_and_column(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq
    import pytest

    from gem.data.parquet import DataFileError, ParquetDataset

    path, ref, table = _request_files(tmp_path, batches=1)
    rows = SyntheticDataset(SCHEMA, seed=2, batch_size=16).batch(0)
    from gem.data.parquet import batch_to_table

    row_file = str(tmp_path / "rows.parquet")
    pq.write_table(batch_to_table(rows, SCHEMA), row_file)
    with pytest.raises(DataFileError, match="feature 'cand_item': column 'cand_item' must be a list of integers"):
        ParquetDataset(SCHEMA, row_file, batch_size=8, max_candidates=5)

    def broken(column, values, name):
        out = str(tmp_path / name)
        i = table.column_names.index(column)
        pq.write_table(table.set_column(i, column, pa.array(values, type=table.schema.field(column).type)), out)
        return out

    clicks = table.column("click").to_pylist()
    r = next(i for i, c in enumerate(clicks) if len(c) > 1)
    short = [c[:-1] if i == r else c for i, c in enumerate(clicks)]
    with pytest.raises(DataFileError, match=rf"short.parquet:{r}: label 'click': {len(clicks[r]) - 1} labels for "
                                            rf"{len(clicks[r])} candidates"):
        ParquetDataset(SCHEMA, broken("click", short, "short.parquet"), batch_size=16, max_candidates=5)
    bad = [[2.0] * len(c) if i == r else c for i, c in enumerate(clicks)]
    with pytest.raises(DataFileError, match=rf"bad.parquet:{r}: label 'click' must be 0 or 1"):
        ParquetDataset(SCHEMA, broken("click", bad, "bad.parquet"), batch_size=16, max_candidates=5)
    with pytest.raises(DataFileError, match=r"requests.parquet:\d+: feature 'cand_item': a request has "
                                            r"1..data.max_candidates=2 candidates"):
        ParquetDataset(SCHEMA, path, batch_size=16, max_candidates=2)
