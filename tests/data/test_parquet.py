import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from gem.data import SyntheticDataset, build_dataset, validate_batch
from gem.data.parquet import ParquetDataset, batch_to_table, table_to_batch, write_parquet
from tests.data._util import assert_batches_equal, make_schema, schema_dict

SCHEMA = make_schema(max_len=16)


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    d = tmp_path_factory.mktemp("pq")
    src = SyntheticDataset(SCHEMA, seed=3, batch_size=24)
    paths = []
    for f in range(2):  # two files of 3 batches each = 6 global batches of 24 rows
        p = str(d / f"part-{f}.parquet")
        src.load_state_dict({"batch_index": 3 * f})
        assert write_parquet(src, p, 3) == 72
        paths.append(p)
    return d, paths


def _stream(n):
    ds = SyntheticDataset(SCHEMA, seed=3, batch_size=24)
    return [ds.batch(i) for i in range(n)]


def test_round_trip_identical_batches(files):
    d, _ = files
    reader = ParquetDataset(SCHEMA, str(d / "*.parquet"), batch_size=24)
    assert reader.num_rows == 144 and len(reader) == 6
    got = list(reader)
    assert len(got) == 6
    for ref, b in zip(_stream(6), got):
        assert_batches_equal(ref, b)
        validate_batch(b, SCHEMA)


def test_row_batches_straddle_row_groups_and_files(files):
    _, paths = files
    reader = ParquetDataset(SCHEMA, paths, batch_size=40)  # 144 rows -> 3 batches of 40, 24 rows dropped
    assert len(reader) == 3
    rows = [batch_to_table(b, SCHEMA) for b in _stream(6)]
    whole = pa.concat_tables(rows)
    for i, b in enumerate(reader):
        assert_batches_equal(table_to_batch(whole.slice(40 * i, 40), SCHEMA), b)
    # the batch that crosses the file boundary (rows 40..79 cover files 0 and 1) has real content
    assert reader.batch(1).batch_size == 40


def test_rank_sharding_deals_batches(files):
    _, paths = files
    ref = _stream(6)
    r0 = list(ParquetDataset(SCHEMA, paths, 24, rank=0, world_size=2))
    r1 = list(ParquetDataset(SCHEMA, paths, 24, rank=1, world_size=2))
    assert len(r0) == len(r1) == 3
    for i in range(3):
        assert_batches_equal(r0[i], ref[2 * i])
        assert_batches_equal(r1[i], ref[2 * i + 1])
    # 6 global batches over 4 ranks: one whole round each, the rest dropped
    r3 = ParquetDataset(SCHEMA, paths, 24, rank=3, world_size=4)
    assert len(r3) == 1
    assert_batches_equal(next(iter(r3)), ref[3])


def test_resume_and_cycle(files):
    _, paths = files
    ref = _stream(6)
    reader = ParquetDataset(SCHEMA, paths, 24, cycle=True)
    it = iter(reader)
    for _ in range(4):
        next(it)
    state = reader.state_dict()
    fresh = ParquetDataset(SCHEMA, paths, 24, cycle=True)
    fresh.load_state_dict(state)
    it2 = iter(fresh)
    for i in range(4, 9):  # goes past the end and wraps to the first batch
        assert_batches_equal(next(it2), ref[i % 6])
    with pytest.raises(ValueError, match="world_size 1"):
        ParquetDataset(SCHEMA, paths, 24, rank=0, world_size=2).load_state_dict(state)


def test_eval_pass_limit_and_build_dataset(files):
    d, paths = files
    cfg = {
        "source": "parquet",
        "batch_size": 24,
        "eval_batches": 2,
        "paths": paths,
        "eval_paths": [str(d / "part-1.parquet")],
        "schema": schema_dict(max_len=16),
    }
    ev = build_dataset(cfg, split="eval")
    got = list(ev)
    assert len(got) == 2
    assert_batches_equal(got[0], _stream(4)[3])
    tr = build_dataset(cfg, split="train")
    assert tr.cycle and tr.batches_per_pass == 6


def test_missing_column_and_bad_types(tmp_path, files):
    _, paths = files
    table = pq.read_table(paths[0]).drop_columns(["hist_action"])
    p = str(tmp_path / "bad.parquet")
    pq.write_table(table, p)
    with pytest.raises(ValueError, match="missing column 'hist_action'"):
        ParquetDataset(SCHEMA, p, 24)
    t2 = pq.read_table(paths[0]).set_column(0, "hist_item", pa.array(range(72), pa.int64()))
    with pytest.raises(ValueError, match="column 'hist_item' must be list<int64>"):
        table_to_batch(t2, SCHEMA)
    with pytest.raises(ValueError, match="no file matches"):
        ParquetDataset(SCHEMA, str(tmp_path / "nothing-*.parquet"), 24)
    with pytest.raises(ValueError, match="no whole batch"):
        ParquetDataset(SCHEMA, paths, 100, rank=0, world_size=2)


def test_inconsistent_sequence_columns(files):
    _, paths = files
    t = pq.read_table(paths[0])
    acts = t.column("hist_action").to_pylist()
    k = next(i for i, a in enumerate(acts) if a)
    acts[k] = acts[k][:-1]
    t = t.set_column(t.column_names.index("hist_action"), "hist_action", pa.array(acts, pa.list_(pa.int64())))
    with pytest.raises(ValueError, match=f"sequence column 'hist_action' has length .* at row {k}"):
        table_to_batch(t, SCHEMA)


def test_integer_labels_and_empty_histories(tmp_path):
    s = make_schema(max_len=1, sparsity=0.9)  # every history empty
    b = SyntheticDataset(s, seed=0, batch_size=8).batch(0)
    t = batch_to_table(b, s)
    for task in s.tasks:
        t = t.set_column(t.column_names.index(task), task, pa.array(t.column(task).to_numpy().astype("int8")))
    p = str(tmp_path / "e.parquet")
    pq.write_table(t, p)
    got = next(iter(ParquetDataset(s, p, 8)))
    assert_batches_equal(b, got)
    assert got.labels.dtype == torch.float32 and got.max_seq_len == 0
