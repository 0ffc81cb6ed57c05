import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from gem.data import SyntheticDataset, build_dataset, validate_batch
from gem.data.parquet import DataFileError, ParquetDataset, batch_to_table, table_to_batch, write_parquet
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
        **schema_dict(max_len=16),
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
    with pytest.raises(ValueError, match=r"feature 'hist_item': column 'hist_item' must be a list of integers "
                       r"\(got int64\)"):
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
    with pytest.raises(DataFileError, match=f"^parquet row {k}: feature 'hist_action': history 'events' has"):
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


def _write_groups(path, table, group_rows):
    pq.write_table(table, path, row_group_size=group_rows)
    return str(path)


def _set(table, name, values, typ=None):
    return table.set_column(table.column_names.index(name), name, pa.array(values, typ))


@pytest.mark.parametrize("change,msg", [
    (lambda t: t.append_column("user_id", pa.array(range(t.num_rows))),
     r"column 'user_id' is not in the schema \(data.allow_extra_columns=true ignores it\) \(got \['user_id'\]\)"),
    (lambda t: _set(t, "dense", [[str(v) for v in x] for x in t.column("dense").to_pylist()], pa.list_(pa.string())),
     r"feature 'dense': column 'dense' must be a list of 4 numbers \(got list<"),
    (lambda t: _set(t, "dense", [x[:3] for x in t.column("dense").to_pylist()], pa.list_(pa.float32(), 3)),
     r"feature 'dense': column 'dense' must hold lists of size 4"),
    (lambda t: _set(t, "click", [str(x) for x in t.column("click").to_pylist()]),
     r"label 'click': column 'click' must be numbers 0 or 1 \(got string\)"),
    (lambda t: _set(t, "cand_item", [float(x) for x in t.column("cand_item").to_pylist()], pa.float64()),
     r"feature 'cand_item': column 'cand_item' must be an integer or a list of integers \(got double\)"),
    (lambda t: _set(t, "context", [x[0] if x else 0 for x in t.column("context").to_pylist()], pa.int64()),
     r"feature 'context': column 'context' must be a list of integers \(max_hot=3\) \(got int64\)"),
])
def test_file_schema_is_checked_on_opening(tmp_path, files, change, msg):
    """Extra, wrong-typed columns: one line naming the file, from the metadata, before any batch."""
    _, paths = files
    p = _write_groups(tmp_path / "f.parquet", change(pq.read_table(paths[0])), 24)
    with pytest.raises(DataFileError, match=f"^{p}: {msg}"):
        ParquetDataset(SCHEMA, p, 24)


def test_extra_columns_allowed_explicitly(tmp_path, files):
    _, paths = files
    t = pq.read_table(paths[0])
    p = _write_groups(tmp_path / "x.parquet", t.append_column("user_id", pa.array(range(t.num_rows))), 24)
    got = list(ParquetDataset(SCHEMA, p, 24, allow_extra_columns=True))
    for ref, b in zip(_stream(3), got):
        assert_batches_equal(ref, b)


@pytest.mark.parametrize("column,bad,msg", [
    ("click", 2.0, r"label 'click' must be 0 or 1 \(got 2.0\)"),
    ("dense", [0.0, float("nan"), 0.0, 0.0], r"dense feature 'dense': values must be finite \(got \[0.0, nan"),
    ("cand_item", 10**6, r"feature 'cand_item': id outside its table 'item' range \[0, \d+\) \(got 1000000\)"),
    ("hist_action", [], r"feature 'hist_action': history 'events' has \d+ events in 'hist_item' but 0 here"),
])
def test_bad_values_are_named_by_file_and_row(tmp_path, files, column, bad, msg):
    """A bad row in a middle row group (not sampled on opening) fails when its batch is read, naming file:row; the
    same row in a sampled group (the last) fails on opening."""
    _, paths = files
    t = pq.read_table(paths[0])  # 72 rows; row groups of 24: rows 24..47 are the middle group
    hist = t.column("hist_item").to_pylist()
    row = next(r for r in range(30, 48) if hist[r])  # a row with a history, so a shorter one differs
    values = t.column(column).to_pylist()
    values[row] = bad
    p = _write_groups(tmp_path / "v.parquet", _set(t, column, values, t.schema.field(column).type), 24)
    ds = ParquetDataset(SCHEMA, p, 24)
    ds.batch(0)  # rows 0..23 are fine
    with pytest.raises(DataFileError) as e:
        ds.batch(1)
    text = str(e.value)
    assert "\n" not in text
    import re

    assert re.match(f"^{re.escape(p)}:{row}: {msg}", text), text
    # the same row read in a batch that straddles two row groups still names its place in the file
    ds = ParquetDataset(SCHEMA, p, 36)
    with pytest.raises(DataFileError, match=f"^{re.escape(p)}:{row}: "):
        ds.batch(0)
    # a bad row in the last row group (sampled) fails on opening
    values = t.column(column).to_pylist()
    last = next(r for r in range(60, 72) if hist[r])
    values[last] = bad
    p2 = _write_groups(tmp_path / "w.parquet", _set(t, column, values, t.schema.field(column).type), 24)
    with pytest.raises(DataFileError, match=f"^{re.escape(p2)}:{last}: "):
        ParquetDataset(SCHEMA, p2, 24)


def test_bad_eval_labels_fail_when_the_eval_set_opens(tmp_path, files):
    """Evaluation reads few rows: all of them are checked on opening, not after the training run."""
    _, paths = files
    t = pq.read_table(paths[1])
    labels = t.column("conversion").to_pylist()
    labels[40] = -1.0
    ev = _write_groups(tmp_path / "eval.parquet", _set(t, "conversion", labels, t.schema.field("conversion").type), 24)
    cfg = {"source": "parquet", "batch_size": 24, "eval_batches": 2, "paths": paths, "eval_paths": [ev],
           **schema_dict(max_len=16)}
    build_dataset(cfg, split="train")
    with pytest.raises(DataFileError, match=f"^{ev}:40: label 'conversion' must be 0 or 1 \\(got -1.0\\)"):
        build_dataset(cfg, split="eval")
    cfg["eval_batches"] = 1  # one batch per rank reads rows 0..23 only
    assert len(list(build_dataset(cfg, split="eval"))) == 1
