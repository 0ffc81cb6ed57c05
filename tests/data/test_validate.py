import dataclasses

import pytest
import torch
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from gem.data import SyntheticDataset, validate_batch
from tests.data._util import make_schema

SCHEMA = make_schema(max_len=12)


def _batch(bsz=6, seed=0):
    return SyntheticDataset(SCHEMA, seed=seed, batch_size=bsz).batch(0)


def _with_values(kjt: KeyedJaggedTensor, key: str, index: int, value: int) -> KeyedJaggedTensor:
    values = kjt.values().clone()
    start = kjt.offset_per_key()[list(kjt.keys()).index(key)]
    values[start + index] = value
    return KeyedJaggedTensor(keys=kjt.keys(), values=values, lengths=kjt.lengths())


def test_valid_batches_pass():
    for seed in range(5):
        validate_batch(_batch(seed=seed), SCHEMA)


@pytest.mark.parametrize(
    "kind,key,value,card",
    [
        ("sequence", "hist_item", 500, 500),
        ("sequence", "hist_action", -1, 4),
        ("sequence", "cand_item", 10**9, 500),
        ("sparse", "user_segment", 20, 20),
    ],
)
def test_id_out_of_range_names_feature_id_and_range(kind, key, value, card):
    b = _batch()
    kjt = getattr(b, kind)
    bad = dataclasses.replace(b, **{kind: _with_values(kjt, key, 0, value)})
    with pytest.raises(ValueError, match=rf"{kind} feature '{key}': id {value} at position 0 .*\[0, {card}\)"):
        validate_batch(bad, SCHEMA)


def test_negative_length():
    b = _batch()
    lengths = b.sparse.lengths().clone()
    n = b.batch_size
    # context is the second sparse key: move one id from example 1 to example 2 and make example 1 negative
    lengths[n + 1] = -1
    lengths[n + 2] += 1 + int(b.sparse["context"].lengths()[1])
    bad = dataclasses.replace(
        b, sparse=KeyedJaggedTensor(keys=b.sparse.keys(), values=b.sparse.values(), lengths=lengths)
    )
    with pytest.raises(ValueError, match="sparse feature 'context': negative length -1 at example 1"):
        validate_batch(bad, SCHEMA)


def test_sequence_lengths_inconsistent_between_keys():
    b = _batch()
    n = b.batch_size
    lengths = b.sequence.lengths().clone()
    i = int(torch.nonzero(lengths[n:] > 0)[0])
    lengths[n + i] -= 1
    lengths[n + i + 1 if i + 1 < n else n + i - 1] += 1
    bad = dataclasses.replace(
        b, sequence=KeyedJaggedTensor(keys=b.sequence.keys(), values=b.sequence.values(), lengths=lengths)
    )
    with pytest.raises(ValueError, match=rf"sequence feature 'hist_action': length \d+ at example {i} differs"):
        validate_batch(bad, SCHEMA)


def test_offsets_and_max_len_must_match_lengths():
    b = _batch()
    with pytest.raises(ValueError, match="max_seq_len"):
        validate_batch(dataclasses.replace(b, max_seq_len=b.max_seq_len + 1), SCHEMA)
    off = b.seq_offsets.clone()
    off[1:] += 1
    with pytest.raises(ValueError, match="seq_offsets"):
        validate_batch(dataclasses.replace(b, seq_offsets=off), SCHEMA)


def test_history_longer_than_schema_max_len():
    long_schema = make_schema(max_len=40)
    b = SyntheticDataset(long_schema, seed=0, batch_size=32).batch(0)
    assert b.max_seq_len > 12
    with pytest.raises(ValueError, match="exceeds data.histories.events.max_len=12"):
        validate_batch(b, SCHEMA)


@pytest.mark.parametrize("field", ["dense", "labels"])
@pytest.mark.parametrize("bad_value", [float("nan"), float("inf"), -float("inf")])
def test_non_finite_dense_and_labels(field, bad_value):
    b = _batch()
    t = getattr(b, field).clone()
    t[3, 1] = bad_value
    with pytest.raises(ValueError, match=rf"{field}: non-finite value .* at index \[3, 1\]"):
        validate_batch(dataclasses.replace(b, **{field: t}), SCHEMA)


def test_labels_not_binary():
    b = _batch()
    labels = b.labels.clone()
    labels[2, 1] = 0.5
    with pytest.raises(ValueError, match="labels: task 'conversion' has value 0.5 at example 2"):
        validate_batch(dataclasses.replace(b, labels=labels), SCHEMA)


def test_wrong_shapes():
    b = _batch()
    with pytest.raises(ValueError, match=r"dense: expected shape \[6, 4\]"):
        validate_batch(dataclasses.replace(b, dense=b.dense[:, :3]), SCHEMA)
    with pytest.raises(ValueError, match=r"labels: expected shape \[6, 2\]"):
        validate_batch(dataclasses.replace(b, labels=b.labels[:, :1]), SCHEMA)


def test_empty_batch():
    b = _batch()
    empty = dataclasses.replace(b, dense=torch.zeros(0, 4))
    with pytest.raises(ValueError, match="batch has no users"):
        validate_batch(empty, SCHEMA)


def test_unknown_and_missing_feature_names():
    b = _batch()
    seq = b.sequence
    renamed = KeyedJaggedTensor(keys=["hist_item", "hist_actoin"], values=seq.values(), lengths=seq.lengths())
    with pytest.raises(ValueError, match="sequence: unknown feature 'hist_actoin'"):
        validate_batch(dataclasses.replace(b, sequence=renamed), SCHEMA)
    n = b.batch_size
    only_item = KeyedJaggedTensor(keys=["hist_item"], values=seq["hist_item"].values(), lengths=seq.lengths()[:n])
    with pytest.raises(ValueError, match="sequence: missing feature 'hist_action'"):
        validate_batch(dataclasses.replace(b, sequence=only_item), SCHEMA)
    sp = b.sparse
    extra = KeyedJaggedTensor(
        keys=[*sp.keys(), "device"],
        values=torch.cat([sp.values(), torch.zeros(n, dtype=torch.int64)]),
        lengths=torch.cat([sp.lengths(), torch.ones(n, dtype=torch.int64)]),
    )
    with pytest.raises(ValueError, match="sparse: unknown feature 'device'"):
        validate_batch(dataclasses.replace(b, sparse=extra), SCHEMA)


def test_values_lengths_mismatch():
    b = _batch()
    sp = b.sparse
    short = KeyedJaggedTensor(keys=sp.keys(), values=sp.values()[:-1], lengths=sp.lengths())
    with pytest.raises(ValueError, match="sparse: .* values but the lengths sum to"):
        validate_batch(dataclasses.replace(b, sparse=short), SCHEMA)


def test_validation_is_cheap():
    import time

    s = make_schema(max_len=64)
    b = SyntheticDataset(s, seed=0, batch_size=256).batch(0)
    validate_batch(b, s)
    times = []
    for _ in range(20):
        t = time.perf_counter()
        validate_batch(b, s)
        times.append(time.perf_counter() - t)
    assert sorted(times)[10] < 0.005
