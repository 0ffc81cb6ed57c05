"""data.balance: the equal-count partition, row selection, the balanced stream and the zipf length law."""

from __future__ import annotations

import itertools
import time

import numpy as np
import pytest
import torch

from gem.data import SyntheticDataset, build_dataset, validate_batch
from gem.data.balance import (
    BalancedDataset,
    concat_batches,
    example_lengths,
    imbalance,
    partition,
    take_rows,
)
from gem.data.synthetic import sample_lengths
from tests.data._util import assert_batches_equal, make_schema, schema_dict

SCHEMA = make_schema(max_len=16)
NAMES = SCHEMA.history_names


def _heavy(rng, n):
    """Costs with a heavy tail, like FLOPs of Zipf-long histories (dense + quadratic attention)."""
    L = np.floor(rng.pareto(1.0, n) * 40 + 1).clip(max=4096)
    return 1e3 * L + L * L


def _optimal_max(c: np.ndarray, parts: int) -> float:
    """Brute force: the smallest largest part over every split into equal counts."""
    m = len(c) // parts

    def splits(items):
        if len(items) == m:
            yield [items]
            return
        for comb in itertools.combinations(items[1:], m - 1):
            group = (items[0], *comb)
            rest = tuple(i for i in items if i not in group)
            for r in splits(rest):
                yield [group, *r]

    return min(max(c[list(g)].sum() for g in s) for s in splits(tuple(range(len(c)))))


