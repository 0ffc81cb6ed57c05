"""Random declarations and shapes: every generated batch is valid, consistent, and survives the Parquet layout."""

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from gem.data import Schema, SyntheticDataset, validate_batch
from gem.data.parquet import batch_to_table, table_to_batch
from tests.data._util import assert_batches_equal


@st.composite
def schemas(draw):
    """Any declaration: 1-3 histories of their own length laws, features on shared or own tables, candidate
    attributes, multi-hot sparse features, dense numbers and lists, 1-3 tasks."""
    dim = draw(st.sampled_from([4, 8]))
    tables = {"item": {"num_embeddings": draw(st.integers(1, 50)), "embedding_dim": dim}}
    features, histories = {}, {}
    for h in range(draw(st.integers(1, 3))):
        max_len = draw(st.integers(1, 9))
        law = {"max_len": max_len, "min_len": draw(st.integers(0, max_len))}
        if draw(st.booleans()):
            law.update(distribution="uniform", sparsity=draw(st.floats(0.0, 0.95)))
        else:
            law.update(distribution="lognormal", mu=draw(st.floats(-1.0, 3.0)), sigma=draw(st.floats(0.0, 2.0)))
        histories[f"h{h}"] = law
        own = f"t_h{h}"
        # at least one feature per history: the item table, the history's own table or a candidate attribute's
        for k, table in enumerate(draw(st.lists(st.sampled_from(["item", own, "attr"]), min_size=1, max_size=3))):
            features[f"seq_{h}_{k}"] = {"kind": "sequence", "table": table, "history": f"h{h}"}
            if table == own:
                tables[own] = {"num_embeddings": draw(st.integers(1, 5)), "embedding_dim": dim}
    features["cand"] = {"kind": "candidate", "table": "item", "column": draw(st.sampled_from(["cand", "target"]))}
    if any(f["table"] == "attr" for f in features.values()) or draw(st.booleans()):
        tables["attr"] = {"num_embeddings": draw(st.integers(1, 7)), "embedding_dim": dim}
        features["cand_attr"] = {"kind": "candidate", "table": "attr"}
    for i in range(draw(st.integers(0, 3))):
        hi = draw(st.integers(1, 4))
        tables[f"cat_{i}"] = {"num_embeddings": draw(st.integers(1, 9)), "embedding_dim": draw(st.sampled_from([2, 4])),
                              "pooling": draw(st.sampled_from(["sum", "mean"]))}
        features[f"cat_{i}"] = {"kind": "sparse", "table": f"cat_{i}", "max_hot": hi,
                                "min_hot": draw(st.integers(0, hi))}
    for i in range(draw(st.integers(0, 2))):
        features[f"num_{i}"] = {"kind": "dense", "size": draw(st.integers(1, 3))}
    tasks = ["click", "conversion", "share"][: draw(st.integers(1, 3))]
    action = next((n for n, f in features.items() if f["kind"] == "sequence" and f["table"] != "item"), None)
    return Schema.from_dict({
        "features": features, "histories": histories, "labels": {t: f"label_{t}" for t in tasks}, "tables": tables,
        "synthetic": {"zipf_alpha": draw(st.sampled_from([0.0, 0.8, 1.0, 1.5])),
                      "action": action if draw(st.booleans()) else None},
    })


@settings(max_examples=40, deadline=None)
@given(schema=schemas(), bsz=st.integers(1, 9), seed=st.integers(0, 2**31), index=st.integers(0, 1000))
def test_generated_batches_are_valid_and_round_trip(schema, bsz, seed, index):
    b, truth = SyntheticDataset(schema, seed=seed, batch_size=bsz).batch(index, return_truth=True)
    validate_batch(b, schema)
    total = torch.zeros(bsz, dtype=torch.int64)
    for h, off in zip(schema.histories, b.history_offsets):
        lengths = off[1:] - off[:-1]
        total += lengths
        assert bool(((lengths >= h.min_len) & (lengths <= h.max_len)).all())
        if h.distribution == "uniform":
            lo, hi = h.uniform_range()
            assert bool(((lengths >= lo) & (lengths <= hi)).all())
        for n in schema.history_features(h.name):
            assert torch.equal(b.sequence[n].lengths(), lengths)
    assert torch.equal(b.seq_lengths, total)
    for f in schema.of_kind("sparse"):
        ln = b.sparse[f.name].lengths()
        assert bool(((ln >= f.min_hot) & (ln <= f.max_hot)).all())
    for n in schema.candidate_names:
        assert bool((b.sequence[n].lengths() == 1).all())
    assert b.dense.shape == (bsz, schema.num_dense)
    assert truth.shape == (bsz, schema.num_tasks) and bool(torch.isfinite(truth).all())
    assert_batches_equal(b, table_to_batch(batch_to_table(b, schema), schema))
