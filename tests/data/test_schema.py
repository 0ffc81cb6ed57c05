import re

import pytest
from omegaconf import OmegaConf

from gem.data import DataConfig, HistorySpec, Schema, build_dataset
from tests.data._util import schema_dict


def test_default_config_parses_and_builds():
    cfg = OmegaConf.load("configs/data/synthetic.yaml")
    dc = DataConfig.from_dict(cfg)
    s = dc.schema
    assert s.tasks == ("click", "conversion") and s.num_dense == 8
    assert s.cardinalities()["hist_item"] == s.cardinalities()["cand_item"] == 10000
    assert s.unpooled_names == ["hist_item", "hist_action", "cand_item"]
    assert s.sparse_names == ["user_segment", "context"] and s.history["events"].max_len == 64
    # one item table for the history and the candidate, in the EmbeddingCollection
    tables = {t.name: t for t in s.embedding_tables}
    assert tables["item"].features == ("hist_item", "cand_item") and tables["item"].kind == "sequence"
    assert tables["context"].kind == "bag" and tables["context"].pooling == "mean"
    ds = build_dataset(cfg, rank=1, world_size=2, split="eval")
    assert ds.rank == 1 and ds.world_size == 2 and len(ds) == dc.eval_batches
    b = ds.batch(0)
    assert b.batch_size == dc.batch_size and b.labels.shape == (dc.batch_size, 2)


def test_parquet_config_parses():
    cfg = OmegaConf.load("configs/data/parquet.yaml")
    cfg = OmegaConf.merge(OmegaConf.load("configs/data/synthetic.yaml"), {k: v for k, v in cfg.items()
                                                                          if k != "defaults"})
    dc = DataConfig.from_dict(cfg)
    assert dc.source == "parquet" and dc.paths and dc.schema.cardinalities()["cand_item"] == 10000


@pytest.mark.parametrize(
    "where,path,key",
    [
        ("data", (), "bogus"),
        ("data.histories.events", ("histories", "events"), "maxlen"),
        ("data.features.context", ("features", "context"), "maxhot"),
        ("data.tables.item", ("tables", "item"), "rows"),
        ("data.synthetic", ("synthetic",), "alpha"),
    ],
)
def test_unknown_key_is_named(where, path, key):
    d = {"source": "synthetic", "seed": 0, "batch_size": 4, **schema_dict()}
    node = d
    for p in path:
        node = node[p]
    node[key] = 1
    with pytest.raises(ValueError, match=re.escape(f"{where}.{key}: unknown key (expected one of")):
        DataConfig.from_dict(d)


def test_old_schema_key_says_what_it_became():
    with pytest.raises(ValueError, match=r"^data.schema: replaced by data.features, data.histories, data.labels "
                                         r"and data.tables"):
        DataConfig.from_dict({"source": "synthetic", "schema": {"num_items": 10}})


def _drop_feature(d, name):
    del d["features"][name]


