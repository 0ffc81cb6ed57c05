"""Random schemas and shapes: every generated batch is valid, consistent, and survives the Parquet layout."""

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from gem.data import DataSchema, SyntheticDataset, validate_batch
from gem.data.parquet import batch_to_table, table_to_batch
from tests.data._util import assert_batches_equal


@st.composite
def schemas(draw):
    max_len = draw(st.integers(1, 9))
    min_len = draw(st.integers(0, max_len))
    n_items = draw(st.integers(1, 50))
    history = {"max_len": max_len, "min_len": min_len}
    if draw(st.booleans()):
        history.update(distribution="uniform", sparsity=draw(st.floats(0.0, 0.95)))
    else:
        history.update(distribution="lognormal", mu=draw(st.floats(-1.0, 3.0)), sigma=draw(st.floats(0.0, 2.0)))
    seq = [{"name": "hist_item"}]
    if draw(st.booleans()):
        seq.append({"name": "hist_action", "num_embeddings": draw(st.integers(1, 5))})
    if draw(st.booleans()):
        seq.append({"name": "hist_extra", "num_embeddings": draw(st.integers(1, 5))})
    sparse = [{"name": "cand_item"}]
    for i in range(draw(st.integers(0, 3))):
        hi = draw(st.integers(1, 4))
        sparse.append(
            {
                "name": f"cat_{i}",
                "num_embeddings": draw(st.integers(1, 9)),
                "max_hot": hi,
                "min_hot": draw(st.integers(0, hi)),
            }
        )
    tasks = ["click", "conversion", "share"][: draw(st.integers(2, 3))]
    return DataSchema.from_dict(
        {
            "num_items": n_items,
            "zipf_alpha": draw(st.sampled_from([0.0, 0.8, 1.0, 1.5])),
            "num_dense": draw(st.integers(0, 3)),
            "tasks": tasks,
            "sequence_features": seq,
            "sparse_features": sparse,
            "history": history,
        }
    )


@settings(max_examples=40, deadline=None)
@given(schema=schemas(), bsz=st.integers(1, 9), seed=st.integers(0, 2**31), index=st.integers(0, 1000))
def test_generated_batches_are_valid_and_round_trip(schema, bsz, seed, index):
    b, truth = SyntheticDataset(schema, seed=seed, batch_size=bsz).batch(index, return_truth=True)
    validate_batch(b, schema)
    lengths = b.seq_lengths
    h = schema.history
    assert bool(((lengths >= h.min_len) & (lengths <= h.max_len)).all())
    if h.distribution == "uniform":
        lo, hi = h.uniform_range()
        assert bool(((lengths >= lo) & (lengths <= hi)).all())
    for f in schema.sparse_features:
        ln = b.sparse[f.name].lengths()
        assert bool(((ln >= f.min_hot) & (ln <= f.max_hot)).all())
    assert truth.shape == (bsz, schema.num_tasks) and bool(torch.isfinite(truth).all())
    assert_batches_equal(b, table_to_batch(batch_to_table(b, schema), schema))
