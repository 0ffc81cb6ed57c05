"""Schedule values, TrainOptimizer against torch AdamW + clip_grad_norm_, and the state warm-up."""

import math

import pytest
import torch

from gem.train.optim import TrainOptimizer, WarmupCosine, clip_grad_norm_


def test_warmup_cosine_values():
    s = WarmupCosine(base_lr=2.0, warmup_steps=4, total_steps=14, min_ratio=0.1)
    assert [s(i) for i in range(4)] == pytest.approx([0.5, 1.0, 1.5, 2.0])
    assert s(4) == pytest.approx(2.0)  # cosine starts at its top
    assert s(9) == pytest.approx(2.0 * (0.1 + 0.9 * 0.5))  # halfway through the decay
    assert s(14) == pytest.approx(0.2)
    assert s(100) == pytest.approx(0.2)  # clamped past the end
    for i in range(4, 14):
        assert s(i + 1) < s(i)
        expect = 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * (i - 4) / 10))
        assert s(i) == pytest.approx(2.0 * expect)


def test_no_warmup_and_single_step():
    assert WarmupCosine(1.0, 0, 1, 0.0)(0) == pytest.approx(1.0)
    assert WarmupCosine(1.0, 0, 1, 0.0)(1) == pytest.approx(0.0)
    assert WarmupCosine(1.0, 1, 1, 0.5)(0) == pytest.approx(1.0)


def _model(seed=0):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(5, 7), torch.nn.Tanh(), torch.nn.Linear(7, 3))


@pytest.mark.parametrize("fused", [False, True], ids=["foreach", "fused"])
@pytest.mark.parametrize("clip", [0.0, 0.05, 100.0])
def test_train_optimizer_matches_torch_adamw(clip, fused):
    """Against torch's AdamW after torch's clip_grad_norm_; the fused kernel clips through its grad_scale."""
    ours, ref = _model(), _model()
    kw = {"lr": 0.01, "betas": (0.8, 0.95), "eps": 1e-7, "weight_decay": 0.1}
    opt = TrainOptimizer(
        list(ours.named_parameters()), None, warmup_steps=2, total_steps=6, min_lr_ratio=0.2, grad_clip=clip,
        fused=fused, **kw
    )
    assert opt._adamw.defaults["fused"] is (True if fused else None)
    ref_opt = torch.optim.AdamW(ref.parameters(), **kw)
    sched = WarmupCosine(kw["lr"], 2, 6, 0.2)
    g = torch.Generator().manual_seed(1)
    for step in range(6):
        x, y = torch.randn(9, 5, generator=g), torch.randn(9, 3, generator=g)
        for m in (ours, ref):
            ((m(x) - y) ** 2).sum().backward()
        norm_ref = torch.nn.utils.clip_grad_norm_(ref.parameters(), clip if clip > 0 else float("inf"))
        for group in ref_opt.param_groups:
            group["lr"] = sched(step)
        assert opt.lr == pytest.approx(sched(step))
        opt.step()
        ref_opt.step()
        for p, q in zip(ours.parameters(), ref.parameters()):  # .grad ends clipped on both paths, as torch's
            torch.testing.assert_close(p.grad, q.grad, rtol=1e-5, atol=1e-7)
        opt.zero_grad()
        ref_opt.zero_grad()
        assert float(opt.last_grad_norm) == pytest.approx(float(norm_ref), rel=1e-5)
        for p, q in zip(ours.parameters(), ref.parameters()):
            torch.testing.assert_close(p, q, rtol=1e-6, atol=1e-7)
    assert opt.step_count == 6


def test_clip_grad_norm_scales_to_max():
    p = torch.nn.Parameter(torch.zeros(4))
    q = torch.nn.Parameter(torch.zeros(2, 2))
    p.grad = torch.tensor([3.0, 0.0, 0.0, 0.0])
    q.grad = torch.tensor([[0.0, 4.0], [0.0, 0.0]])
    norm = clip_grad_norm_([p, q], 1.0)
    assert float(norm) == pytest.approx(5.0)
    assert float(torch.sqrt(p.grad.pow(2).sum() + q.grad.pow(2).sum())) == pytest.approx(1.0, rel=1e-5)
    torch.testing.assert_close(p.grad, torch.tensor([0.6, 0.0, 0.0, 0.0]), rtol=1e-5, atol=0)
    # below the limit: untouched; no grads at all: norm 0
    norm = clip_grad_norm_([p, q], 10.0)
    assert float(norm) == pytest.approx(1.0, rel=1e-5)
    assert float(clip_grad_norm_([torch.nn.Parameter(torch.zeros(1))], 1.0)) == 0.0


def test_init_state_leaves_parameters_and_allows_load():
    m = _model()
    before = [p.detach().clone() for p in m.parameters()]
    opt = TrainOptimizer(list(m.named_parameters()), None, lr=0.1, weight_decay=0.5, total_steps=5)
    opt.init_state()
    for p, b in zip(m.parameters(), before):
        assert torch.equal(p, b)
        assert p.grad is None
    sd = opt.state_dict()
    assert set(sd["state"]) == {f"dense.{n}" for n, _ in m.named_parameters()}
    # a trained optimizer's state loads into the warmed-up one, step counter included
    m2 = _model()
    opt2 = TrainOptimizer(list(m2.named_parameters()), None, lr=0.1, weight_decay=0.5, total_steps=5)
    m2(torch.ones(1, 5)).sum().backward()
    opt2.step()
    opt.load_state_dict(opt2.state_dict(), step_count=1)
    assert opt.step_count == 1 and opt.lr == pytest.approx(opt2.lr)
    for k, v in opt2.state_dict()["state"].items():
        for name, t in v.items():
            assert torch.equal(opt.state_dict()["state"][k][name], t)
