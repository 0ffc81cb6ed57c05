"""A team's own inputs: Parquet files with their own column names, two histories of different lengths, a candidate
sharing the history's item table, a dense list column and two labels; every bad row named by file:row and
feature; features added and deleted with one Hydra override each."""

from __future__ import annotations

import re

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from gem.data import DataConfig, Schema, SyntheticDataset, validate_batch
from gem.data.parquet import DataFileError, ParquetDataset
from gem.model import GEMModel, ModelConfig
from tests.model._batches import tiny_dict

# what a team declares for its logs (column names theirs, not gem's)
OURS = {
    "features": {
        "watched": {"kind": "sequence", "column": "seq_video", "table": "video", "history": "watch"},
        "watch_secs": {"kind": "sequence", "column": "seq_watch_bucket", "table": "watch_bucket", "history": "watch"},
        "searched": {"kind": "sequence", "column": "seq_query", "table": "query", "history": "search"},
        "target": {"kind": "candidate", "column": "target_video", "table": "video"},
        "country": {"kind": "sparse", "column": "country_id", "table": "country"},
        "topics": {"kind": "sparse", "column": "topic_ids", "table": "topic", "max_hot": 3, "min_hot": 0},
        "price": {"kind": "dense", "column": "price"},
        "embedding": {"kind": "dense", "column": "user_vec", "size": 3},
    },
    "histories": {"watch": {"max_len": 6}, "search": {"max_len": 3}},
    "labels": {"click": "is_click", "purchase": "is_purchase"},
    "tables": {
        "video": {"num_embeddings": 50, "embedding_dim": 8},
        "watch_bucket": {"num_embeddings": 4, "embedding_dim": 8},
        "query": {"num_embeddings": 30, "embedding_dim": 8},
        "country": {"num_embeddings": 5, "embedding_dim": 4},
        "topic": {"num_embeddings": 9, "embedding_dim": 4, "pooling": "mean"},
    },
}
ROWS = 12


def _rows(seed: int = 0) -> dict[str, list]:
    """Rows in the team's layout: plain integer candidate and country, list columns elsewhere."""
    rng = np.random.default_rng(seed)
    watch = rng.integers(0, 7, ROWS)
    search = rng.integers(0, 4, ROWS)
    return {
        "seq_video": [rng.integers(0, 50, n).tolist() for n in watch],
        "seq_watch_bucket": [rng.integers(0, 4, n).tolist() for n in watch],
        "seq_query": [rng.integers(0, 30, n).tolist() for n in search],
        "target_video": rng.integers(0, 50, ROWS).tolist(),
        "country_id": rng.integers(0, 5, ROWS).tolist(),
        "topic_ids": [rng.integers(0, 9, n).tolist() for n in rng.integers(0, 4, ROWS)],
        "price": rng.random(ROWS).tolist(),
        "user_vec": [rng.random(3).tolist() for _ in range(ROWS)],
        "is_click": rng.integers(0, 2, ROWS).tolist(),
        "is_purchase": [bool(v) for v in rng.integers(0, 2, ROWS)],
    }


TYPES = {"seq_video": pa.list_(pa.int64()), "seq_watch_bucket": pa.list_(pa.int32()), "seq_query": pa.list_(pa.int64()),
         "target_video": pa.int64(), "country_id": pa.int32(), "topic_ids": pa.list_(pa.int64()),
         "price": pa.float64(), "user_vec": pa.list_(pa.float32(), 3), "is_click": pa.int8(), "is_purchase": pa.bool_()}


def _write(path, rows: dict[str, list], types: dict | None = None) -> str:
    types = {**TYPES, **(types or {})}
    pq.write_table(pa.table({c: pa.array(v, types[c]) for c, v in rows.items()}), path, row_group_size=4)
    return str(path)


