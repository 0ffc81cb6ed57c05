"""TaskMetrics / auc_with_ties against direct fp64 computations."""

import math

import pytest
import torch

from gem.train.metrics import TaskMetrics, auc_with_ties


def pairwise_auc(p: torch.Tensor, y: torch.Tensor) -> float:
    """P(score_pos > score_neg) + 0.5 P(tie), by enumerating every (positive, negative) pair."""
    pos, neg = p[y == 1].double(), p[y == 0].double()
    diff = pos[:, None] - neg[None, :]
    return float(((diff > 0).double() + 0.5 * (diff == 0).double()).mean())


@pytest.mark.parametrize("n,levels,seed", [(1, 0, 0), (2, 0, 1), (7, 3, 2), (100, 0, 3), (257, 5, 4), (1000, 2, 5)])
def test_auc_matches_pairwise_incl_ties(n, levels, seed):
    g = torch.Generator().manual_seed(seed)
    y = (torch.rand(n, generator=g) < 0.4).double()
    p = torch.rand(n, generator=g)
    if levels:  # few distinct scores: many ties, across and within classes
        p = torch.floor(p * levels) / levels
    if y.sum() in (0, n):
        assert auc_with_ties(p, y) == 0.5
    else:
        assert auc_with_ties(p, y) == pytest.approx(pairwise_auc(p, y), abs=1e-12)


def test_auc_all_tied_is_half_and_perfect_is_one():
    y = torch.tensor([0, 1, 0, 1, 1.0])
    assert auc_with_ties(torch.full((5,), 0.3), y) == pytest.approx(0.5)
    assert auc_with_ties(y * 0.9 + 0.05, y) == pytest.approx(1.0)
    assert auc_with_ties(1 - y, y) == pytest.approx(0.0)


def direct(p: torch.Tensor, y: torch.Tensor) -> dict:
    p, y = p.double(), y.double()
    ll = -(y * torch.log(p) + (1 - y) * torch.log(1 - p)).mean()
    base = y.mean()
    h = -(base * math.log(base) + (1 - base) * math.log(1 - base))
    return {"logloss": float(ll), "ne": float(ll / h), "calibration": float(p.sum() / y.sum())}


@pytest.mark.parametrize("batches", [[1], [5, 3], [64, 1, 33]])
def test_task_metrics_match_direct(batches):
    g = torch.Generator().manual_seed(len(batches))
    tasks = ["click", "conversion", "share"]
    m = TaskMetrics(tasks)
    all_logits, all_labels = [], []
    for b in batches:
        logits = torch.randn(b, 3, generator=g) * 2
        labels = (torch.rand(b, 3, generator=g) < torch.sigmoid(logits)).float()
        labels[0] = torch.tensor([0.0, 1.0, 0.0])  # both classes present in every task
        if b > 1:
            labels[1] = torch.tensor([1.0, 0.0, 1.0])
        m.update(logits, labels)
        all_logits.append(logits)
        all_labels.append(labels)
    if sum(batches) == 1:  # single example: make the classes mixed across the pass anyway
        m.update(torch.zeros(1, 3), torch.tensor([[1.0, 0.0, 1.0]]))
        all_logits.append(torch.zeros(1, 3))
        all_labels.append(torch.tensor([[1.0, 0.0, 1.0]]))
    out = m.compute()
    logits, labels = torch.cat(all_logits), torch.cat(all_labels)
    p = torch.sigmoid(logits.double())
    assert out["num_samples"] == logits.shape[0]
    for i, t in enumerate(tasks):
        ref = direct(p[:, i], labels[:, i])
        assert out[f"{t}/logloss"] == pytest.approx(ref["logloss"], rel=1e-9)
        assert out[f"{t}/ne"] == pytest.approx(ref["ne"], rel=1e-9)
        assert out[f"{t}/calibration"] == pytest.approx(ref["calibration"], rel=1e-9)
        assert out[f"{t}/auc"] == pytest.approx(pairwise_auc(p[:, i], labels[:, i]), abs=1e-12)


def test_predicting_the_base_rate_gives_ne_one():
    y = torch.tensor([[1.0, 0.0], [0.0, 0.0], [0.0, 1.0], [1.0, 0.0]])
    rate = y.mean(0)
    logits = torch.log(rate / (1 - rate)).expand(4, 2)
    m = TaskMetrics(["a", "b"])
    m.update(logits, y)
    out = m.compute()
    assert out["a/ne"] == pytest.approx(1.0, rel=1e-9)
    assert out["b/ne"] == pytest.approx(1.0, rel=1e-9)
    assert out["a/calibration"] == pytest.approx(1.0, rel=1e-9)


def test_reset_and_bad_shapes():
    m = TaskMetrics(["a", "b"])
    m.update(torch.zeros(3, 2), torch.ones(3, 2))
    m.reset()
    m.update(torch.zeros(2, 2), torch.tensor([[1.0, 0.0], [0.0, 1.0]]))
    assert m.compute()["num_samples"] == 2
    with pytest.raises(ValueError, match=r"\[B, 2\]"):
        m.update(torch.zeros(3, 3), torch.zeros(3, 3))
    with pytest.raises(ValueError):
        m.update(torch.zeros(3, 2), torch.zeros(4, 2))


