import math
import time

import pytest
import torch
from torch.utils.data import DataLoader

from gem.data import Batch, SyntheticDataset, validate_batch
from gem.data.synthetic import zipf_ranks
from tests.data._util import assert_batches_equal, auc, batches_equal, make_schema


def _take(ds, n):
    out = []
    for b in ds:
        out.append(b)
        if len(out) == n:
            break
    return out


def test_batches_are_valid_and_shaped():
    s = make_schema()
    ds = SyntheticDataset(s, seed=3, batch_size=37)
    for i in range(4):
        b = ds.batch(i)
        assert isinstance(b, Batch) and b.batch_size == 37
        validate_batch(b, s)
        lengths = b.seq_lengths
        assert list(b.sequence.keys()) == ["hist_item", "hist_action", "cand_item"]
        assert torch.equal(b.sequence["hist_item"].lengths(), lengths)
        assert torch.equal(b.sequence["hist_action"].lengths(), lengths)
        assert b.max_seq_len == int(lengths.max())
        assert torch.equal(b.sequence["cand_item"].lengths(), torch.ones(37, dtype=torch.int64))
        ctx = b.sparse["context"].lengths()
        assert int(ctx.min()) >= 0 and int(ctx.max()) <= 3
        assert b.dense.dtype == torch.float32 and b.labels.dtype == torch.float32
        # conversion happens only after a click
        assert bool((b.labels[:, 1] <= b.labels[:, 0]).all())


def test_same_seed_same_batches_different_seed_split_differ():
    s = make_schema()
    a = _take(SyntheticDataset(s, seed=1, batch_size=16), 3)
    b = _take(SyntheticDataset(s, seed=1, batch_size=16), 3)
    for x, y in zip(a, b):
        assert_batches_equal(x, y)
    c = SyntheticDataset(s, seed=2, batch_size=16).batch(0)
    e = SyntheticDataset(s, seed=1, batch_size=16, split="eval").batch(0)
    assert not batches_equal(a[0], c)
    assert not batches_equal(a[0], e)
    assert not batches_equal(a[0], a[1])


def test_rank_sharding_union_is_the_single_rank_stream():
    s = make_schema()
    single = _take(SyntheticDataset(s, seed=5, batch_size=8), 6)
    r0 = _take(SyntheticDataset(s, seed=5, batch_size=8, rank=0, world_size=2), 3)
    r1 = _take(SyntheticDataset(s, seed=5, batch_size=8, rank=1, world_size=2), 3)
    for i in range(3):
        assert not batches_equal(r0[i], r1[i])
        assert_batches_equal(r0[i], single[2 * i])
        assert_batches_equal(r1[i], single[2 * i + 1])


def test_resume_from_state_dict():
    s = make_schema()
    ds = SyntheticDataset(s, seed=7, batch_size=8)
    it = iter(ds)
    for _ in range(3):
        next(it)
    state = ds.state_dict()
    assert state["batch_index"] == 3
    expected = [next(it) for _ in range(3)]
    fresh = SyntheticDataset(s, seed=7, batch_size=8)
    fresh.load_state_dict(state)
    for x, y in zip(expected, _take(fresh, 3)):
        assert_batches_equal(x, y)


def test_resume_across_world_sizes():
    s = make_schema()
    # 2 ranks consumed 2 batches each = 4 global batches -> a single rank resumes at its batch 4.
    one = SyntheticDataset(s, seed=7, batch_size=8)
    one.load_state_dict({"batch_index": 2, "world_size": 2, "seed": 7})
    assert_batches_equal(next(iter(one)), SyntheticDataset(s, seed=7, batch_size=8).batch(4))
    three = SyntheticDataset(s, seed=7, batch_size=8, rank=0, world_size=3)
    with pytest.raises(ValueError, match="cannot resume 4 global batches"):
        three.load_state_dict({"batch_index": 2, "world_size": 2})
    with pytest.raises(ValueError, match="seed 9"):
        one.load_state_dict({"batch_index": 0, "seed": 9})


def test_finite_pass_rewinds_and_has_length():
    s = make_schema()
    ds = SyntheticDataset(s, seed=0, batch_size=4, split="eval", num_batches=3)
    first, second = list(ds), list(ds)
    assert len(ds) == 3 and len(first) == 3
    for x, y in zip(first, second):
        assert_batches_equal(x, y)


def test_dataloader_workers_keep_the_order():
    s = make_schema()
    ds = SyntheticDataset(s, seed=4, batch_size=8, num_batches=5)
    ref = list(ds)
    loaded = list(DataLoader(ds, batch_size=None, num_workers=2))
    assert len(loaded) == 5
    for x, y in zip(ref, loaded):
        assert_batches_equal(x, y)