def test_own_columns_two_histories_shared_table_dense_list_two_labels(tmp_path):
    schema = Schema.from_dict(OURS)
    rows = _rows()
    reader = ParquetDataset(schema, _write(tmp_path / "ours.parquet", rows), batch_size=4)
    batch = reader.batch(1)  # rows 4..7
    validate_batch(batch, schema)
    lo, hi = 4, 8
    watch = [len(x) for x in rows["seq_video"][lo:hi]]
    search = [len(x) for x in rows["seq_query"][lo:hi]]
    assert batch.history_offsets[0].diff().tolist() == watch and batch.history_offsets[1].diff().tolist() == search
    assert batch.seq_offsets.diff().tolist() == [a + b for a, b in zip(watch, search)]
    assert batch.history_max_lens == (max(watch), max(search))
    assert batch.sequence["watched"].values().tolist() == [v for x in rows["seq_video"][lo:hi] for v in x]
    assert batch.sequence["searched"].values().tolist() == [v for x in rows["seq_query"][lo:hi] for v in x]
    assert batch.sequence["target"].values().tolist() == rows["target_video"][lo:hi]
    assert batch.sparse["country"].values().tolist() == rows["country_id"][lo:hi]
    want_dense = [[p, *v] for p, v in zip(rows["price"][lo:hi], rows["user_vec"][lo:hi])]
    torch.testing.assert_close(batch.dense, torch.tensor(want_dense, dtype=torch.float32))
    assert batch.labels.tolist() == [[float(c), float(p)] for c, p in
                                     zip(rows["is_click"][lo:hi], rows["is_purchase"][lo:hi])]
    # the model: one item table for the history and the candidate, a tower per history, gradients everywhere
    cfg = ModelConfig.from_dict({**tiny_dict(), "towers": {"search": {"num_blocks": 1, "attention": "swa",
                                                                     "window": 2}}}, schema)
    cfg.kernel = "reference"
    assert [t.features for t in cfg.sequence_tables if t.name == "video"] == [("watched", "target")]
    torch.manual_seed(0)
    model = GEMModel(cfg)
    assert len(model.blocks) == 3 and model.tower_spans == [(0, 2), (2, 3)]
    out = model(batch)
    assert out.logits.shape == (4, 2)
    (out.logits.sum() + out.aux_loss).backward()
    for name, p in model.named_parameters():
        if not name.startswith("ebc"):  # bag rows not looked up stay without gradient
            assert p.grad is not None, name
    # FLOPs: each tower on its own history's lengths (watch: 2 causal blocks; search: 1 block, window 2)
    from gem.model import flops as F

    w, s = (torch.tensor(x, dtype=torch.float64) for x in (watch, search))
    pairs_search = torch.where(s <= 3, s * s / 2, 6 + (s - 3) * 3 - s / 2)
    want = 6 * F.tower_weights_per_token(cfg, "watch") * sum(watch)
    want += 6 * F.tower_weights_per_token(cfg, "search") * sum(search)
    want += 6 * F.weights_per_example(cfg) * 4
    want += 3 * 4 * 2 * 16 * (float((w * w / 2).sum()) * 2 + float(pairs_search.sum()) * 1)
    want += 3 * 4 * 2 * 16 * cfg.num_query_tokens * (sum(watch) + sum(search))
    assert model.flops(batch) == round(want)
    assert F.tower_weights_per_token(cfg, "search") < F.tower_weights_per_token(cfg, "watch")  # one block fewer


def test_each_history_tower_sees_only_its_own_history(tmp_path):
    """An example's output depends on its own two histories: merging the towers' outputs keeps examples apart."""
    schema = Schema.from_dict(OURS)
    cfg = ModelConfig.from_dict({**tiny_dict(), "towers": {"search": {"num_blocks": 1}}}, schema)
    cfg.kernel = "reference"
    torch.manual_seed(0)
    model = GEMModel(cfg).eval()
    batch = SyntheticDataset(schema, seed=1, batch_size=5).batch(0)
    from tests.dist._common import slice_batch

    full = model(batch).logits
    for i in range(5):
        torch.testing.assert_close(model(slice_batch(batch, i, i + 1)).logits, full[i:i + 1], rtol=1e-5, atol=1e-5)
    # the searches reach the prediction: a different search history changes the output of a row that has one
    other = SyntheticDataset(schema, seed=2, batch_size=5).batch(0)
    assert not torch.allclose(model(other).logits, full)


