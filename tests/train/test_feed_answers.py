"""What the trainer feeds its optimizer and model: step s trains batch s of the stream (fresh and resumed), and the
dense AdamW runs with the configured decay and the schedule down to min_lr_ratio, and the sparse row-wise Adagrad
with the configured eps, checked against values worked out by hand."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from torch import nn
from torchrec import EmbeddingCollection, EmbeddingConfig, KeyedJaggedTensor

from gem.train.trainer import Trainer
from tests.train._util import drop_process_group_after_module, small_trainer

COMMON = ("train.eval_every=0", "train.seed=3", "data.num_workers=0")


_own_process_group = pytest.fixture(autouse=True, scope="module")(drop_process_group_after_module)


def _trainer(run_dir: Path | None, *overrides: str):
    return small_trainer(run_dir, *COMMON, *overrides)


class _Recorded:
    """A training dataset that notes the stream position of every batch it hands out."""

    def __init__(self, ds) -> None:
        self.ds, self.seen = ds, []

    def __iter__(self):
        for b in self.ds:
            self.seen.append(int(self.ds.state_dict()["batch_index"]) - 1)
            yield b

    def state_dict(self):
        return self.ds.state_dict()

    def load_state_dict(self, state):
        self.ds.load_state_dict(state)


def _fit_recorded(run_dir: Path, *overrides: str) -> tuple[list[int], Trainer]:
    t = _trainer(run_dir, *overrides)
    try:
        t.train_data = rec = _Recorded(t.train_data)
        t.fit()
        return rec.seen, t
    finally:
        t.close()


def test_step_s_trains_batch_s_fresh_and_after_resume(tmp_path):
    # a fresh run: the stream from its first batch, one batch per step
    seen, t = _fit_recorded(tmp_path, "train.steps=5", "train.stop_at_step=3", "train.checkpoint.every=3")
    assert t.step == 3 and seen[:3] == [0, 1, 2]
    # resumed at step 3: batch 3 next, neither one skipped nor one trained twice
    seen, t = _fit_recorded(tmp_path, "train.steps=5", "train.resume=true")
    assert t.step == 5 and seen[:2] == [3, 4]


def test_dense_adamw_gets_the_configured_decay_and_schedule_floor():
    lr, floor = 0.02, 0.25
    t = _trainer(None, f"train.lr={lr}", f"train.min_lr_ratio={floor}", "train.warmup_steps=2", "train.steps=6",
                 "train.weight_decay=0.3", "train.betas=[0.8,0.95]", "train.eps=1e-6", "train.grad_clip=0")
    try:
        opt = t.optimizer
        groups = opt._adamw.param_groups
        for g in groups:
            assert g["weight_decay"] == pytest.approx(0.3)
            assert tuple(g["betas"]) == pytest.approx((0.8, 0.95))
            assert g["eps"] == pytest.approx(1e-6)
        # lr per step: warmup (s + 1) / 2, then cosine over the 4 remaining steps down to floor * lr
        want = [lr * 0.5, lr] + [lr * (floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * k / 4))) for k in range(4)]
        got = []
        for _ in range(6):  # no gradients: AdamW leaves the parameters alone, the schedule still advances
            got.append(groups[0]["lr"])
            opt.step()
        assert got == pytest.approx(want)
        assert groups[0]["lr"] == pytest.approx(lr * floor)  # past the last step: the floor
    finally:
        t.close()


class _Table(nn.Module):
    """One sequence table; loss = <c, looked-up rows>, so a row's gradient is the sum of its lookups' c rows."""

    def __init__(self) -> None:
        super().__init__()
        self.ec = EmbeddingCollection([EmbeddingConfig(name="t", embedding_dim=4, num_embeddings=5,
                                                       feature_names=["f"])])

    def forward(self, ids: KeyedJaggedTensor, c: torch.Tensor) -> torch.Tensor:
        return (self.ec(ids)["f"].values() * c).sum()


@pytest.mark.parametrize("decay,mode", [(0.0, "l2"), (0.3, "l2"), (0.3, "decoupled")])
def test_sparse_rowwise_adagrad_divides_by_the_configured_eps(process_group, decay, mode):
    """With weight decay, on the rows looked up only: l2 adds decay * w to the gradient (torch.optim.Adagrad's
    weight_decay); decoupled subtracts lr * decay * w from the weight beside the Adagrad step (AdamW's)."""
    from gem.parallel import parallelize

    lr, eps = 0.1, 0.5  # an eps this large changes the update by a third
    torch.manual_seed(0)
    model = _Table()
    w = model.ec.embeddings["t"].weight.detach().double().clone()
    cfg = {"name": "rowwise_adagrad", "lr": lr, "eps": eps, "weight_decay": decay, "weight_decay_mode": mode}
    p = parallelize(model, {}, sparse_optimizer_cfg=cfg, device=process_group)
    ids = torch.tensor([1, 3, 1])  # row 1 twice (its gradients add up), row 3 once, the others never
    c = torch.tensor([[1.0, -2.0, 0.5, 0.0], [0.5, 0.5, 1.0, -1.0], [2.0, 1.0, -0.5, 1.0]])
    state = torch.zeros(5, dtype=torch.float64)
    for _ in range(2):
        kjt = KeyedJaggedTensor.from_lengths_sync(keys=["f"], values=ids, lengths=torch.tensor([2, 1]))
        p.model(kjt.to(process_group), c.to(process_group)).backward()  # the update happens inside backward
        g = torch.zeros(5, 4, dtype=torch.float64).index_add_(0, ids, c.double())
        seen = torch.zeros(5, 1, dtype=torch.float64).index_fill_(0, ids, 1.0)
        if mode == "l2":
            g = g + decay * w * seen
        state += (g * g).mean(1)  # row-wise Adagrad: one accumulator per row, the mean of its squared gradient
        step = lr * g / (state.sqrt() + eps)[:, None]
        if mode == "decoupled":
            step = step + lr * decay * w * seen
        w -= step
    got = p.model.state_dict()["ec.embeddings.t.weight"]
    got = got.local_shards()[0].tensor if hasattr(got, "local_shards") else got
    torch.testing.assert_close(got.detach().cpu().double(), w, rtol=1e-5, atol=1e-6)


def _rows_after_two_steps(device, cfg: dict) -> torch.Tensor:
    from gem.parallel import parallelize

    torch.manual_seed(0)
    p = parallelize(_Table(), {}, sparse_optimizer_cfg=cfg, device=device)
    ids = torch.tensor([1, 3, 1])
    c = torch.tensor([[1.0, -2.0, 0.5, 0.0], [0.5, 0.5, 1.0, -1.0], [2.0, 1.0, -0.5, 1.0]])
    for _ in range(2):
        kjt = KeyedJaggedTensor.from_lengths_sync(keys=["f"], values=ids, lengths=torch.tensor([2, 1]))
        p.model(kjt.to(device), c.to(device)).backward()
    got = p.model.state_dict()["ec.embeddings.t.weight"]
    return (got.local_shards()[0].tensor if hasattr(got, "local_shards") else got).detach().cpu().clone()


@pytest.mark.gpu
def test_sparse_adam_takes_its_betas_and_weight_decay(process_group):
    """fbgemm's fused Adam (CUDA only) gets betas as its beta1 / beta2 and a decoupled weight decay: each setting
    changes the looked-up rows and nothing else."""
    base = {"name": "adam", "lr": 0.1}
    plain = _rows_after_two_steps(process_group, base)
    betas = _rows_after_two_steps(process_group, {**base, "betas": [0.0, 0.5]})
    decay = _rows_after_two_steps(process_group, {**base, "weight_decay": 0.5, "weight_decay_mode": "decoupled"})
    for other in (betas, decay):
        assert not torch.allclose(other[[1, 3]], plain[[1, 3]])
        assert torch.equal(other[[0, 2, 4]], plain[[0, 2, 4]])


@pytest.mark.parametrize("so,match", [
    ({"name": "adagrad", "weight_decay": 0.1}, "fbgemm's fused adagrad has no weight decay"),
    ({"name": "sgd", "momentum": 0.9}, "fbgemm's fused sgd has no momentum"),
    ({"name": "adam", "weight_decay": 0.1, "weight_decay_mode": "l2"}, "fbgemm's fused adam decays the weights"),
])
def test_train_config_refuses_sparse_optimizer_keys_fbgemm_would_drop(so, match):
    """What the fused kernels do not take is refused where the config is read, before any rank starts; what they
    take passes (rowwise_adagrad and adam with their weight decay)."""
    from gem.config import ConfigError
    from gem.train.config import TrainConfig

    with pytest.raises(ConfigError, match=match):
        TrainConfig.from_dict({"sparse_optimizer": so})
    for ok in ({"name": "rowwise_adagrad", "weight_decay": 0.1, "weight_decay_mode": "decoupled"},
               {"name": "adam", "weight_decay": 0.1, "betas": [0.9, 0.99]}):
        assert TrainConfig.from_dict({"sparse_optimizer": ok}).sparse_optimizer == ok
