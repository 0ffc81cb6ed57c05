"""The analytic FLOP count behind MFU (gem.model.flops) against torch's FlopCounterMode on the reference path."""

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from gem.model import GEMModel, ModelConfig
from gem.model import flops as F
from gem.ops.jfa import visible_mask
from tests.model._batches import make_batch, tiny_cfg

CONFIGS = {
    "jfa": dict(attention="jfa"),
    "swa": dict(attention="swa", window=5),
    "block": dict(attention="block", block_size=4),
}


def _counted(model, batch) -> dict[str, int]:
    counter = FlopCounterMode(display=False)
    with counter:
        out = model(batch)
        (out.logits.float().sum() + out.aux_loss).backward()
    return {str(op).split(".")[-1]: n for op, n in counter.get_flop_counts()["Global"].items()}


@pytest.mark.parametrize("kind", list(CONFIGS))
def test_analytic_flops_match_the_flop_counter(kind):
    """Equal lengths, so the padded reference computes exactly the pairs it is given: its weight matmuls are the
    analytic 6 x weights count, and its attention matmuls the analytic 3 x 4 H D per pair (before masking)."""
    torch.manual_seed(0)
    cfg = tiny_cfg(num_blocks=2, moe_every=2, **CONFIGS[kind])
    assert any(cfg.is_moe_block(i) for i in range(2))
    b, L = 3, 12
    batch = make_batch(cfg, [L] * b, seed=1)
    counted = _counted(GEMModel(cfg, embedding_device="cpu"), batch)
    tokens = b * L
    weights = 6 * F.tower_weights_per_token(cfg) * tokens + 6 * F.weights_per_example(cfg) * b
    got_weights = sum(n for op, n in counted.items() if op in ("mm", "addmm", "_grouped_mm"))
    # The dense features need no gradient: their first layers skip the 2n input-gradient FLOPs.
    assert got_weights == pytest.approx(weights, rel=5e-3)
    t, it = cfg.tower, cfg.interaction
    tower_full = 3 * 4 * t.num_heads * cfg.tower_head_dim * b * L * L * t.num_blocks
    gdpa = 3 * 4 * it.num_heads * cfg.interaction_head_dim * cfg.num_query_tokens * tokens
    assert counted["bmm"] == tower_full + gdpa
    # what MFU counts: the visible pairs only
    lengths = torch.full((b,), L)
    visible = F.attention_pairs(cfg, lengths) / (b * L * L)
    total = F.train_flops(cfg, torch.arange(b + 1) * L)
    assert total == pytest.approx(weights + tower_full * visible + gdpa, rel=1e-9)


@pytest.mark.parametrize("kind", list(CONFIGS))
def test_attention_pairs_count_the_visible_pairs(kind):
    """The analytic pair count is the mask's exact count less half the diagonal (FlashAttention's L^2 / 2 for
    causal), on jagged lengths including 0, 1 and lengths around the window and block sizes."""
    torch.manual_seed(1)
    cfg = tiny_cfg(**CONFIGS[kind])
    lengths = torch.tensor([0, 1, 2, 4, 5, 6, 7, 8, 9, 13, 40, 3])
    left = {"jfa": -1, "swa": cfg.tower.window, "block": -1}[kind]
    mx = int(lengths.max())
    vis = visible_mask(lengths, lengths, mx, mx, left, 0)
    if kind == "block":
        i = torch.arange(mx)
        vis = vis & ((i[:, None] // cfg.tower.block_size) == (i[None, :] // cfg.tower.block_size))
    exact = int(vis.sum())
    analytic = F.attention_pairs(cfg, lengths)
    assert analytic == pytest.approx(exact - int(lengths.sum()) / 2, abs=1e-9)


def _one(lengths: list[int]) -> torch.Tensor:
    return torch.tensor([0, *lengths]).cumsum(0)


@pytest.mark.parametrize("merge", ["towers", "time"])
def test_example_flops_are_each_examples_step_flops(merge):
    """example_flops (data.balance's cost) of each example is train_flops of a batch holding that example alone, per
    history through its own tower (or the one merged tower), and they sum to the batch's train_flops."""
    from tests.data.test_inputs import _timed
    from tests.model._batches import tiny_dict, tiny_schema

    d = {**tiny_dict(), "history_merge": merge}
    if merge == "towers":
        d["towers"] = {"search": {"num_blocks": 1, "attention": "swa", "window": 2}}
    cfg = ModelConfig.from_dict(d, tiny_schema(_timed()))
    watch, search = [0, 1, 5, 9, 3], [2, 0, 4, 1, 0]
    per = F.example_flops(cfg, {"watch": torch.tensor(watch), "search": torch.tensor(search)})
    assert per.dtype == torch.float64 and per.shape == (5,)
    alone = [F.train_flops(cfg, [_one([w]), _one([s])]) for w, s in zip(watch, search)]
    assert per.tolist() == alone
    assert F.train_flops(cfg, [_one(watch), _one(search)]) == sum(alone)
    if merge == "towers":  # by hand: the search tower's window and block count apply to search tokens only
        it, tw, ts = cfg.interaction, cfg.tower_for("watch"), cfg.tower_for("search")
        w, s = 9, 1
        want = 6 * F.weights_per_example(cfg) + 6 * F.tower_weights_per_token(cfg, "watch") * w
        want += 6 * F.tower_weights_per_token(cfg, "search") * s
        want += 3 * 4 * tw.num_heads * tw.head_dim * tw.num_blocks * w * w / 2
        want += 3 * 4 * ts.num_heads * ts.head_dim * ts.num_blocks * s * s / 2
        want += 3 * 4 * it.num_heads * cfg.interaction_head_dim * cfg.num_query_tokens * (w + s)
        assert per[3].item() == want
    with pytest.raises(ValueError, match="example_flops: lengths of"):
        F.example_flops(cfg, {"watch": torch.tensor(watch)})
