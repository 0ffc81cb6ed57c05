"""Training and evaluation numbers against values worked out by hand: AUC of confident predictions, the loss with
configured task weights, MFU per step over a window of several steps, and the rank imbalance of a window."""

from __future__ import annotations

import math

import pytest
import torch

from gem.train.config import TrainConfig
from gem.train.metrics import TaskMetrics
from gem.train.metrics_log import TrainLogger
from gem.train.reporting import MetricsReporter
from gem.train.step import StepConfig, StepOutput, forward_loss


def test_auc_of_predictions_past_the_ne_clamp_keeps_their_order():
    """NE clamps predictions to [eta, 1 - eta]; AUC and GAUC rank the predictions themselves. Logits 30 < 34 < 38
    are all above that clamp yet distinct in float64: the positives (34, 38) outrank both negatives (30, -2)."""
    logits = torch.tensor([[30.0], [34.0], [38.0], [-2.0]])
    labels = torch.tensor([[0.0], [1.0], [1.0], [0.0]])
    p = torch.sigmoid(logits.double())[:, 0]
    assert p[0] < p[1] < p[2] and p[0] > 1 - 1e-12  # distinct, and all three past the clamp
    m = TaskMetrics(["click"])
    m.update(logits, labels, groups=torch.tensor([7, 7, 7, 7]))
    out = m.compute()
    assert out["click/auc"] == 1.0
    assert out["click/gauc"] == 1.0
    # calibration on the unclamped predictions too: sum(p) / sum(y)
    assert out["click/calibration"] == pytest.approx(float(p.sum()) / 2, rel=1e-14)


def test_the_step_loss_applies_the_configured_task_weights():
    """forward_loss's task loss is sum_t w_t * mean BCE of task t, with the weights given to the step."""
    from gem.model import GEMModel
    from tests.model._batches import make_batch, tiny_cfg

    cfg = tiny_cfg(num_blocks=1, moe_every=0)
    torch.manual_seed(0)
    model = GEMModel(cfg, embedding_device="cpu")
    batch = make_batch(cfg, [4, 0, 3, 2], seed=1)
    batch.labels = torch.tensor([[1.0, 0.0], [0.0, 1.0], [1.0, 1.0], [0.0, 0.0]])
    weights = [0.25, 3.0]
    step_cfg = StepConfig(cfg.tasks, weights, aux_loss_weight=0.0)
    _, out = forward_loss(model, batch, step_cfg, step=1)
    with torch.no_grad():
        logits = model(batch).logits.double()
    y = batch.labels.double()
    bce = [[-math.log(1 / (1 + math.exp(-z))) if t else -math.log(1 - 1 / (1 + math.exp(-z)))
            for z, t in zip(row_z.tolist(), row_y.tolist())] for row_z, row_y in zip(logits, y)]
    per_task = [sum(r[i] for r in bce) / len(bce) for i in range(2)]
    want = weights[0] * per_task[0] + weights[1] * per_task[1]
    assert float(out.task_loss) == pytest.approx(want, rel=1e-5)
    assert float(out.task_loss) != pytest.approx(per_task[0] + per_task[1], rel=1e-3)  # the weights matter here


class _Opt:
    last_lr, last_grad_norm = 1e-3, None


def _reporter(world_size: int = 1, peak: float | None = None) -> MetricsReporter:
    tcfg = TrainConfig(steps=10)
    tcfg.mfu.peak_flops = peak
    return MetricsReporter(TrainLogger(None, enabled=False, tensorboard=False), _Opt(), tcfg, run_dir=None, rank=0,
                           world_size=world_size, device=torch.device("cpu"), tasks=["click"], global_batch=8)


def test_mfu_of_a_window_is_per_step_flops_over_per_step_time():
    """Three steps of 2, 3 and 7 GFLOPs in one log window: the rate is their mean FLOPs per step over the mean step
    time, i.e. 12 GFLOPs over the window's time, and MFU that rate over the configured peak."""
    rep = _reporter(peak=1e11)
    zero = torch.zeros(())
    for flops in (2e9, 3e9, 7e9):
        rep.step_done(zero, flops, 8)
    rep.window_t0 -= 2.0  # the window took at least two seconds
    s = rep.log_window(3, StepOutput(zero, zero, zero), {})
    window_s = 3 * s["perf/step_time_s"]
    assert window_s >= 2.0
    assert s["perf/tflops_per_device"] * 1e12 == pytest.approx(12e9 / window_s, rel=1e-9)
    assert s["perf/mfu_e2e"] == pytest.approx(12e9 / window_s / 1e11, rel=1e-9)


def test_rank_imbalance_is_each_steps_slowest_rank_over_the_mean(monkeypatch):
    """Three ranks whose work trades places between two steps: each step's max / mean is 1.5 (the synchronous
    step waits for its slowest rank), although every rank's window total is the same."""
    import torch.distributed as dist

    per_rank = [[1e9, 3e9], [3e9, 1e9], [2e9, 2e9]]

    def all_gather(out, t, group=None):
        assert t.tolist() == per_rank[0]  # this rank's FLOPs of each step of the window
        for o, r in zip(out, per_rank):
            o.copy_(torch.tensor(r, dtype=o.dtype))

    def all_reduce(t, group=None):
        t.mul_(3)  # every rank the same loss and candidate count

    monkeypatch.setattr(dist, "all_gather", all_gather)
    monkeypatch.setattr(dist, "all_reduce", all_reduce)
    rep = _reporter(world_size=3)
    zero = torch.zeros(())
    for flops in per_rank[0]:
        rep.step_done(zero, flops, 8)
    s = rep.log_window(2, StepOutput(zero, zero, zero), {})
    assert s["perf/rank_imbalance"] == pytest.approx(1.5, rel=1e-12)