def _bad(rows, column, row, value):
    rows = {k: list(v) for k, v in rows.items()}
    rows[column][row] = value
    return rows


@pytest.mark.parametrize("column,value,types,msg", [
    ("target_video", [3, 4], {"target_video": pa.list_(pa.int64())},
     r"feature 'target': a candidate has exactly one id \(got 2\)"),
    ("target_video", [], {"target_video": pa.list_(pa.int64())},
     r"feature 'target': a candidate has exactly one id \(got 0\)"),
    ("topic_ids", [1, 2, 3, 4], None, r"feature 'topics': more ids than max_hot=3 \(got 4\)"),
    ("user_vec", [0.5, 0.5], {"user_vec": pa.list_(pa.float32())},
     r"dense feature 'embedding': a list of 3 numbers is needed \(got 2\)"),
    ("seq_watch_bucket", [1], None, r"feature 'watch_secs': history 'watch' has \d+ events in 'watched' but 1 here"),
    ("seq_query", [1, 2, 3, 4], None,
     r"feature 'searched': history 'search' is longer than data.histories.search.max_len=3 \(got 4\)"),
    ("country_id", 7, None, r"feature 'country': id outside its table 'country' range \[0, 5\) \(got 7\)"),
])
def test_a_bad_row_is_named_by_file_row_and_feature(tmp_path, column, value, types, msg):
    schema = Schema.from_dict(OURS)
    rows = _rows()
    if column == "seq_watch_bucket":
        rows["seq_video"][6] = [1, 2, 3]
        rows["seq_watch_bucket"][6] = [1, 2, 3]
    if types:  # the list form of the column, one bad row
        rows[column] = [[v] if not isinstance(v, list) else v for v in rows[column]]
    p = _write(tmp_path / "bad.parquet", _bad(rows, column, 6, value), types)
    with pytest.raises(DataFileError) as e:
        ParquetDataset(schema, p, batch_size=4).batch(1)  # row 6 sits in a middle row group: read with its batch
    assert re.match(f"^{re.escape(p)}:6: {msg}", str(e.value)), str(e.value)
    assert "\n" not in str(e.value)


def test_fewer_ids_than_min_hot(tmp_path):
    d = {**OURS, "features": {**OURS["features"], "topics": {**OURS["features"]["topics"], "min_hot": 1}}}
    rows = _rows()
    rows["topic_ids"] = [x or [1] for x in rows["topic_ids"]]
    p = _write(tmp_path / "few.parquet", _bad(rows, "topic_ids", 5, []))
    with pytest.raises(DataFileError, match=f"^{re.escape(p)}:5: feature 'topics': fewer ids than min_hot=1 "
                                            r"\(got 0\)$"):
        ParquetDataset(Schema.from_dict(d), p, batch_size=4).batch(1)


@pytest.mark.parametrize("column,typ,msg", [
    ("seq_video", pa.list_(pa.float64()), "feature 'watched': column 'seq_video' must be a list of integers"),
    ("target_video", pa.string(), "feature 'target': column 'target_video' must be an integer or a list of integers"),
    ("price", pa.string(), "feature 'price': column 'price' must be numbers"),
    ("is_purchase", pa.string(), "label 'purchase': column 'is_purchase' must be numbers 0 or 1"),
])
def test_wrong_column_type_fails_on_opening(tmp_path, column, typ, msg):
    rows = _rows()
    rows[column] = [[float(v) for v in x] if isinstance(x, list) else str(x) for x in rows[column]]
    p = _write(tmp_path / "t.parquet", rows, {column: typ})
    with pytest.raises(DataFileError, match=f"^{re.escape(p)}: {re.escape(msg)}"):
        ParquetDataset(Schema.from_dict(OURS), p, batch_size=4)