@pytest.mark.parametrize("n,parts", [(0, 3), (1, 1), (6, 6), (12, 4), (1000, 8), (4096, 64), (2048, 512)])
def test_partition_equal_counts_and_deterministic(n, parts):
    c = _heavy(np.random.default_rng(n), n)
    p = partition(c, parts)
    assert p.shape == (n,) and p.dtype == np.int64
    assert np.array_equal(np.bincount(p, minlength=parts), np.full(parts, n // parts))
    assert np.array_equal(partition(c.copy(), parts), p)  # same input, same split
    assert np.array_equal(partition(c.tolist(), parts), p)


def test_partition_rejects_unequal_counts():
    with pytest.raises(ValueError, match="7 items do not split into 2 parts"):
        partition(np.ones(7), 2)
    with pytest.raises(ValueError):
        partition(np.ones(4), 0)


def test_partition_ties_and_zero_costs():
    p = partition(np.zeros(8), 4)  # every part as good: still equal counts, same answer each time
    assert np.array_equal(np.bincount(p), [2, 2, 2, 2]) and np.array_equal(p, partition(np.zeros(8), 4))
    assert imbalance(np.zeros(8), p, 4) == 1.0
    c = np.array([5.0, 5, 5, 5, 1, 1, 1, 1])
    assert imbalance(c, partition(c, 4), 4) == 1.0  # one 5 and one 1 per part


def test_partition_near_brute_force_optimum():
    rng = np.random.default_rng(7)
    ratios, none = [], []
    for t in range(60):
        parts, n = [(2, 8), (3, 9), (2, 10), (4, 8), (3, 12)][t % 5]
        c = _heavy(rng, n)
        opt = _optimal_max(c, parts)
        ratios.append(np.bincount(partition(c, parts), weights=c).max() / opt)
        none.append(np.bincount(np.repeat(np.arange(parts), n // parts), weights=c).max() / opt)
    ratios = np.array(ratios)
    assert ratios.min() >= 1 - 1e-12  # never better than optimal: the brute force is right
    assert ratios.max() <= 1.1 and ratios.mean() <= 1.01, (ratios.max(), ratios.mean())
    assert np.mean(none) > 1.1  # the batches as drawn are far from it


def _greedy_rounds(c: np.ndarray, parts: int) -> np.ndarray:
    """The rounds greedy written plainly: items by descending cost (ties by index), a round's j-th largest to the
    part with the j-th lowest load (ties by part id)."""
    order = sorted(range(len(c)), key=lambda i: (-c[i], i))
    load, out = [0.0] * parts, np.empty(len(c), dtype=np.int64)
    for k in range(0, len(c), parts):
        lightest = sorted(range(parts), key=lambda p: (load[p], p))
        for j, p in enumerate(lightest):
            out[order[k + j]] = p
            load[p] += c[order[k + j]]
    return out


def test_partition_is_the_rounds_greedy_then_swaps():
    rng = np.random.default_rng(3)
    for parts, m in ((2, 40), (3, 17), (8, 256), (40, 5)):
        c = _heavy(rng, parts * m)
        c[5:9] = c[5]  # ties
        # up to 256 rounds the parts' order is recomputed every round: the plain greedy exactly
        assert np.array_equal(partition(c, parts, max_swaps=0), _greedy_rounds(c, parts))
        swapped = partition(c, parts)
        assert imbalance(c, swapped, parts) <= imbalance(c, _greedy_rounds(c, parts), parts)
    # past 256 rounds (the small items: order refreshed 64 times) it stays as even as the plain greedy
    c = _heavy(rng, 2 * 3000)
    assert imbalance(c, partition(c, 2), 2) <= imbalance(c, _greedy_rounds(c, 2), 2) + 1e-6


@pytest.mark.parametrize("parts", [2, 8, 128, 512])
def test_partition_speed_16k(parts):
    c = _heavy(np.random.default_rng(0), 16384)
    ms = np.inf
    for _ in range(3):
        t0 = time.perf_counter()
        p = partition(c, parts)
        ms = min(ms, 1e3 * (time.perf_counter() - t0))
    # a few ms on an idle core; the bound leaves room for a busy test machine and still catches O(n^2)
    assert ms < 300, f"{ms:.1f} ms"
    assert imbalance(c, p, parts) < imbalance(c, np.arange(16384) % parts, parts)


def test_take_rows_and_concat_keep_every_example():
    ds = SyntheticDataset(SCHEMA, seed=1, batch_size=10)
    parts = [ds.batch(i) for i in range(3)]
    whole = concat_batches(parts)
    assert whole.batch_size == 30 and whole.max_seq_len == max(b.max_seq_len for b in parts)
    validate_batch(whole, SCHEMA)
    for i, b in enumerate(parts):
        assert_batches_equal(take_rows(whole, range(10 * i, 10 * i + 10)), b)
    # any order, any subset, the empty one: row r of the result is example rows[r]
    rows = [29, 0, 13, 13, 4]
    got = take_rows(whole, rows)
    for r, src in enumerate(rows):
        assert_batches_equal(take_rows(got, [r]), take_rows(whole, [src]))
        one = take_rows(whole, [src])
        assert one.max_seq_len == int(whole.seq_lengths[src])
    empty = take_rows(whole, [])
    assert empty.batch_size == 0 and empty.max_seq_len == 0 and empty.seq_offsets.tolist() == [0]


def _two_histories() -> dict:
    """Two histories with event times: `events` (item, action) and `search` (item ids), each its own lengths."""
    d = schema_dict(max_len=12, timestamp="ts_events")
    d["features"]["searched"] = {"kind": "sequence", "table": "item", "history": "search"}
    d["histories"]["search"] = {"max_len": 5, "min_len": 0, "timestamp": "ts_search"}
    return d


def _examples(batch) -> list[dict]:
    """Each example's contents by name: every unpooled and pooled feature's ids, every history's times, dense and
    labels (the reference the row operations are checked against)."""
    out = [{} for _ in range(batch.batch_size)]
    for kjt in (batch.sequence, batch.sparse):
        for key, jt in kjt.to_dict().items():
            off = jt.offsets().tolist()
            for i in range(batch.batch_size):
                out[i][key] = jt.values()[off[i]:off[i + 1]].tolist()
    for h, (o, t) in enumerate(zip(batch.history_offsets, batch.history_times)):
        for i in range(batch.batch_size):
            out[i][f"times{h}"] = t[int(o[i]):int(o[i + 1])].tolist()
    for i in range(batch.batch_size):
        out[i]["dense"], out[i]["labels"] = batch.dense[i].tolist(), batch.labels[i].tolist()
    return out


def test_rows_of_two_histories_keep_each_history_offsets_and_times():
    from gem.data import Schema

    schema = Schema.from_dict(_two_histories())
    ds = SyntheticDataset(schema, seed=3, batch_size=7)
    parts = [ds.batch(i) for i in range(3)]
    assert all(len(b.history_times) == 2 for b in parts)
    whole = concat_batches(parts)
    validate_batch(whole, schema)
    assert _examples(whole) == [e for b in parts for e in _examples(b)]
    assert whole.history_max_lens == tuple(max(m) for m in zip(*(b.history_max_lens for b in parts)))
    for rows in ([20, 0, 9, 9, 3], list(range(21))[::-1], [4]):
        got = take_rows(whole, rows)
        validate_batch(got, schema)
        want = _examples(whole)
        assert _examples(got) == [want[r] for r in rows]
        lengths = example_lengths(got, schema.history_names)
        assert list(lengths) == ["events", "search"]
        for h, name in enumerate(schema.history_names):
            assert lengths[name].tolist() == [len(want[r][f"times{h}"]) for r in rows]
    empty = take_rows(whole, [])
    assert empty.batch_size == 0 and [t.numel() for t in empty.history_times] == [0, 0]
    with pytest.raises(ValueError, match="the batch has 2 histories, the schema 1"):
        example_lengths(whole, ["events"])


def test_balanced_two_histories_cost_each_history_through_its_tower():
    from gem.model import ModelConfig
    from gem.model.flops import example_cost, example_flops
    from tests.model._batches import tiny_dict

    cfg = {"source": "synthetic", "seed": 6, "batch_size": 5, **_two_histories()}
    plain = [build_dataset({**cfg, "balance": "none"}, r, 2) for r in range(2)]
    schema = plain[0].schema
    model = ModelConfig.from_dict({**tiny_dict(), "towers": {"search": {"num_blocks": 1, "attention": "swa",
                                                                        "window": 2}}}, schema)
    shares = [build_dataset(cfg, r, 2, cost=example_cost(model)) for r in range(2)]
    whole = concat_batches([p.batch(1) for p in plain])
    _, part, costs = shares[0].split(1)
    lengths = example_lengths(whole, schema.history_names)
    assert np.array_equal(costs, example_flops(model, lengths).numpy())
    # the search tower is cheaper per token than the events tower: the same total length costs differently
    one = example_flops(model, {"events": torch.tensor([4, 0]), "search": torch.tensor([0, 4])})
    assert one[0] > one[1]
    got = [s.batch(1) for s in shares]
    for r, b in enumerate(got):
        validate_batch(b, schema)
        assert _examples(b) == [_examples(whole)[i] for i in np.flatnonzero(part == r)]


def _cost(lengths):
    L = sum(n.to(torch.float64) for n in lengths.values())
    return 10 * L + L * L


@pytest.mark.parametrize("world", [2, 3])
def test_balanced_shares_split_the_global_batch(world):
    cfg = {"source": "synthetic", "seed": 2, "batch_size": 8, **schema_dict(max_len=40)}
    shares = [build_dataset(cfg, r, world, cost=_cost) for r in range(world)]
    assert all(isinstance(s, BalancedDataset) for s in shares)
    plain = [build_dataset({**cfg, "balance": "none"}, r, world) for r in range(world)]
    for i in (0, 5):
        got = [s.batch(i) for s in shares]
        whole = concat_batches([p.batch(i) for p in plain])  # the step's examples as drawn, rank by rank
        part = partition(_cost(example_lengths(whole, NAMES)).numpy(), world)
        for r, b in enumerate(got):
            assert b.batch_size == 8
            validate_batch(b, shares[r].schema)
            assert_batches_equal(b, take_rows(whole, np.flatnonzero(part == r)))
        loads = [float(_cost(example_lengths(b, NAMES)).sum()) for b in got]
        drawn = [float(_cost(example_lengths(p.batch(i), NAMES)).sum()) for p in plain]
        assert max(loads) <= max(drawn)


def test_balanced_stream_position_and_resume():
    cfg = {"source": "synthetic", "seed": 2, "batch_size": 4, **schema_dict(max_len=40)}
    ds = build_dataset(cfg, 1, 2, cost=_cost)
    it = iter(ds)
    first = [next(it) for _ in range(3)]
    assert ds.state_dict()["batch_index"] == 3  # one position per step, as without balancing
    again = build_dataset(cfg, 1, 2, cost=_cost)
    again.load_state_dict({"batch_index": 2, "world_size": 2, "seed": 2})
    assert_batches_equal(next(iter(again)), first[2])
    for i, b in enumerate(first):
        assert_batches_equal(ds.batch(i), b)


def test_one_rank_and_eval_are_not_wrapped_and_cost_is_required():
    cfg = {"source": "synthetic", "batch_size": 4, **schema_dict()}
    assert isinstance(build_dataset(cfg, 0, 1, cost=_cost), SyntheticDataset)
    assert isinstance(build_dataset(cfg, 0, 2, split="eval"), SyntheticDataset)
    assert isinstance(build_dataset({**cfg, "balance": "none"}, 0, 2), SyntheticDataset)
    with pytest.raises(ValueError, match="data.balance=cost needs the model's cost"):
        build_dataset(cfg, 0, 2)


def test_balance_key_is_checked():
    from gem.config import ConfigError
    from gem.data import DataConfig

    with pytest.raises(ConfigError, match=r"^data.balance: must be none or cost \(got even\)$"):
        DataConfig.from_dict({"balance": "even", **schema_dict()})
    with pytest.raises(ConfigError, match=r"^data.histories.events.alpha: must be >= 0 \(got -1.0\)$"):
        DataConfig.from_dict(schema_dict(distribution="zipf", alpha=-1.0))


@pytest.mark.parametrize("lo,hi,alpha", [(0, 64, 1.0), (3, 50, 1.5), (1, 1, 1.0), (0, 4096, 0.0)])
def test_zipf_lengths_follow_the_law(lo, hi, alpha):
    schema = make_schema(max_len=hi, min_len=lo, distribution="zipf", alpha=alpha)
    n = 200_000
    L = sample_lengths(schema.histories[0], n, torch.Generator().manual_seed(0))
    first = max(lo, 1)
    assert L.min() >= first and L.max() <= hi and L.dtype == torch.int64
    k = torch.arange(first, hi + 1, dtype=torch.float64)
    pmf = (k - first + 1) ** -alpha
    pmf /= pmf.sum()
    mean = float((k * pmf).sum())
    assert float(L.double().mean()) == pytest.approx(mean, rel=0.02)
    freq = torch.bincount(L - first, minlength=hi - first + 1).double() / n
    assert torch.allclose(freq[:8], pmf[:8], atol=4 * float(pmf[0].sqrt()) / n**0.5)


def test_balanced_stream_through_dataloader_workers():
    from gem.data import TrainBatches

    cfg = {"source": "synthetic", "seed": 4, "batch_size": 4, **schema_dict(max_len=40)}
    ds = build_dataset(cfg, 1, 2, cost=_cost)
    want = [ds.batch(i) for i in range(3, 7)]
    batches = TrainBatches(build_dataset(cfg, 1, 2, cost=_cost), ds.schema, lambda b: 0.0, position=3, first_step=3,
                           num_workers=2)
    try:
        for w in want:
            assert_batches_equal(next(batches), w)
    finally:
        batches.close()


def test_rows_of_requests_carry_their_candidates():
    """Requests of 1..4 candidates: a request's candidate ids, labels and id travel with it through take_rows and
    concat_batches, and the cost counts its candidates."""
    ds = SyntheticDataset(SCHEMA, seed=3, batch_size=9, max_candidates=4)
    parts = [ds.batch(i) for i in range(2)]
    whole = concat_batches(parts)
    assert whole.num_requests == 18 and whole.batch_size == sum(b.batch_size for b in parts)
    for i, b in enumerate(parts):
        assert_batches_equal(take_rows(whole, range(9 * i, 9 * i + 9)), b)
    rows = [17, 0, 5, 5]
    got = take_rows(whole, rows)
    counts = (whole.cand_offsets[1:] - whole.cand_offsets[:-1])[rows]
    assert got.cand_offsets.tolist() == [0, *torch.cumsum(counts, 0).tolist()]
    assert got.max_candidates == int(counts.max())
    want = torch.cat([whole.labels[int(whole.cand_offsets[r]):int(whole.cand_offsets[r + 1])] for r in rows])
    assert torch.equal(got.labels, want)
    if whole.request_ids is not None:
        assert got.request_ids.tolist() == whole.request_ids[rows].tolist()
    for r, src in enumerate(rows):
        assert_batches_equal(take_rows(got, [r]), take_rows(whole, [src]))