@pytest.mark.parametrize("max_len,min_len,sparsity", [(64, 0, 0.5), (33, 1, 0.5), (20, 0, 0.8), (16, 0, 0.1)])
def test_uniform_lengths_hit_the_sparsity(max_len, min_len, sparsity):
    s = make_schema(max_len=max_len, min_len=min_len, sparsity=sparsity)
    ds = SyntheticDataset(s, seed=1, batch_size=512)
    lengths = torch.cat([ds.batch(i).seq_lengths for i in range(8)]).double()
    lo, hi = s.history["events"].uniform_range()
    assert int(lengths.min()) == lo and int(lengths.max()) == hi
    realised = 1 - lengths.mean() / max_len
    assert abs(float(realised) - sparsity) < 0.03
    # Discrete uniform: every value in [lo, hi] appears, with roughly equal frequency.
    counts = torch.bincount(lengths.long() - lo, minlength=hi - lo + 1).double()
    assert bool((counts > 0).all())
    expected = len(lengths) / (hi - lo + 1)
    assert float(counts.max()) < expected * 1.6 + 10 and float(counts.min()) > expected * 0.5 - 10


def test_empty_histories_and_all_empty_batch():
    s = make_schema(max_len=4, min_len=0, sparsity=0.5)
    b = SyntheticDataset(s, seed=0, batch_size=256).batch(0)
    assert int((b.seq_lengths == 0).sum()) > 20
    validate_batch(b, s)
    # sparsity close to 1 with max_len 1: lengths U{0..0} -> every history empty
    s0 = make_schema(max_len=1, min_len=0, sparsity=0.9)
    b0 = SyntheticDataset(s0, seed=0, batch_size=9).batch(0)
    assert b0.max_seq_len == 0 and b0.sequence["hist_item"].values().numel() == 0
    assert torch.equal(b0.seq_offsets, torch.zeros(10, dtype=torch.int64))
    validate_batch(b0, s0)
    # labels still defined (taste 0 -> affinity 0)
    assert torch.isfinite(SyntheticDataset(s0, seed=0, batch_size=9).batch(0, return_truth=True)[1]).all()


def test_lognormal_lengths_clipped():
    s = make_schema(distribution="lognormal", mu=2.0, sigma=1.0, max_len=24, min_len=2)
    ds = SyntheticDataset(s, seed=1, batch_size=1024)
    lengths = torch.cat([ds.batch(i).seq_lengths for i in range(4)]).double()
    assert int(lengths.min()) == 2 and int(lengths.max()) == 24
    # median of round(exp(N(2, 1))) is round(e^2) = 7, unaffected by the clipping
    assert abs(float(lengths.median()) - 7) <= 1
    assert 0.05 < float((lengths == 24).double().mean()) < 0.15  # P(exp(Z + 2) > 23.5) = 0.10