def test_raw_ids_are_hashed_into_the_table(tmp_path):
    d = {**OURS, "tables": {**OURS["tables"], "video": {"num_embeddings": 50, "embedding_dim": 8, "ids": "raw",
                                                          "hash": "modulo"}}}
    rows = _rows()
    rows["target_video"] = [2**62 + 7 * i for i in range(ROWS)]
    rows["seq_video"] = [[-(10**12) - v for v in x] for x in rows["seq_video"]]
    batch = ParquetDataset(Schema.from_dict(d), _write(tmp_path / "raw.parquet", rows), batch_size=4).batch(0)
    assert batch.sequence["target"].values().tolist() == [(2**62 + 7 * i) % 50 for i in range(4)]
    assert batch.sequence["watched"].values().tolist() == [v % 50 for x in rows["seq_video"][:4] for v in x]
    assert all(v < 0 for x in rows["seq_video"] for v in x)
    # the same ids are refused by a table of dense ids
    with pytest.raises(DataFileError, match="id outside its table 'video' range"):
        ParquetDataset(Schema.from_dict(OURS), _write(tmp_path / "raw2.parquet", rows), batch_size=4)


def test_one_override_adds_or_deletes_a_feature():
    """Through Hydra's composition of the shipped configs, as `gem-train` composes them."""
    from gem.train.trainer import build_configs
    from tests.train._util import compose

    add = compose(["+data.features.age={kind: sparse, column: age_bucket, table: age}",
                   "+data.tables.age={num_embeddings: 10, embedding_dim: 8}"])
    cfgs = build_configs(add)
    assert cfgs.data.schema.sparse_names == ["user_segment", "context", "age"]
    assert cfgs.data.schema.feature["age"].column == "age_bucket" and cfgs.model.num_query_tokens == 6
    shared = build_configs(compose(["+data.features.region={kind: sparse, table: user_segment}"]))
    assert {t.name: t.features for t in shared.data.schema.embedding_tables}["user_segment"] == (
        "user_segment", "region")
    gone = build_configs(compose(["~data.features.context", "~data.tables.context"]))
    assert gone.data.schema.sparse_names == ["user_segment"] and "context" not in gone.data.schema.table
    gone = build_configs(compose(["~data.features.hist_action", "~data.tables.action", "data.synthetic.action=null"]))
    assert gone.model.sequence_features == ["hist_item"]
    # deleting a feature alone leaves its table unused: one line says what to delete too
    with pytest.raises(ValueError, match=r"^data.tables.context: no feature uses this table \(delete it too: "
                                         r"~data.tables.context, or"):
        build_configs(compose(["~data.features.context"]))


def test_a_data_group_keeps_its_batch_size_under_the_default_experiment(tmp_path):
    """The default experiment (tiny_cpu) applies under every data group: it must not replace the group's own
    batch_size / eval_batches."""
    from gem.train.trainer import build_configs
    from tests.train._util import compose

    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "ours.yaml").write_text("defaults: [synthetic, _self_]\nbatch_size: 48\neval_batches: 3\n")
    for extra in ([], ["experiment=tiny_cpu"]):
        cfgs = build_configs(compose([f"hydra.searchpath=[file://{tmp_path}]", "data=ours", *extra]))
        assert (cfgs.data.batch_size, cfgs.data.eval_batches) == (48, 3), extra


def test_a_model_setting_naming_a_missing_task_is_refused():
    from gem.train.trainer import build_configs
    from tests.train._util import compose

    with pytest.raises(ValueError, match=r"^model.heads.weights.like: no such task in data.labels \(click, "
                                         r"conversion\)"):
        build_configs(compose(["+model.heads.weights={like: 2.0}"]))


def test_data_config_reads_the_declaration():
    cfg = DataConfig.from_dict({"source": "parquet", "paths": ["x.parquet"], **OURS})
    assert cfg.schema.tasks == ("click", "purchase") and cfg.schema.num_dense == 4
    assert cfg.schema.unpooled_names == ["watched", "watch_secs", "searched", "target"]


