"""train.precision=fp8_block under FSDP2 on 2 gloo ranks (tests/dist/run_fp8_all_gather.py): weights whose row
shards are whole 128x128 tiles all-gather as FP8 codes + tile scales, quantized once per optimizer step per shard,
and the GEMMs get the bytes quantize_128x128 gives the full weight; other weights keep the param_dtype all-gather;
training gives the same losses and parameters, bit for bit, as without the FP8 all-gather."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from tests.dist._common import torchrun

STEPS = 3


@pytest.fixture(scope="module")
def result(tmp_path_factory):
    return torchrun("run_fp8_all_gather.py", 2, ["--steps", str(STEPS)], tmp_path_factory.mktemp("fp8ag"))


def _all_gather_bytes(n: int, k: int, elem: float) -> int:
    return int(n * k * elem)


@pytest.mark.parametrize("dtype,elem", [("float32", 4), ("bfloat16", 2)])
def test_gathered_fp8_weight_is_the_full_weights_quantization(result, dtype, elem):
    got = result["layers"][dtype]
    assert got["fp8"] == ["0.0", "2.0"]  # 512 and 256 out features: 2 x 2 and 2 x 1 tiles of 128 rows
    assert got["fallback"] == ["1.0 (384 out features do not split into whole 128-row tiles over 2 shards)"]
    for step in got["steps"]:  # before and after an optimizer step
        assert step["gathered_fp8"] == [True, False, True]
        assert step["same_bytes"] == [True, True, True]  # codes, W^T's codes and scales; the fallback's too
        assert step["quantized"] == 2  # each FP8 shard once, though the backward gathers again
        # forward then backward (resharded after forward), one all-gather per unit each: codes + fp32 tile scales
        # for the FP8 layers, the weight in param_dtype for the other
        fp8_0 = _all_gather_bytes(512, 256, 1) + 4 * 2 * 4
        plain_1 = _all_gather_bytes(384, 512, elem)
        fp8_2 = _all_gather_bytes(256, 384, 1) + 2 * 3 * 4
        assert step["all_gather_bytes"] == [fp8_0, plain_1, fp8_2, fp8_2, plain_1, fp8_0]


@pytest.mark.parametrize("param_dtype", ["fp32", "bf16"])
def test_training_equals_the_param_dtype_all_gather(result, param_dtype):
    on, off = result["train"][param_dtype]["True"], result["train"][param_dtype]["False"]
    # the widened model: w1 / w3 (256 rows) and the interaction's kv_proj shard into whole tiles; qkv (384 rows),
    # out, w2 and q_proj (128 rows) do not, and keep the param_dtype all-gather
    assert on["fp8"] == ["blocks.0.ffn.w1", "blocks.0.ffn.w3", "interaction.kv_proj"]
    assert off["fp8"] == [] and on["converted"] == off["converted"]
    assert {"blocks.0.attn.qkv", "blocks.0.ffn.w2", "interaction.q_proj"} <= set(on["converted"])
    assert len(on["losses"]) == STEPS and len(set(on["losses"])) == STEPS
    assert on["losses"] == off["losses"]  # the same bytes into the same GEMMs
    assert on["params"].keys() == off["params"].keys() and on["params"]
    diff = [k for k in on["params"] if on["params"][k] != off["params"][k]]
    assert not diff, diff


def test_checkpoints_hold_plain_shards_and_load_into_fp8_weights(result):
    ckpt = result["train"]["fp32"]["True"]["checkpoint"]
    assert ckpt["plain_model_state"] and ckpt["plain_optimizer_state"]
    assert ckpt["changed"] != ckpt["before"]  # halving the weights changes the loss (the FP8 copies followed)
    assert ckpt["after"] == ckpt["before"]  # the loaded weights, quantized again


@pytest.mark.slow
def test_compiled_regions_train_on_fp8_gathered_weights(tmp_path):
    """The blocks' compiled regions (aot_eager) under FSDP2 take the FP8-gathered weights as parameters: the same
    losses and parameters, bit for bit, as the compiled run with the param_dtype all-gather."""
    got = torchrun("run_fp8_all_gather.py", 2, ["--steps", "2", "--no-layers", "--param-dtypes", "fp32", "--compile",
                                                '{"enabled": true, "backend": "aot_eager"}'], tmp_path, timeout=600)
    on, off = got["train"]["fp32"]["True"], got["train"]["fp32"]["False"]
    assert on["fp8"] == ["blocks.0.ffn.w1", "blocks.0.ffn.w3", "interaction.kv_proj"] and off["fp8"] == []
    assert on["losses"] == off["losses"] and len(on["losses"]) == 2
    assert on["params"] == off["params"]
    ckpt = on["checkpoint"]
    assert ckpt["changed"] != ckpt["before"] and ckpt["after"] == ckpt["before"]


def test_which_weights_gather_in_fp8():
    """Whole 128-row tiles per shard and a bool reshard_after_forward: FP8; anything else keeps the param_dtype
    all-gather, with the reason; one shard rank: nothing to gather, nothing changes."""
    from gem.parallel.fsdp import fp8_all_gather_reason

    w = 512  # out features
    assert fp8_all_gather_reason(w, 2, True) is None and fp8_all_gather_reason(w, 4, False) is None
    assert fp8_all_gather_reason(w, 8, True) == "512 out features do not split into whole 128-row tiles over 8 shards"
    assert fp8_all_gather_reason(384, 2, True) == (
        "384 out features do not split into whole 128-row tiles over 2 shards")  # 192 rows a shard
    assert fp8_all_gather_reason(640, 4, True) is not None  # even, but 160 rows a shard
    assert fp8_all_gather_reason(w, 2, 2) == "reshard_after_forward=2 (an int) needs the param_dtype all-gather"


def test_shard_weight_trains_as_the_plain_weight():
    """enable_fp8_all_gather wraps the qualifying weights (before fully_shard); outside FSDP2 the wrapped weight
    computes, trains and saves as the plain one (every op runs on the tensor it wraps)."""
    import copy

    from gem.model.precision import BlockFP8ShardWeight, apply_precision
    from gem.parallel.fsdp import enable_fp8_all_gather

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(256, 512, bias=False), nn.Linear(512, 384, bias=True))
    apply_precision(model, "fp8_block", "cpu", ["0", "1"])
    plain = copy.deepcopy(model)
    assert enable_fp8_all_gather(model, 1, True) == ([], [])  # one shard rank
    assert not isinstance(model[0].weight.data, BlockFP8ShardWeight)
    on, off = enable_fp8_all_gather(model, 2, True)
    assert on == ["0"] and off == ["1 (384 out features do not split into whole 128-row tiles over 2 shards)"]
    w = model[0].weight
    assert isinstance(w, nn.Parameter) and isinstance(w.data, BlockFP8ShardWeight) and w.requires_grad
    assert torch.equal(w.data.plain(), plain[0].weight)
    opts = [torch.optim.AdamW(m.parameters(), lr=0.1) for m in (model, plain)]
    x = torch.randn(70, 256)
    for _ in range(2):
        for m, opt in zip((model, plain), opts):
            m(x).square().mean().backward()
            opt.step()
            opt.zero_grad()
        assert torch.equal(model(x), plain(x))
    state = model.state_dict()
    assert torch.equal(state["0.weight"], plain[0].weight)
    doubled = {k: 2 * v for k, v in plain.state_dict().items()}
    model.load_state_dict(doubled)
    assert isinstance(model[0].weight.data, BlockFP8ShardWeight)
    assert torch.equal(model[0].weight.data.plain(), doubled["0.weight"])
    plain.load_state_dict(doubled)
    assert torch.equal(model(x), plain(x))  # the FP8 copy follows the load


@pytest.mark.slow
def test_hsdp_gathers_fp8_over_the_shard_dim(tmp_path):
    """HSDP 2 x 2 on 4 ranks: the FP8 all-gather runs over dp_shard (2 shards: the same weights qualify), the
    replicas all-reduce the gradients as before; the same losses and parameters, bit for bit, as without it."""
    got = torchrun("run_fp8_all_gather.py", 4, ["--steps", "2", "--no-layers", "--param-dtypes", "bf16",
                                                "--global-batch", "16", "--parallel",
                                                '{"dense": "fsdp", "dp_replicate": 2, "dp_shard": 2}'],
                   tmp_path, timeout=600)
    on, off = got["train"]["bf16"]["True"], got["train"]["bf16"]["False"]
    assert on["fp8"] == ["blocks.0.ffn.w1", "blocks.0.ffn.w3", "interaction.kv_proj"] and off["fp8"] == []
    assert on["losses"] == off["losses"] and on["params"] == off["params"]
    ckpt = on["checkpoint"]
    assert ckpt["changed"] != ckpt["before"] and ckpt["after"] == ckpt["before"]