@pytest.mark.parametrize("alpha", [0.0, 0.7, 1.0, 1.3])
@pytest.mark.parametrize("n", [1, 10, 1000])
def test_zipf_ranks_follow_the_power_law(alpha, n):
    g = torch.Generator().manual_seed(0)
    m = 50_000
    r = zipf_ranks(torch.rand(m, generator=g, dtype=torch.float64), n, alpha)
    assert int(r.min()) >= 0 and int(r.max()) <= n - 1
    # continuous law on x in [1, n+1) with density ~ x^-alpha; rank = floor(x) - 1
    ks = torch.tensor(sorted({0, 1, 2, n // 3, n // 2, n - 1}), dtype=torch.float64)
    if alpha == 1.0:
        cdf = torch.log(ks + 2) / math.log(n + 1)
    else:
        e = 1 - alpha
        cdf = ((ks + 2) ** e - 1) / ((n + 1) ** e - 1)
    cdf = cdf.clamp(max=1.0)
    emp = torch.stack([(r <= k).double().mean() for k in ks.long()])
    assert torch.allclose(emp, cdf, atol=0.01)


def test_item_popularity_is_skewed_and_spread_over_ids():
    s = make_schema()
    ds = SyntheticDataset(s, seed=0, batch_size=512)
    ids = torch.cat([ds.batch(i).sequence["hist_item"].values() for i in range(4)])
    counts = torch.bincount(ids, minlength=500).double()
    top = counts.sort(descending=True).values
    assert top[:25].sum() > 0.25 * counts.sum()  # top 5% of items take a large share
    assert int((counts > 0).sum()) > 250  # but most items appear
    assert int(counts.argmax()) != 0  # ids are a permutation of popularity ranks


def _truth(ds, n):
    ps, ys, bs = [], [], []
    for i in range(n):
        b, p = ds.batch(i, return_truth=True)
        ps.append(p)
        ys.append(b.labels)
        bs.append(b)
    return torch.cat(ps), torch.cat(ys), bs


def test_perfect_model_auc_and_positive_rate():
    s = make_schema(max_len=32)
    ds = SyntheticDataset(s, seed=11, batch_size=500)
    p, y, _ = _truth(ds, 8)  # 4000 examples
    assert p.shape == y.shape == (4000, 2)
    assert bool(((p >= 0) & (p <= 1)).all()) and bool((p[:, 1] <= p[:, 0] + 1e-7).all())
    assert auc(p[:, 0], y[:, 0]) > 0.8
    assert auc(p[:, 1], y[:, 1]) > 0.75
    assert 0.2 <= float(y[:, 0].mean()) <= 0.5
    assert 0.05 <= float(y[:, 1].mean()) <= float(y[:, 0].mean())
    # labels are draws from the true probabilities: calibration within sampling noise
    assert abs(float(p[:, 0].mean() - y[:, 0].mean())) < 0.03


def test_history_affinity_carries_most_of_the_signal():
    # The share of history events in the candidate's cluster predicts clicks; the same statistic from another
    # user's history does not.
    s = make_schema(max_len=32)
    ds = SyntheticDataset(s, seed=11, batch_size=2000)
    b = ds.batch(0)
    w = ds.world
    hist = b.sequence["hist_item"].values()
    user = torch.repeat_interleave(torch.arange(b.batch_size), b.seq_lengths)
    # id -> popularity rank -> cluster (invert the affine permutation)
    inv_a = pow(w.perm_a, -1, w.n)
    cluster_of = lambda ids: (((ids - w.perm_b) % w.n) * inv_a % w.n) % w.k
    cand_c = cluster_of(b.sequence["cand_item"].values())
    share_same = torch.zeros(b.batch_size).index_add_(0, user, (cluster_of(hist) == cand_c[user]).float())
    share_same = share_same / b.seq_lengths.clamp_min(1)
    y = b.labels[:, 0]
    assert auc(share_same, y) > 0.7  # a crude history/candidate match alone predicts clicks
    rolled = share_same.roll(1)
    assert auc(rolled, y) < 0.6  # another user's history does not


def test_generation_speed():
    s = make_schema(max_len=64)
    ds = SyntheticDataset(s, seed=0, batch_size=256)
    ds.batch(0)
    times = []
    for i in range(30):
        t = time.perf_counter()
        ds.batch(i)
        times.append(time.perf_counter() - t)
    assert sorted(times)[15] < 0.010


def test_batch_to_moves_every_tensor():
    s = make_schema()
    b = SyntheticDataset(s, seed=0, batch_size=5).batch(0)
    m = b.to(torch.device("meta"), non_blocking=True)
    assert isinstance(m, Batch) and m.max_seq_len == b.max_seq_len
    for t in (m.dense, m.labels, m.seq_offsets, m.sequence.values(), m.sequence.lengths(), m.sparse.values()):
        assert t.device.type == "meta"
    assert m.sequence.keys() == b.sequence.keys() and m.dense.shape == b.dense.shape
    c = b.to(torch.device("cpu"))
    assert_batches_equal(b, c)


@pytest.mark.gpu
def test_batch_pin_and_cuda_stream():
    s = make_schema()
    b = SyntheticDataset(s, seed=0, batch_size=5).batch(0).pin_memory()
    assert b.dense.is_pinned() and b.sequence.values().is_pinned()
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        g = b.to(torch.device("cuda"), non_blocking=True)
    g.record_stream(torch.cuda.current_stream())
    stream.synchronize()
    assert_batches_equal(b, g.to(torch.device("cpu")))


def test_bad_arguments():
    s = make_schema()
    with pytest.raises(ValueError, match="split"):
        SyntheticDataset(s, split="test")
    with pytest.raises(ValueError, match="rank"):
        SyntheticDataset(s, rank=2, world_size=2)
    with pytest.raises(ValueError, match="batch_size"):
        SyntheticDataset(s, batch_size=0)


def test_signal_is_learnable_by_a_small_model():
    # Mean-pooled history embedding . candidate embedding + linear dense + sparse biases, 200 Adam steps.
    torch.manual_seed(0)
    s = make_schema(num_items=2000, zipf_alpha=1.2, max_len=32)
    train, held_out = SyntheticDataset(s, 0, 128), SyntheticDataset(s, 0, 2000, split="eval")
    hist = torch.nn.EmbeddingBag(2000, 16, mode="mean")
    cand = torch.nn.Embedding(2000, 16)
    seg = torch.nn.Embedding(20, 2)
    dense = torch.nn.Linear(4, 2)
    head = torch.nn.Linear(1, 2)
    params = [p for m in (hist, cand, seg, dense, head) for p in m.parameters()]
    opt = torch.optim.Adam(params, lr=0.05)

    def logits(b):
        h = hist(b.sequence["hist_item"].values(), b.seq_offsets[:-1])
        c = cand(b.sequence["cand_item"].values())
        return head((h * c).sum(1, keepdim=True)) + dense(b.dense) + seg(b.sparse["user_segment"].values())

    b, _ = held_out.batch(0, return_truth=True)
    with torch.no_grad():
        before = auc(logits(b)[:, 0], b.labels[:, 0])
    for i in range(200):
        tb = train.batch(i)
        loss = torch.nn.functional.binary_cross_entropy_with_logits(logits(tb), tb.labels)
        opt.zero_grad()
        loss.backward()
        opt.step()
    with torch.no_grad():
        out = logits(b)
    after = auc(out[:, 0], b.labels[:, 0])
    assert after > max(0.75, before + 0.15)
    assert auc(out[:, 1], b.labels[:, 1]) > 0.7