def test_check_reads_a_config_dir_and_the_files_columns(tmp_path, capsys):
    """`gem-train --check --config-dir DIR data=ours`: the declaration, then each file's columns and types; a
    `data.paths` that matches nothing is one line, exit 2."""
    import yaml

    from gem.train.__main__ import main

    (tmp_path / "conf" / "data").mkdir(parents=True)
    good = _write(tmp_path / "good.parquet", _rows())
    rows = _rows()
    rows["price"] = [str(v) for v in rows["price"]]
    bad = _write(tmp_path / "bad.parquet", rows, {"price": pa.string()})
    (tmp_path / "conf" / "data" / "ours.yaml").write_text(yaml.safe_dump(
        {"source": "parquet", "paths": [good], "eval_paths": [good], "batch_size": 4, **OURS}))
    # the default experiment (tiny_cpu) sets its own batch size; 12 rows need a smaller one
    base = ["--check", "--config-dir", str(tmp_path / "conf"), "data=ours", "data.batch_size=4"]
    assert main(base) == 0
    assert capsys.readouterr().out.strip() == "gem-train: config ok"
    assert main([*base, f"data.eval_paths=[{bad}]"]) == 2
    assert capsys.readouterr().err.strip() == (f"gem-train: error: {bad}: feature 'price': column 'price' must be "
                                               "numbers (got string)")
    assert main([*base, f"data.paths=[{tmp_path}/nothing-*.parquet]"]) == 2
    assert capsys.readouterr().err.strip() == (f"gem-train: error: data.paths: no file matches (got "
                                               f"{tmp_path}/nothing-*.parquet)")
    assert main([*base, "+model.heads.weights={like: 2.0}"]) == 2
    assert capsys.readouterr().err.strip().startswith("gem-train: error: model.heads.weights.like: no such task")


def test_two_ranks_train_like_one_on_two_histories(tmp_path):
    """The declaration above (two histories, a shared item table, a dense list) on 2 gloo ranks, each on its half of
    the same global batches: the losses and first-step dense gradients of 1 rank on the whole batches."""
    import json

    from tests.dist._common import torchrun
    from tests.dist.test_parallel_dist import assert_parity

    args = ["--data", json.dumps({"source": "synthetic", **OURS}), "--sparse-opt", "sgd", "--lr", "0.5",
            "--steps", "2"]
    one = torchrun("run_train.py", 1, args, tmp_path)
    two = torchrun("run_train.py", 2, [*args, "--parallel", json.dumps({"dense": "ddp"})], tmp_path)
    assert_parity(one, two)
    assert set(one["plan"]) == {"video", "watch_bucket", "query", "country", "topic"}


def _timed() -> dict:
    d = {**OURS, "histories": {"watch": {"max_len": 6, "timestamp": "ts_watch"},
                               "search": {"max_len": 3, "timestamp": "ts_search"}}}
    return d


def _timed_rows(seed: int = 0) -> tuple[dict, dict]:
    rows = _rows(seed)
    rng = np.random.default_rng(seed + 100)
    rows["ts_watch"] = [np.sort(rng.integers(0, 20, len(x))).astype(float).tolist() for x in rows["seq_video"]]
    rows["ts_search"] = [np.sort(rng.integers(0, 20, len(x))).astype(float).tolist() for x in rows["seq_query"]]
    return rows, {"ts_watch": pa.list_(pa.float64()), "ts_search": pa.list_(pa.float64())}


