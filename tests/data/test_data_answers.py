"""The data layer's answers checked against plain references: the synthetic labels' true probabilities recomputed
from the batch's visible features, id ranges at their exact bounds, min_hot in batch validation, and the candidate
rows the training stream reports."""

from __future__ import annotations

import dataclasses
import math

import pyarrow as pa
import pytest
import torch
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from gem.data import SyntheticDataset, TrainBatches, validate_batch
from gem.data.parquet import DataFileError, batch_to_table, table_to_batch
from tests.data._util import make_schema

SCHEMA = make_schema(max_len=12)
P = 2_147_483_647


def _hash01(x: int, salt: int) -> float:
    """The synthetic source's fixed per-id hash, written out (float32 like the source)."""
    h = ((x % P) * 48_271 + salt) % P
    h = (h * 16_807 + 12_345) % P
    return float(torch.tensor(h / P, dtype=torch.float32))


def _truth(ds: SyntheticDataset, b) -> torch.Tensor:
    """P(click), P(conversion) per example from the module docstring's label model, example by example: taste = the
    history items' cluster vectors weighted by action weight * exp(-(events after it) / tau), the newest weighing
    most."""
    w = ds.world
    inv = pow(w.perm_a, -1, w.n)

    def cluster(item_id: int) -> tuple[int, int]:
        rank = ((item_id - w.perm_b) * inv) % w.n
        return rank, rank % w.k

    items, actions, cand = (b.sequence[k] for k in ("hist_item", "hist_action", "cand_item"))
    off = b.seq_offsets.tolist()
    out = []
    for e in range(b.batch_size):
        ids = items.values()[off[e]:off[e + 1]].tolist()
        acts = actions.values()[off[e]:off[e + 1]].tolist()
        taste = torch.zeros(w.dim, dtype=torch.float64)
        total = 0.0
        for j, (item, a) in enumerate(zip(ids, acts)):
            weight = float(w.action_weight[a]) * math.exp(-(len(ids) - 1 - j) / w.recency_tau)
            taste += weight * w.centers[cluster(item)[1]].double()
            total += weight
        if total:
            taste /= total
        rank, c = cluster(int(cand.values()[e]))
        affinity = float(taste @ w.centers[c].double())
        sparse = 0.0
        for f in ("user_segment", "context"):
            jt = b.sparse[f]
            o = jt.offsets().tolist()
            vals = jt.values()[o[e]:o[e + 1]].tolist()
            effects = [w.sparse_scale * (2 * _hash01(v, w.sparse_salts[f]) - 1) for v in vals]
            sparse += sum(effects) / max(len(vals), 1)
        dense = b.dense[e].double() @ w.dense_w.double().T
        popularity = 0.5 - math.log1p(rank) / math.log1p(w.n)
        logit = w.affinity_scale * affinity + popularity + sparse + float(dense[0]) + float(w.task_bias[0])
        p0 = 1 / (1 + math.exp(-logit))
        p1 = p0 / (1 + math.exp(-(float(w.task_bias[1]) + affinity + float(dense[1]))))
        out.append([p0, p1])
    return torch.tensor(out, dtype=torch.float64)


def test_synthetic_truth_is_the_label_model_on_the_visible_features():
    ds = SyntheticDataset(SCHEMA, seed=5, batch_size=16)
    b, truth = ds.batch(2, return_truth=True)
    assert int(b.seq_lengths.max()) >= 4  # histories long enough for the recency decay to matter
    torch.testing.assert_close(truth.double(), _truth(ds, b), rtol=0, atol=2e-5)


def _ids_table(b, column: str, row: int, value):
    t = batch_to_table(b, SCHEMA)
    values = t.column(column).to_pylist()
    values[row] = value
    return t.set_column(t.column_names.index(column), column, pa.array(values, t.schema.field(column).type))


@pytest.mark.parametrize("column,table,size,row", [("cand_item", "item", 500, 5),
                                                   ("user_segment", "user_segment", 20, 2)])
def test_reader_refuses_the_first_id_past_the_table_and_keeps_the_last_inside(column, table, size, row):
    b = SyntheticDataset(SCHEMA, seed=0, batch_size=8).batch(0)
    plain = column == "cand_item"  # an integer column; user_segment is a list of one id
    last = table_to_batch(_ids_table(b, column, row, size - 1 if plain else [size - 1]), SCHEMA)
    kjt = last.sequence if plain else last.sparse
    assert kjt[column].values()[row] == size - 1
    with pytest.raises(DataFileError, match=rf"^parquet row {row}: feature '{column}': id outside its table "
                                            rf"'{table}' range \[0, {size}\) \(got {size}\)$"):
        table_to_batch(_ids_table(b, column, row, size if plain else [size]), SCHEMA)


def _with_sparse(b, per_key: dict[str, list[list[int]]]):
    """The batch with its sparse features replaced by these ids per example."""
    keys = list(b.sparse.keys())
    values = [v for k in keys for ex in per_key[k] for v in ex]
    lengths = [len(ex) for k in keys for ex in per_key[k]]
    sparse = KeyedJaggedTensor(keys=keys, values=torch.tensor(values, dtype=torch.int64),
                               lengths=torch.tensor(lengths, dtype=torch.int64))
    return dataclasses.replace(b, sparse=sparse)


def test_validation_refuses_fewer_ids_than_min_hot():
    b = SyntheticDataset(SCHEMA, seed=0, batch_size=6).batch(0)
    ids = {}
    for key, jt in b.sparse.to_dict().items():
        o = jt.offsets().tolist()
        ids[key] = [jt.values()[o[e]:o[e + 1]].tolist() for e in range(b.batch_size)]
    ids["context"][0] = []  # context: min_hot 0, an empty example is valid
    validate_batch(_with_sparse(b, ids), SCHEMA)
    ids["user_segment"][2] = []  # user_segment: min_hot 1
    with pytest.raises(ValueError, match=r"^sparse feature 'user_segment': 0 ids at example 2, outside "
                                         r"\[min_hot=1, max_hot=1\]$"):
        validate_batch(_with_sparse(b, ids), SCHEMA)


def test_train_stream_counts_a_request_batch_by_its_candidates():
    ds = SyntheticDataset(SCHEMA, seed=4, batch_size=8, max_candidates=4)
    want = []
    for i in range(3):
        b = ds.batch(i)
        counts = b.sequence["cand_item"].lengths().tolist()  # candidate ids per request
        want.append(sum(counts))
    assert all(n > 8 for n in want)  # more candidates than requests: the two counts differ
    it = TrainBatches(ds, SCHEMA, lambda b: 0.0, position=0, first_step=0)
    for _ in range(3):
        next(it)
    assert list(it.samples) == want