@pytest.mark.parametrize(
    "mutate,match",
    [
        (lambda d: d["features"]["cand_item"].update(max_hot=2),
         r"^data.features.cand_item.max_hot: a candidate has exactly one id \(got \[1, 2\]\)$"),
        (lambda d: d["features"]["context"].update(min_hot=4),
         r"^data.features.context.min_hot: must be in \[0, max_hot=3\] \(got 4\)$"),
        (lambda d: d["features"]["context"].update(table="contexts"),
         (r"^data.features.context.table: no such table in data.tables \(action, context, item, user_segment\) "
          r"\(got contexts\)$")),
        (lambda d: d["tables"].update(unused={"num_embeddings": 3, "embedding_dim": 4}),
         r"^data.tables.unused: no feature uses this table"),
        (lambda d: d["features"]["user_segment"].update(table="item"),
         (r"^data.tables.item: features 'hist_item' \(sequence\) and 'user_segment' \(sparse\) need different "
          r"pooling")),
        (lambda d: d["tables"]["item"].update(pooling="mean"),
         r"^data.tables.item.pooling: the table of 'hist_item' \(sequence\) is not pooled \(got mean\)$"),
        (lambda d: d["tables"]["action"].update(embedding_dim=4),
         r"^data.tables: the tables of sequence and candidate features must share one embedding_dim"),
        (lambda d: d["features"]["hist_action"].update(history="searches"),
         r"^data.features.hist_action.history: must name one of data.histories \(events\) \(got searches\)$"),
        (lambda d: d["features"].update(x={"kind": "pooled", "table": "item"}),
         r"^data.features.x.kind: must be one of sequence, candidate, sparse, dense \(got pooled\)$"),
        (lambda d: d["features"]["dense"].update(size=0), r"^data.features.dense.size: must be >= 1 \(got 0\)$"),
        (lambda d: _drop_feature(d, "cand_item"), r"^data.features: at least one feature of kind 'candidate'"),
        (lambda d: d["labels"].update(like="hist_item"), r"^data.labels: a label column is also a feature's"),
        (lambda d: d["tables"]["item"].update(ids="raw"), r"^data.tables.item.hash: raw ids need a hash"),
        (lambda d: d["tables"]["item"].update(hash="zch"),
         r"^data.tables.item.hash: only ids: raw tables are hashed \(set ids: raw\) \(got zch\)$"),
        (lambda d: d["tables"]["item"].update(ids="raw", hash="modulo", zch_eviction_interval=2),
         r"^data.tables.item.zch_eviction_interval: only hash: zch tables take it \(got 2\)$"),
        (lambda d: d["tables"]["item"].update(ids="raw", hash="zch", zch_eviction_policy="fifo"),
         r"^data.tables.item.zch_eviction_policy: must be one of distance_lfu, lfu, lru \(got fifo\)$"),
        (lambda d: d["tables"]["item"].update(ids="raw", hash="zch", zch_eviction_interval=0),
         r"^data.tables.item.zch_eviction_interval: must be >= 1 \(training steps\) \(got 0\)$"),
        (lambda d: d["tables"]["item"].update(ids="raw", hash="zch", zch_eviction_interval="often"),
         r"^data.tables.item.zch_eviction_interval: expected an integer \(got often\)$"),
        (lambda d: d["tables"]["item"].update(ids="raw", hash="zch", zch_input_hash_size=100),
         r"^data.tables.item.zch_input_hash_size: must be in \[num_embeddings=500, 2\*\*63 - 1\] \(got 100\)$"),
        (lambda d: d["tables"]["item"].update(ids="raw", hash="zch", zch_input_hash_size=2**63),
         r"^data.tables.item.zch_input_hash_size: must be in \[num_embeddings=500, 2\*\*63 - 1\]"),
        (lambda d: d["tables"]["action"].update(ids="raw", hash="zch", num_embeddings=1),
         (r"^data.tables.action.num_embeddings: hash: zch keeps one row for ids not in the table: needs >= 2 "
          r"\(got 1\)$")),
        (lambda d: d["tables"]["item"].update(ids="raw", hash="cuckoo"),
         r"^data.tables.item.hash: must be modulo or zch \(got cuckoo\)$"),
        (lambda d: d["histories"]["events"].update(distribution="poisson"),
         r"^data.histories.events.distribution: must be uniform, lognormal or zipf \(got poisson\)$"),
        (lambda d: d["histories"]["events"].update(max_len="long"),
         r"^data.histories.events.max_len: expected an integer \(got long\)$"),
        (lambda d: d["histories"]["events"].update(min_len=30), "histories.events.min_len"),
        (lambda d: d["histories"]["events"].update(sparsity=1.0), "histories.events.sparsity"),
        (lambda d: d["histories"].update(searches={"max_len": 4}),
         r"^data.histories.searches: no sequence feature belongs to it"),
    ],
)
def test_bad_schema_raises_one_line(mutate, match):
    d = schema_dict()
    mutate(d)
    with pytest.raises(ValueError, match=match) as e:
        Schema.from_dict(d)
    assert "\n" not in str(e.value)


def test_a_null_feature_is_deleted_and_history_defaults_to_the_only_one():
    d = schema_dict()
    d["features"]["context"] = None
    d["tables"]["context"] = None
    del d["features"]["hist_action"]["history"]
    s = Schema.from_dict(d)
    assert s.sparse_names == ["user_segment"] and s.feature["hist_action"].history == "events"


@pytest.mark.parametrize(
    "max_len,min_len,s,expected",
    [
        (64, 0, 0.5, (0, 64)),
        (64, 1, 0.5, (1, 63)),
        (64, 0, 0.0, (64, 64)),
        (64, 0, 0.75, (0, 32)),
        (10, 0, 0.2, (6, 10)),
        (1, 0, 0.5, (0, 1)),
        (7, 7, 0.9, (7, 7)),
    ],
)
def test_uniform_range_matches_sparsity(max_len, min_len, s, expected):
    h = HistorySpec(max_len=max_len, min_len=min_len, sparsity=s)
    lo, hi = h.uniform_range()
    assert (lo, hi) == expected
    assert min_len <= lo <= hi <= max_len
