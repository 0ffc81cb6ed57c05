"""The fused sparse (embedding) optimizer against a hand-computed update on tiny unsharded tables.

Each `train.sparse_optimizer` choice runs through `parallelize` (TorchRec DMP, fbgemm's fused kernel) at world size
1 on a loss linear in the looked-up rows, so each row's gradient is the sum of the coefficients of its lookups.
Rows are looked up twice in one batch (their gradients sum before the update) and some never (they must not move).
"""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torchrec import EmbeddingBagCollection, EmbeddingBagConfig, EmbeddingCollection, EmbeddingConfig, KeyedJaggedTensor

from gem.parallel import parallelize
from gem.parallel.dims import ParallelConfigError

DIM, SEQ_ROWS, BAG_ROWS = 4, 7, 6
# (sequence ids, lengths), (bag ids, lengths) per step: row 1 twice in the first batch, row 2 of the bag twice in one
# bag; rows 0, 5, 6 (sequence) and 0, 5 (bag) are never looked up
STEPS = [
    ((torch.tensor([1, 3, 1, 4]), torch.tensor([3, 1])), (torch.tensor([2, 2, 4]), torch.tensor([2, 1]))),
    ((torch.tensor([3, 2]), torch.tensor([1, 1])), (torch.tensor([1, 3]), torch.tensor([1, 1]))),
    ((torch.tensor([1, 1, 1]), torch.tensor([2, 1])), (torch.tensor([2, 1, 2]), torch.tensor([2, 1]))),
]
UNTOUCHED = {"seq": [0, 5, 6], "bag": [0, 5]}


class Tables(nn.Module):
    """One sequence table and one (sum-pooled) bag table; loss = <cs, looked-up rows> + <cb, pooled rows>."""

    def __init__(self) -> None:
        super().__init__()
        self.ec = EmbeddingCollection([EmbeddingConfig(name="seq", embedding_dim=DIM, num_embeddings=SEQ_ROWS,
                                                       feature_names=["f"])])
        self.ebc = EmbeddingBagCollection([EmbeddingBagConfig(name="bag", embedding_dim=DIM, num_embeddings=BAG_ROWS,
                                                              feature_names=["g"])])

    def forward(self, seq: KeyedJaggedTensor, bag: KeyedJaggedTensor, cs: torch.Tensor, cb: torch.Tensor):
        return (self.ec(seq)["f"].values() * cs).sum() + (self.ebc(bag)["g"] * cb).sum()


def _kjt(key: str, ids: torch.Tensor, lengths: torch.Tensor) -> KeyedJaggedTensor:
    return KeyedJaggedTensor.from_lengths_sync(keys=[key], values=ids, lengths=lengths)


def _coefficients(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + step)
    (sid, _), (_, blen) = STEPS[step]
    return torch.randn(len(sid), DIM, generator=g), torch.randn(len(blen), DIM, generator=g)