def _gather_worker(rank: int, world: int, port: int, out) -> None:
    import torch.distributed as dist

    if dist.is_initialized():  # a forked rank must not inherit the parent's one-rank group
        dist.destroy_process_group()
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(23, 2, generator=g)  # the same global data on every rank
    labels = (torch.rand(23, 2, generator=g) < 0.5).float()
    shards = [(0, 4), (4, 23)]  # uneven shares
    lo, hi = shards[rank]
    m = TaskMetrics(["a", "b"])
    m.update(logits[lo:hi], labels[lo:hi])
    out[rank] = m.compute()
    dist.destroy_process_group()


def test_metrics_are_global_across_ranks():
    import socket

    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    manager = mp.Manager()
    out = manager.dict()
    # fork: the workers inherit the imported modules (spawning would re-import torchrec in each)
    mp.start_processes(_gather_worker, args=(2, port, out), nprocs=2, join=True, start_method="fork")
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(23, 2, generator=g)
    labels = (torch.rand(23, 2, generator=g) < 0.5).float()
    ref = TaskMetrics(["a", "b"])
    ref.update(logits, labels)
    expected = ref.compute()
    for rank in (0, 1):
        for k, v in expected.items():
            assert out[rank][k] == pytest.approx(v, rel=1e-12), (rank, k)


def brute_gauc(p: torch.Tensor, y: torch.Tensor, g: torch.Tensor) -> tuple[float, int]:
    """Impression-weighted mean of each two-class group's pairwise AUC."""
    num = den = 0.0
    counted = 0
    for gid in torch.unique(g).tolist():
        m = g == gid
        if 0 < y[m].sum() < m.sum():
            num += pairwise_auc(p[m], y[m]) * float(m.sum())
            den += float(m.sum())
            counted += 1
    return (num / den, counted) if counted else (0.5, 0)


@pytest.mark.parametrize("n,n_groups,levels,seed", [(0, 1, 0, 0), (1, 1, 0, 1), (5, 1, 0, 2), (40, 7, 3, 3),
                                                     (300, 25, 0, 4), (513, 100, 4, 5)])
def test_gauc_matches_brute_force(n, n_groups, levels, seed):
    from gem.train.metrics import gauc_with_ties

    gen = torch.Generator().manual_seed(seed)
    p = torch.rand(n, generator=gen)
    if levels:
        p = torch.floor(p * levels) / levels
    y = (torch.rand(n, generator=gen) < 0.4).double()
    g = torch.randint(0, n_groups, (n,), generator=gen) * 1000 - 7  # ids need not be small or positive
    got, counted = gauc_with_ties(p, y, g)
    want, want_counted = brute_gauc(p, y, g)
    assert counted == want_counted
    assert got == pytest.approx(want, abs=1e-12)


def test_gauc_differs_from_pooled_auc():
    from gem.train.metrics import gauc_with_ties

    # Each group ranks perfectly, but group 1's scores all sit below group 0's negatives: pooled AUC < 1.
    p = torch.tensor([0.9, 0.8, 0.2, 0.1])
    y = torch.tensor([1.0, 0.0, 1.0, 0.0])
    g = torch.tensor([0, 0, 1, 1])
    assert gauc_with_ties(p, y, g) == (pytest.approx(1.0), 2)
    assert auc_with_ties(p, y) < 1.0
    # One-class groups are left out, and the weights are impression counts.
    p2 = torch.tensor([0.9, 0.1, 0.5, 0.6, 0.4, 0.3, 0.7])
    y2 = torch.tensor([1.0, 0.0, 1.0, 0.0, 1.0, 0.0, 1.0])
    g2 = torch.tensor([0, 0, 1, 1, 1, 1, 2])
    want = (1.0 * 2 + pairwise_auc(p2[2:6], y2[2:6]) * 4) / 6
    assert gauc_with_ties(p2, y2, g2) == (pytest.approx(want), 2)


def test_task_metrics_gauc_with_groups_and_large_ids():
    from gem.train.metrics import gauc_with_ties

    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(64, 2, generator=gen)
    labels = (torch.rand(64, 2, generator=gen) < 0.5).double()
    base = 2**62  # raw 64-bit request ids: neighbours must stay apart
    groups = base + torch.randint(0, 6, (64,), generator=gen)
    m = TaskMetrics(["click", "buy"])
    m.update(logits[:40], labels[:40], groups[:40])
    m.update(logits[40:], labels[40:], groups[40:])
    out = m.compute()
    for i, task in enumerate(["click", "buy"]):
        want, _ = brute_gauc(torch.sigmoid(logits[:, i].double()), labels[:, i], groups)
        assert out[f"{task}/gauc"] == pytest.approx(want, abs=1e-12)
        assert gauc_with_ties(torch.sigmoid(logits[:, i].double()), labels[:, i], groups)[1] >= 1
    plain = TaskMetrics(["click", "buy"])
    plain.update(logits, labels)
    assert "click/gauc" not in plain.compute()
    with pytest.raises(ValueError, match="groups of shape"):
        plain.update(logits, labels, groups[:3])