def test_histories_merged_by_time_under_one_tower(tmp_path):
    schema = Schema.from_dict(_timed())
    rows, types = _timed_rows()
    batch = ParquetDataset(schema, _write(tmp_path / "t.parquet", rows, types), batch_size=4).batch(0)
    validate_batch(batch, schema)
    assert [t.tolist() for t in batch.history_times] == [[v for x in rows[c][:4] for v in x]
                                                         for c in ("ts_watch", "ts_search")]
    cfg = ModelConfig.from_dict({**tiny_dict(), "history_merge": "time"}, schema)
    cfg.kernel = "reference"
    torch.manual_seed(0)
    model = GEMModel(cfg)
    assert model.tower_spans == [(0, 2)] and list(model.final_norms) == ["merged"]
    # the merge puts every example's events in time order (ties: watch before search), examples one after another
    from gem.model.gem import merge_by_time

    xs = [torch.arange(int(o[-1]), dtype=torch.float64)[:, None] + 1000 * i for i, o in enumerate(batch.history_offsets)]
    got = merge_by_time(xs, batch.history_offsets, batch.history_times)[:, 0].tolist()
    want = []
    for b in range(4):
        events = []
        for i, (o, t) in enumerate(zip(batch.history_offsets, batch.history_times)):
            events += [(float(t[k]), i, k) for k in range(int(o[b]), int(o[b + 1]))]
        want += [1000 * i + k for _, i, k in sorted(events)]
    assert got == want
    out = model(batch)
    (out.logits.sum() + out.aux_loss).backward()
    assert all(p.grad is not None for n, p in model.named_parameters() if not n.startswith("ebc"))
    # one tower's attention over the summed lengths; every token through its history's input projection
    from gem.model import flops as F

    lengths = batch.seq_offsets.diff()
    t = cfg.tower_for()
    tokens = [int(o[-1]) for o in batch.history_offsets]
    want_flops = sum(6 * F.tower_weights_per_token(cfg, h) * n for h, n in zip(cfg.histories, tokens))
    want_flops += 6 * F.weights_per_example(cfg) * 4
    want_flops += 3 * 4 * t.num_heads * t.head_dim * float((lengths.double() ** 2 / 2).sum()) * t.num_blocks
    want_flops += 3 * 4 * cfg.interaction.num_heads * cfg.interaction_head_dim * cfg.num_query_tokens * sum(tokens)
    assert model.flops(batch) == round(want_flops)
    # the synthetic source fills the times for the same declaration
    syn = SyntheticDataset(schema, seed=0, batch_size=6).batch(0)
    validate_batch(syn, schema)
    assert model(syn).logits.shape == (6, 2)


def test_merging_needs_every_timestamp_and_timestamps_oldest_first(tmp_path):
    with pytest.raises(ValueError, match=r"^model.history_merge: merging by time needs a timestamp column"):
        ModelConfig.from_dict({**tiny_dict(), "history_merge": "time"}, Schema.from_dict(OURS))
    half = {**OURS, "histories": {"watch": {"max_len": 6, "timestamp": "ts_watch"}, "search": {"max_len": 3}}}
    with pytest.raises(ValueError, match=r"^data.histories.watch.timestamp: give every history a timestamp column"):
        Schema.from_dict(half)
    rows, types = _timed_rows()
    k = next(i for i, x in enumerate(rows["ts_watch"]) if len(x) >= 2 and x[0] < x[-1] and i >= 4)
    rows["ts_watch"][k] = rows["ts_watch"][k][::-1]
    p = _write(tmp_path / "late.parquet", rows, types)
    with pytest.raises(DataFileError, match=f"^{re.escape(p)}:{k}: history 'watch': timestamps in 'ts_watch' must be "
                                            "finite and oldest first"):
        ParquetDataset(Schema.from_dict(_timed()), p, batch_size=4).batch(k // 4)


def test_plan_counts_each_history_on_its_own_tower():
    """gem plan's workload and memory from the same declaration: tokens and ids per history, activations of each
    history's tokens through its own tower."""
    from gem.parallel.dims import ParallelConfig
    from gem.plan import comm
    from gem.plan.memory import activation_bytes_per_token, dense_memory, fsdp_units

    schema = Schema.from_dict(OURS)
    cfg = ModelConfig.from_dict({**tiny_dict(), "towers": {"search": {"num_blocks": 0}}}, schema)
    assert activation_bytes_per_token(cfg, 4, history="search") < activation_bytes_per_token(cfg, 4, history="watch")
    par = ParallelConfig.from_any({"dense": "ddp"})
    units = fsdp_units(cfg)
    both = dense_memory(units, cfg, par, {"watch": 100, "search": 40}, 4).activations
    assert both == int(100 * activation_bytes_per_token(cfg, 4, history="watch")
                       + 40 * activation_bytes_per_token(cfg, 4, history="search"))
    ids = comm.expected_ids_per_example(schema, {"watch": 3.0, "search": 1.5})
    assert ids == {"watched": 3.0, "watch_secs": 3.0, "searched": 1.5, "target": 1.0, "country": 1.0, "topics": 1.5}