def _row_grads(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """d loss / d table by hand (float64): each lookup adds its coefficient row to its table row."""
    cs, cb = (c.double() for c in _coefficients(step))
    (sid, _), (bid, blen) = STEPS[step]
    gs = torch.zeros(SEQ_ROWS, DIM, dtype=torch.float64).index_add_(0, sid, cs)
    bag_of = torch.repeat_interleave(torch.arange(len(blen)), blen)
    gb = torch.zeros(BAG_ROWS, DIM, dtype=torch.float64).index_add_(0, bid, cb[bag_of])
    return gs, gb


class Reference:
    """fbgemm's exact (deduplicated) updates: a row's gradients in one batch are summed, then one update;
    rows without gradient keep their weights and state."""

    def __init__(self, name: str, lr: float, eps: float, w: torch.Tensor, betas=(0.9, 0.999)) -> None:
        self.name, self.lr, self.eps, self.betas = name, lr, eps, betas
        self.w = w.double().clone()
        self.state = torch.zeros_like(self.w)  # adagrad: sum g^2 | rowwise: column 0 holds the row's sum mean(g^2)
        self.m, self.v, self.t = torch.zeros_like(self.w), torch.zeros_like(self.w), 0

    def step(self, g: torch.Tensor) -> None:
        rows = g.abs().sum(1) > 0
        lr, eps = self.lr, self.eps
        self.t += 1
        if self.name == "sgd":
            upd = lr * g
        elif self.name == "adagrad":
            self.state += g * g
            upd = lr * g / (self.state.sqrt() + eps)
        elif self.name == "rowwise_adagrad":
            self.state[:, 0] += (g * g).mean(1)
            upd = lr * g / (self.state[:, :1].sqrt() + eps)
        else:  # adam
            b1, b2 = self.betas
            self.m[rows] = b1 * self.m[rows] + (1 - b1) * g[rows]
            self.v[rows] = b2 * self.v[rows] + (1 - b2) * g[rows] ** 2
            mh, vh = self.m / (1 - b1 ** self.t), self.v / (1 - b2 ** self.t)
            upd = torch.zeros_like(g)
            upd[rows] = lr * mh[rows] / (vh[rows].sqrt() + eps)
        self.w[rows] -= upd[rows]


def _local(t) -> torch.Tensor:
    return t.local_shards()[0].tensor if hasattr(t, "local_shards") else t


OPTIMIZERS = [
    pytest.param("sgd", id="sgd"),
    pytest.param("rowwise_adagrad", id="rowwise_adagrad"),
    pytest.param("adagrad", id="adagrad"),
    # fbgemm's CPU kernels have no Adam; the same reference on CUDA
    pytest.param("adam", id="adam", marks=pytest.mark.gpu),
]


@pytest.mark.parametrize("name", OPTIMIZERS)
def test_fused_sparse_optimizer_matches_hand_update(process_group, name):
    from gem.train.config import TrainConfig

    device = process_group
    lr = 0.1
    # the mapping the Trainer hands to parallelize, through the typed train config
    so = TrainConfig.from_dict({"sparse_optimizer": {"name": name, "lr": lr}}).sparse_optimizer
    torch.manual_seed(0)
    model = Tables()
    w0 = {"seq": model.ec.embeddings["seq"].weight.detach().clone(),
          "bag": model.ebc.embedding_bags["bag"].weight.detach().clone()}
    eps = 0.0 if name == "sgd" else 1e-8  # gem.parallel's default eps
    ref = {k: Reference(name, lr, eps, w) for k, w in w0.items()}
    p = parallelize(model, {}, sparse_optimizer_cfg=so, device=device)
    for step, ((sid, slen), (bid, blen)) in enumerate(STEPS):
        cs, cb = _coefficients(step)
        loss = p.model(_kjt("f", sid, slen).to(device), _kjt("g", bid, blen).to(device), cs.to(device), cb.to(device))
        loss.backward()  # the fused optimizer updates the tables inside backward
        gs, gb = _row_grads(step)
        ref["seq"].step(gs)
        ref["bag"].step(gb)
    sd = p.model.state_dict()
    got = {"seq": _local(sd["ec.embeddings.seq.weight"]).detach().cpu().double(),
           "bag": _local(sd["ebc.embedding_bags.bag.weight"]).detach().cpu().double()}
    for k in ("seq", "bag"):
        torch.testing.assert_close(got[k][UNTOUCHED[k]], w0[k][UNTOUCHED[k]].double(), rtol=0, atol=0, msg=k)
        moved = (ref[k].w - w0[k].double()).abs().max()
        assert moved > 0.05, (k, float(moved))  # the update is large against the tolerance below
        torch.testing.assert_close(got[k], ref[k].w, rtol=1e-5, atol=1e-6, msg=k)


def test_adam_on_cpu_is_a_config_error(process_group):
    """fbgemm's CPU kernels have no Adam: one line naming the key, not an assertion deep inside fbgemm."""
    with pytest.raises(ParallelConfigError, match=r"^train\.sparse_optimizer\.name: adam needs CUDA"):
        parallelize(Tables(), {}, sparse_optimizer_cfg={"name": "adam", "lr": 0.1}, device=torch.device("cpu"))
