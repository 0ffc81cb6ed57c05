import re

import pytest
from omegaconf import OmegaConf

from gem.data import DataConfig, DataSchema, HistoryConfig, build_dataset
from tests.data._util import schema_dict


def test_default_config_parses_and_builds():
    cfg = OmegaConf.load("configs/data/synthetic.yaml")
    dc = DataConfig.from_dict(cfg)
    s = dc.schema
    assert s.num_items == 10000 and s.tasks == ("click", "conversion") and s.num_dense == 8
    assert s.cardinalities()["hist_item"] == s.cardinalities()["cand_item"] == 10000
    assert len(s.sparse_features) == 3 and s.history.max_len == 64
    ds = build_dataset(cfg, rank=1, world_size=2, split="eval")
    assert ds.rank == 1 and ds.world_size == 2 and len(ds) == dc.eval_batches
    b = ds.batch(0)
    assert b.batch_size == dc.batch_size and b.labels.shape == (dc.batch_size, 2)


def test_parquet_config_parses():
    cfg = OmegaConf.load("configs/data/parquet.yaml")
    dc = DataConfig.from_dict(cfg)
    assert dc.source == "parquet" and dc.paths and dc.schema.num_items == 10000


@pytest.mark.parametrize(
    "where,path,key",
    [
        ("data", (), "bogus"),
        ("data.schema", ("schema",), "num_itemz"),
        ("data.schema.history", ("schema", "history"), "maxlen"),
        ("data.schema.sparse_features[1]", ("schema", "sparse_features", 1), "maxhot"),
        ("data.schema.sequence_features[0]", ("schema", "sequence_features", 0), "cardinality"),
    ],
)
def test_unknown_key_is_named(where, path, key):
    d = {"source": "synthetic", "seed": 0, "batch_size": 4, "schema": schema_dict()}
    node = d
    for p in path:
        node = node[p]
    node[key] = 1
    with pytest.raises(ValueError, match=re.escape(f"{where}.{key}: unknown key (expected one of")):
        DataConfig.from_dict(d)


@pytest.mark.parametrize(
    "mutate,match",
    [
        (lambda d: d["sequence_features"].pop(0), "must include 'hist_item'"),
        (lambda d: d["sparse_features"].pop(0), "must include 'cand_item'"),
        (lambda d: d["sparse_features"][0].update(num_embeddings=7),
         r"data.schema.sparse_features: 'cand_item' num_embeddings must equal num_items=\d+ \(got 7\)"),
        (lambda d: d["sparse_features"][0].update(max_hot=2), "'cand_item' must be one-hot"),
        (lambda d: d.update(tasks=["click"]), ">= 2 distinct task"),
        (lambda d: d["sparse_features"].append({"name": "hist_action", "num_embeddings": 3}), "declared twice"),
        (lambda d: d["sparse_features"].append({"name": "x"}),
         r"data.schema.sparse_features\[\d\].num_embeddings: missing required key \(got x\)"),
        (lambda d: d["history"].update(distribution="poisson"),
         r"^data.schema.history.distribution: must be uniform or lognormal \(got poisson\)$"),
        (lambda d: d["history"].update(max_len="long"),
         r"^data.schema.history.max_len: expected an integer \(got long\)$"),
        (lambda d: d.update(num_dense=-1), r"^data.schema.num_dense: must be >= 0 \(got -1\)$"),
        (lambda d: d["history"].update(min_len=30), "history.min_len"),
        (lambda d: d["history"].update(sparsity=1.0), "history.sparsity"),
    ],
)
def test_bad_schema_raises(mutate, match):
    d = schema_dict()
    mutate(d)
    with pytest.raises(ValueError, match=match):
        DataSchema.from_dict(d)


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
    h = HistoryConfig(max_len=max_len, min_len=min_len, sparsity=s)
    lo, hi = h.uniform_range()
    assert (lo, hi) == expected
    assert min_len <= lo <= hi <= max_len
