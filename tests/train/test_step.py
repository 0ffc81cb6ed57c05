"""train_step on an unsharded tiny model: one optimizer step on the multitask + aux loss, losses left on the
device; a non-finite loss stops the step before backward."""

from __future__ import annotations

import copy

import pytest
import torch

from gem.model import GEMModel, multitask_loss
from gem.train.step import StepConfig, train_step
from tests.model._batches import make_batch, tiny_cfg


def _setup(aux_loss_weight: float = 0.5):
    cfg = tiny_cfg()
    torch.manual_seed(0)
    model = GEMModel(cfg, embedding_device="cpu")
    step_cfg = StepConfig(cfg.tasks, cfg.task_weights, aux_loss_weight=aux_loss_weight)
    return cfg, model, step_cfg


def test_train_step_is_one_sgd_step_on_the_weighted_loss():
    cfg, model, step_cfg = _setup()
    batch = make_batch(cfg, [4, 0, 7, 2], seed=1)
    ref = copy.deepcopy(model)
    initial = {n: p.detach().clone() for n, p in model.named_parameters()}
    out = ref(batch)
    task_loss, _ = multitask_loss(out.logits, batch.labels, cfg.task_weights, cfg.tasks)
    (task_loss + 0.5 * out.aux_loss).backward()
    torch.optim.SGD(ref.parameters(), lr=0.1).step()
    want = {n: p.detach() for n, p in ref.named_parameters() if p.grad is not None}

    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    got = train_step(model, opt, batch, step_cfg, step=1)
    assert not got.loss.requires_grad and got.loss.dim() == 0
    torch.testing.assert_close(got.task_loss, task_loss.detach(), rtol=0, atol=0)
    torch.testing.assert_close(got.loss, (task_loss + 0.5 * out.aux_loss).detach(), rtol=0, atol=0)
    params = dict(model.named_parameters())
    assert len(want) > 10 and not all(torch.equal(initial[n], w) for n, w in want.items())  # the step moved them
    for n, w in want.items():
        torch.testing.assert_close(params[n].detach(), w, rtol=0, atol=0, msg=n)


def test_consecutive_steps_start_from_zero_gradients():
    """Two steps equal two reference SGD steps, each on its own batch's gradient (none carried over)."""
    cfg, model, step_cfg = _setup()
    batches = [make_batch(cfg, [4, 0, 7, 2], seed=1), make_batch(cfg, [3, 5], seed=2)]
    ref = copy.deepcopy(model)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    for b in batches:
        ref_opt.zero_grad()
        out = ref(b)
        task_loss, _ = multitask_loss(out.logits, b.labels, cfg.task_weights, cfg.tasks)
        (task_loss + 0.5 * out.aux_loss).backward()
        ref_opt.step()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for i, b in enumerate(batches):
        train_step(model, opt, b, step_cfg, step=i + 1)
    for (n, p), q in zip(model.named_parameters(), ref.parameters()):
        torch.testing.assert_close(p.detach(), q.detach(), rtol=0, atol=0, msg=n)


def test_a_non_finite_loss_stops_the_step_before_backward():
    cfg, model, step_cfg = _setup()
    batch = make_batch(cfg, [4, 3], seed=2)
    batch.dense[0, 0] = float("nan")
    before = [p.detach().clone() for p in model.parameters()]
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(FloatingPointError, match="non-finite loss nan at step 7"):
        train_step(model, opt, batch, step_cfg, step=7)
    assert all(p.grad is None for p in model.parameters())
    assert all(torch.equal(a, p) for a, p in zip(before, model.parameters()))


def test_phase_timer_splits_the_step_and_sees_a_slow_input():
    """The loop's marks give input / forward / backward / optimizer times that add up to the step, and a batch
    that takes long to arrive shows up as input time, not as compute."""
    import time

    from gem.train.step import PhaseTimer, PlainLoop

    cfg, model, step_cfg = _setup()
    timer = PhaseTimer(torch.device("cpu"))
    loop = PlainLoop(model, torch.optim.SGD(model.parameters(), lr=0.1), step_cfg, torch.device("cpu"), timer=timer)

    def slow_batches():
        for i in range(3):
            time.sleep(0.05)
            yield make_batch(cfg, [4, 0, 7], seed=i)

    batches = slow_batches()
    t0 = time.perf_counter()
    for i in range(3):
        loop.step(batches, i + 1)
    wall_ms = 1e3 * (time.perf_counter() - t0) / 3
    phases = timer.window()
    assert list(phases) == ["input", "forward", "backward", "optimizer"]
    assert phases["input"] >= 50 and min(phases.values()) > 0
    assert sum(phases.values()) == pytest.approx(wall_ms, rel=0.05)
    assert timer.window() == {}  # read and cleared
