"""The real Trainer on 4 gloo ranks equals one rank on the same rows: losses at every step and every trained
parameter (dense and tables), with dense AdamW, gradient clipping, warmup + cosine decay, for the DDP, HSDP (FSDP2
inside a replica), HSDP + expert-parallel and FSDP + few experts (hidden dim sharded) layouts, in fp32 and under
bf16 autocast. The shared 4-rank launch (tests/dist/_four_ranks.py) runs the layouts one after another; the
one-rank references run in this process."""

from __future__ import annotations

import pytest
import torch

from tests.dist._four_ranks import GLOBAL_BATCH, REFERENCE, REFERENCES, STEPS, TRAIN_LAYOUTS, train_overrides
from tests.dist.run_trainer import train_layouts

pytestmark = pytest.mark.slow

# fp32: the same sums in another order (losses ~1e-7 apart, parameters ~1e-5 of their change in 5 steps)
FP32_LOSS_ATOL, FP32_PARAM_RTOL = 2e-6, 2e-4
# bf16 autocast: per-rank weight gradients are rounded to bf16 before they are summed, so gradients differ by about
# eps_bf16 of their size; AdamW's first steps are near sign(g) * lr, which flips for elements whose gradient is ~0.
BF16_EPS = torch.finfo(torch.bfloat16).eps


def _rel_change_error(run: dict, ref: dict, key: str) -> float:
    """|run - ref| / |ref's change in training| (Frobenius) of one parameter."""
    moved = (ref["params"][key] - ref["initial"][key]).norm()
    assert moved > 0, key
    return float((run["params"][key] - ref["params"][key]).norm() / moved)


def test_trainer_n_ranks_equal_one_rank(four_ranks, process_group):
    common = train_overrides(four_ranks["rows"])
    refs = train_layouts(common, REFERENCES, GLOBAL_BATCH)
    ref = refs["fp32"]
    losses = torch.tensor(ref["losses"])
    # it trained: every parameter moves (checked per parameter below) and the steps' losses differ (each step has
    # its own batch, so they need not fall monotonically in a few steps)
    assert len(losses) == STEPS and float(losses.max() - losses.min()) > 1e-3
    assert min(ref["grad_norms"]) > 0.05  # clipping was active at every step
    assert ref["lrs"][0] < ref["lrs"][1] and ref["lrs"][-1] < ref["lrs"][2]  # warmup, then decay
    got = four_ranks["train"]
    assert set(got) == set(TRAIN_LAYOUTS)
    for name, run in got.items():
        want = refs[REFERENCE[name]]
        assert run["params"].keys() == want["params"].keys(), name
        worst = max((_rel_change_error(run, want, k), k) for k in want["params"])
        if REFERENCE[name] == "bf16":
            # losses within one bf16 rounding of their size; parameters within a fifth of their change
            atol = BF16_EPS * float(torch.tensor(want["losses"]).abs().max())
            torch.testing.assert_close(torch.tensor(run["losses"]), torch.tensor(want["losses"]), rtol=0, atol=atol,
                                       msg=name)
            assert worst[0] < 0.2, (name, worst)
        else:
            torch.testing.assert_close(torch.tensor(run["losses"]), torch.tensor(want["losses"]), rtol=0,
                                       atol=FP32_LOSS_ATOL, msg=name)
            assert worst[0] < FP32_PARAM_RTOL, (name, worst)
