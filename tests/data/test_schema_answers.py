"""What a `data:` declaration means, checked against answers written out by hand: the columns each feature reads,
which embedding collection each table lands in, and every path entry matching a file."""

from __future__ import annotations

from types import SimpleNamespace

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from gem.config import ConfigError
from gem.data import DataConfig, Schema
from gem.data.parquet import ParquetDataset, check_files
from gem.data.schema import expand_paths
from gem.train.preflight import check_data
from tests.data._util import schema_dict

# a team's names: three features read a column of another name, one (country) the column of its own name
RENAMED = {
    "features": {
        "watched": {"kind": "sequence", "column": "seq_video", "table": "video"},
        "target": {"kind": "candidate", "column": "target_video", "table": "video"},
        "country": {"kind": "sparse", "table": "country"},
        "price": {"kind": "dense", "column": "price_usd"},
    },
    "histories": {"watch": {"max_len": 4}},
    "labels": {"click": "is_click"},
    "tables": {"video": {"num_embeddings": 50, "embedding_dim": 8},
               "country": {"num_embeddings": 5, "embedding_dim": 4}},
}


def _write_renamed(path, clicks=(1, 0, 0, 1)) -> str:
    cols = {
        "seq_video": pa.array([[1, 2], [], [3, 4, 5], [6]], pa.list_(pa.int64())),
        "target_video": pa.array([10, 11, 12, 13], pa.int64()),
        "country": pa.array([0, 4, 2, 1], pa.int64()),
        "price_usd": pa.array([0.5, 1.5, 2.5, 3.5], pa.float64()),
        "is_click": pa.array(list(clicks), pa.int8()),
    }
    pq.write_table(pa.table(cols), path)
    return str(path)


def test_each_feature_reads_its_declared_column(tmp_path):
    s = Schema.from_dict(RENAMED)
    assert {f.name: f.column for f in s.features} == {
        "watched": "seq_video", "target": "target_video", "country": "country", "price": "price_usd"}
    b = ParquetDataset(s, _write_renamed(tmp_path / "t.parquet"), batch_size=4).batch(0)
    assert b.sequence["watched"].values().tolist() == [1, 2, 3, 4, 5, 6]
    assert b.sequence["watched"].lengths().tolist() == [2, 0, 3, 1]
    assert b.sequence["target"].values().tolist() == [10, 11, 12, 13]
    assert b.sparse["country"].values().tolist() == [0, 4, 2, 1]
    assert b.dense.flatten().tolist() == [0.5, 1.5, 2.5, 3.5]
    assert b.labels.flatten().tolist() == [1.0, 0.0, 0.0, 1.0]


def _own_candidate_table(dim: int) -> dict:
    d = schema_dict()
    d["features"]["cand_item"]["table"] = "cand"
    d["tables"]["cand"] = {"num_embeddings": 30, "embedding_dim": dim}
    return d


def test_a_table_only_a_candidate_uses_is_unpooled():
    # a candidate is one token of the sequence input: its table sits in the EmbeddingCollection, never in a bag
    tables = {t.name: t for t in Schema.from_dict(_own_candidate_table(8)).embedding_tables}
    assert tables["cand"].kind == "sequence" and tables["cand"].features == ("cand_item",)
    assert tables["item"].kind == "sequence" and tables["item"].features == ("hist_item",)
    assert tables["context"].kind == "bag" and tables["user_segment"].kind == "bag"
    # so it must share the history tables' embedding_dim (8), and takes no pooling
    with pytest.raises(ConfigError, match="share one embedding_dim"):
        Schema.from_dict(_own_candidate_table(4))
    pooled = _own_candidate_table(8)
    pooled["tables"]["cand"]["pooling"] = "mean"
    with pytest.raises(ConfigError, match="is not pooled"):
        Schema.from_dict(pooled)


def test_every_path_entry_must_match_a_file(tmp_path):
    for name in ("b.parquet", "a.parquet", "c.txt"):
        (tmp_path / name).write_bytes(b"")
    got = expand_paths([str(tmp_path / "*.parquet"), str(tmp_path / "c.txt")])
    assert got == [str(tmp_path / "a.parquet"), str(tmp_path / "b.parquet"), str(tmp_path / "c.txt")]
    for paths in ([str(tmp_path / "*.parquet"), str(tmp_path / "none-*.parquet")],
                  [str(tmp_path / "none-*.parquet"), str(tmp_path / "*.parquet")]):
        with pytest.raises(ConfigError, match="no file matches") as e:
            expand_paths(paths, "data.eval_paths")
        assert "data.eval_paths" in str(e.value) and "none-*.parquet" in str(e.value)


def test_check_refuses_a_second_glob_that_matches_nothing(tmp_path):
    good = _write_renamed(tmp_path / "t.parquet")
    ok = DataConfig.from_dict({"source": "parquet", "paths": [good], **RENAMED})
    check_files(ok)
    bad = DataConfig.from_dict({"source": "parquet", "paths": [good, str(tmp_path / "eval-*.parquet")], **RENAMED})
    with pytest.raises(ConfigError, match="no file matches") as e:
        check_files(bad)
    assert str(e.value).startswith("data.paths")


def test_a_sequence_feature_names_its_history_when_there_are_several():
    d = schema_dict()
    d["histories"]["searches"] = {"max_len": 8}
    d["features"]["query"] = {"kind": "sequence", "table": "action", "history": "searches"}
    s = Schema.from_dict(d)
    assert s.history_features("events") == ["hist_item", "hist_action"] and s.history_features("searches") == ["query"]
    del d["features"]["query"]["history"]  # which of the two: not guessed
    with pytest.raises(ConfigError, match=r"^data.features.query.history: must name one of data.histories "
                       r"\(events, searches\)"):
        Schema.from_dict(d)


def test_check_opens_the_eval_files_and_finds_a_bad_row(tmp_path):
    train = _write_renamed(tmp_path / "train.parquet")
    # same columns and types as declared: only reading the rows shows the label 2
    bad = _write_renamed(tmp_path / "eval.parquet", clicks=(1, 0, 2, 1))
    cfg = {"source": "parquet", "paths": [train], "eval_paths": [bad], "batch_size": 4, **RENAMED}
    check_files(DataConfig.from_dict(cfg))
    with pytest.raises(ValueError, match="label 'click'") as e:
        check_data(SimpleNamespace(data=DataConfig.from_dict({**cfg, "eval_batches": 1})))
    assert str(bad) in str(e.value)
    check_data(SimpleNamespace(data=DataConfig.from_dict({**cfg, "eval_batches": 0})))  # no evaluation: not read
