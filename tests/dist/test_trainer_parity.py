"""The real Trainer on 4 gloo ranks equals one rank on the same rows: losses at every step and every trained
parameter (dense and tables), with dense AdamW, gradient clipping, warmup + cosine decay, for the DDP, HSDP (FSDP2
inside a replica) and HSDP + expert-parallel layouts, in fp32 and under bf16 autocast. One 4-rank launch runs the
layouts one after another; the one-rank references run in this process."""

from __future__ import annotations

import json

import pytest
import torch

from tests.dist._common import torchrun
from tests.dist.run_trainer import train_layouts

pytestmark = pytest.mark.slow

GLOBAL_BATCH, STEPS = 16, 6
BF16 = ["train.autocast=bf16"]
LAYOUTS = {
    "ddp": ["parallel=ddp"],
    "hsdp": ["parallel=hsdp", "parallel.reshard_after_forward=false", "parallel.activation_checkpoint=selective",
             "parallel.ac_every=2"],
    "hsdp_ep": ["parallel=hsdp_ep", "parallel.activation_checkpoint=full"],
    "hsdp_ep_bf16": ["parallel=hsdp_ep"] + BF16,
}
# fp32: the same sums in another order (losses ~1e-7 apart, parameters ~1e-5 of their change in 6 steps)
FP32_LOSS_ATOL, FP32_PARAM_RTOL = 2e-6, 2e-4
# bf16 autocast: per-rank weight gradients are rounded to bf16 before they are summed, so gradients differ by about
# eps_bf16 of their size; AdamW's first steps are near sign(g) * lr, which flips for elements whose gradient is ~0.
BF16_EPS = torch.finfo(torch.bfloat16).eps


def _common(data: str) -> list[str]:
    return [
        "model.kernel=reference", "model.tower.num_blocks=2", "model.moe.aux_loss_coef=0",  # aux: a per-rank statistic
        "data=parquet", f"data.paths=[{data}]", f"data.eval_paths=[{data}]", "data.eval_batches=0",
        "data.schema.history.max_len=16",
        f"train.steps={STEPS}", "train.warmup_steps=2", "train.min_lr_ratio=0.1", "train.lr=0.01",
        "train.grad_clip=0.05", "train.autocast=none", "train.eval_every=0", "train.log_every=1",
        "train.tensorboard=false", "train.sparse_optimizer.lr=0.05",
    ]


@pytest.fixture(scope="module")
def parquet_rows(tmp_path_factory) -> str:
    from omegaconf import OmegaConf

    from gem.data import DataConfig, SyntheticDataset
    from gem.data.parquet import write_parquet
    from tests.dist._common import ROOT

    c = OmegaConf.to_container(OmegaConf.load(ROOT / "configs/data/synthetic.yaml"))
    c["schema"]["history"]["max_len"] = 16
    d = DataConfig.from_dict(c)
    path = tmp_path_factory.mktemp("rows") / "train.parquet"
    write_parquet(SyntheticDataset(d.schema, 0, GLOBAL_BATCH), str(path), STEPS)
    return str(path)


def _rel_change_error(run: dict, ref: dict, key: str) -> float:
    """|run - ref| / |ref's change in training| (Frobenius) of one parameter."""
    moved = (ref["params"][key] - ref["initial"][key]).norm()
    assert moved > 0, key
    return float((run["params"][key] - ref["params"][key]).norm() / moved)


def test_trainer_n_ranks_equal_one_rank(tmp_path, parquet_rows, process_group):
    common = _common(parquet_rows)
    refs = train_layouts(common, {"fp32": [], "bf16": BF16}, GLOBAL_BATCH)
    ref = refs["fp32"]
    losses = torch.tensor(ref["losses"])
    assert len(losses) == STEPS and float(losses[0] - losses[-1]) > 1e-3  # it trained
    assert min(ref["grad_norms"]) > 0.05  # clipping was active at every step
    assert ref["lrs"][0] < ref["lrs"][1] and ref["lrs"][-1] < ref["lrs"][2]  # warmup, then decay
    got = torchrun("run_trainer.py", 4, ["--common", json.dumps(common), "--layouts", json.dumps(LAYOUTS),
                                         "--global-batch", str(GLOBAL_BATCH)],
                   tmp_path, timeout=400, load=lambda p: torch.load(p, weights_only=True))
    assert set(got) == set(LAYOUTS)
    for name, run in got.items():
        bf16 = name.endswith("_bf16")
        want = refs["bf16" if bf16 else "fp32"]
        assert run["params"].keys() == want["params"].keys(), name
        worst = max((_rel_change_error(run, want, k), k) for k in want["params"])
        if bf16:
            # losses within one bf16 rounding of their size; parameters within a fifth of their change
            atol = BF16_EPS * float(torch.tensor(want["losses"]).abs().max())
            torch.testing.assert_close(torch.tensor(run["losses"]), torch.tensor(want["losses"]), rtol=0, atol=atol,
                                       msg=name)
            assert worst[0] < 0.2, (name, worst)
        else:
            torch.testing.assert_close(torch.tensor(run["losses"]), losses, rtol=0, atol=FP32_LOSS_ATOL, msg=name)
            assert worst[0] < FP32_PARAM_RTOL, (name, worst)
