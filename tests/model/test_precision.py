"""train.precision: the MXFP8 Linear against hand-written quantize-dequantize references, the module filter on the
tiny model, the config errors, and a short mxfp8 training run against fp32 from the same seed."""

from __future__ import annotations

import logging
import socket

import pytest
import torch
from torch import nn

from gem.config import ConfigError
from gem.model import GEMModel
from gem.model import precision as prec
from gem.model.moe import MoE
from gem.model.precision import DEFAULT_FILTER, FP8Linear, MXFP8Linear, apply_precision, check_precision_device
from gem.ops import mx
from tests.model._batches import tiny_cfg


def _fq(t: torch.Tensor, elem: str, axis: int, dtype=torch.float32) -> torch.Tensor:
    data, scale = mx.quantize(t, block=32, elem=elem, axis=axis, kernel="reference")
    return mx.dequantize(data, scale, block=32, axis=axis, dtype=dtype, kernel="reference")


def _mx_linear(k: int, n: int, bias: bool, seed: int) -> MXFP8Linear:
    torch.manual_seed(seed)
    lin = nn.Sequential(nn.Linear(k, n, bias=bias))
    apply_precision(lin, "mxfp8", "cpu", ["0"])
    assert type(lin[0]) is MXFP8Linear
    return lin[0]


@pytest.mark.parametrize("shape,k,n,bias,seed", [((37, 64), 64, 96, False, 0), ((3, 5, 32), 32, 64, True, 1),
                                                 ((70, 128), 128, 32, True, 2)])
def test_mxfp8_linear_forward_backward_match_the_reference(shape, k, n, bias, seed):
    lin = _mx_linear(k, n, bias, seed)
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(shape, generator=g) * 3).requires_grad_()
    gy = torch.randn(*shape[:-1], n, generator=g) * 1e-3
    y = lin(x)
    y.backward(gy)

    w = lin.weight.detach()
    x2, g2 = x.detach().reshape(-1, k), gy.reshape(-1, n)
    want = _fq(x2, "e4m3", -1) @ _fq(w, "e4m3", 1).t()
    if bias:
        want = want + lin.bias.detach()
    assert torch.equal(y.detach().reshape(-1, n), want)
    # the fake quantization really changes the result, so equality above is not the plain matmul's
    assert not torch.allclose(want, x2 @ w.t() + (lin.bias.detach() if bias else 0), rtol=0, atol=1e-6)

    # straight-through: the GEMMs of the exact gradient, each operand quantized along its reduction axis
    dx = _fq(g2, "e4m3", -1) @ _fq(w, "e4m3", 0)
    dw = _fq(g2, "e4m3", 0).t() @ _fq(x2, "e4m3", 0)
    assert torch.equal(x.grad.reshape(-1, k), dx)
    assert torch.equal(lin.weight.grad, dw)
    if bias:
        assert torch.equal(lin.bias.grad, g2.sum(0))
    # ... and stays close to the exact gradient
    torch.testing.assert_close(x.grad.reshape(-1, k), g2 @ w, rtol=0.15, atol=2e-4)


def _blocked_index(rows: int, blocks: int) -> torch.Tensor:
    """Where scale (r, c) sits in the block-scaled GEMM layout (cuBLAS's formula, written out)."""
    r, c = torch.arange(rows)[:, None], torch.arange(blocks)[None, :]
    tiles_per_row = -(-blocks // 4)
    return ((r // 128) * tiles_per_row + c // 4) * 512 + (r % 32) * 16 + (r % 128) // 32 * 4 + c % 4


def _unblock(flat: torch.Tensor, rows: int, blocks: int) -> torch.Tensor:
    return flat.view(torch.uint8)[_blocked_index(rows, blocks)]


def _reference_block_scaled_mm(qa, qb, sa, sb, dt):
    """What the MX tensor cores compute from the operands the block-scaled path hands torch._scaled_mm."""
    assert qa.dtype == qb.dtype == torch.float8_e4m3fn and sa.dtype == sb.dtype == torch.float8_e8m0fnu
    (m, k), n = qa.shape, qb.shape[0]
    assert k % 32 == 0 and qb.shape[1] == k and qa.is_contiguous() and qb.is_contiguous()
    assert sa.numel() == -(-m // 128) * 128 * -(-k // 128) * 4 and sb.numel() == -(-n // 128) * 128 * -(-k // 128) * 4
    a = mx.dequantize(qa, _unblock(sa, m, k // 32), 32, -1, torch.float32, kernel="reference")
    b = mx.dequantize(qb, _unblock(sb, n, k // 32), 32, -1, torch.float32, kernel="reference")
    return (a @ b.t()).to(dt)


@pytest.mark.parametrize("tokens", [64, 37, 1, 0])
def test_mxfp8_block_scaled_path_feeds_the_gemm_what_the_emulation_multiplies(monkeypatch, tokens):
    """On sm_100+ MXFP8Linear hands E4M3 data and tiled E8M0 scales to torch._scaled_mm. Here a reference GEMM reads
    those operands back: forward, input and weight gradients equal the emulation's (rounded to the bf16 the GEMM
    writes); 37 or 1 tokens pad the weight gradient's reduction to whole blocks, 0 tokens give empty outputs
    and a zero weight gradient."""
    emulated = _mx_linear(64, 96, False, 5)
    hardware = _mx_linear(64, 96, False, 5)
    g = torch.Generator().manual_seed(tokens)
    x = torch.randn(tokens, 64, generator=g) * 3
    # bf16 values: the block-scaled path writes bf16, so its output gradient arrives in bf16
    gy = (torch.randn(tokens, 96, generator=g) * 1e-3).to(torch.bfloat16).float()
    xe, xh = x.clone().requires_grad_(), x.clone().requires_grad_()
    ye = emulated(xe)
    ye.backward(gy)
    calls = []
    monkeypatch.setattr(prec, "mx_gemm_supported", lambda device: True)
    monkeypatch.setattr(prec, "_block_scaled_mm", lambda *a: calls.append(a) or _reference_block_scaled_mm(*a))
    yh = hardware(xh)
    yh.backward(gy)
    if tokens == 0:
        assert not calls and yh.shape == (0, 96) and not hardware.weight.grad.any()
        return
    assert len(calls) == 3 and all(c[-1] == torch.bfloat16 for c in calls)
    assert [c[0].shape[1] for c in calls] == [64, 96, -(-tokens // 32) * 32]  # K of forward, dgrad, wgrad

    def bf16(t):
        return t.to(torch.bfloat16).float()

    exact = tokens % 32 == 0
    for got, want in ((yh, ye), (xh.grad, xe.grad), (hardware.weight.grad, emulated.weight.grad)):
        if exact or got is not hardware.weight.grad:
            assert torch.equal(got.detach(), bf16(want.detach()))
        else:  # zero padding of the reduction may change the fp32 summation order
            torch.testing.assert_close(got, bf16(want), rtol=1e-2, atol=1e-7)


def test_blocked_scales_follow_the_gemm_layout():
    for rows, blocks in [(0, 4), (1, 1), (127, 3), (128, 4), (129, 5), (300, 9)]:
        bits = torch.randint(0, 255, (rows, blocks), dtype=torch.uint8)
        flat = mx.blocked_scales(bits)
        assert flat.dtype == torch.float8_e8m0fnu and flat.numel() == -(-rows // 128) * 128 * -(-blocks // 4) * 4
        assert torch.equal(_unblock(flat, rows, blocks), bits)
        padding = torch.ones(flat.numel(), dtype=torch.bool)
        padding[_blocked_index(rows, blocks).flatten()] = False
        assert not flat.view(torch.uint8)[padding].any()  # padded rows / blocks hold the smallest scale
    with pytest.raises(ValueError, match="blocked_scales: scale must be 2-d"):
        mx.blocked_scales(torch.zeros(4, dtype=torch.uint8))


def test_mxfp8_linear_under_autocast_multiplies_in_bf16():
    lin = _mx_linear(64, 32, True, 3)
    x = torch.randn(10, 64)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = lin(x)
    assert y.dtype == torch.bfloat16
    want = _fq(x, "e4m3", -1, torch.bfloat16) @ _fq(lin.weight.detach(), "e4m3", 1, torch.bfloat16).t()
    assert torch.equal(y, want + lin.bias.detach().to(torch.bfloat16))


def test_filter_converts_exactly_the_matching_linears_and_keeps_parameter_names(caplog):
    cfg = tiny_cfg()
    torch.manual_seed(0)
    model = GEMModel(cfg)
    before = {k: v for k, v in model.state_dict().items()}
    params_before = dict(model.named_parameters())
    # blocks.1 is the MoE block: its ffn.w1..w3 are expert parameters, not Linear modules
    converted = apply_precision(model, "mxfp8", "cpu", DEFAULT_FILTER)
    want = ["blocks.0.attn.qkv", "blocks.0.attn.out", "blocks.0.ffn.w1", "blocks.0.ffn.w3", "blocks.0.ffn.w2",
            "blocks.1.attn.qkv", "blocks.1.attn.out"]
    assert sorted(converted) == sorted(want)
    for name, mod in model.named_modules():
        if name in want:
            assert type(mod) is MXFP8Linear, name
        elif isinstance(mod, nn.Linear):
            assert type(mod) is nn.Linear, name
    after = model.state_dict()
    assert list(after) == list(before)
    assert all(after[k] is before[k] or torch.equal(after[k], before[k]) for k in before)
    assert {k: v for k, v in model.named_parameters()}.keys() == params_before.keys()
    assert all(p is params_before[k] for k, p in model.named_parameters())

    # a pattern on a layer whose dims are not multiples of 32 keeps it nn.Linear, and says so
    model = GEMModel(cfg)
    with caplog.at_level(logging.WARNING, logger="gem.model"):
        converted = apply_precision(model, "mxfp8", "cpu", ["heads.heads.*.2", "blocks.0.attn.qkv"])
    assert converted == ["blocks.0.attn.qkv"]
    outs = [model.get_submodule(f"heads.heads.{i}.2") for i in range(2)]  # 32 -> 1 output layers
    assert all(type(m) is nn.Linear and m.out_features == 1 for m in outs)
    assert sum("stay nn.Linear" in r.getMessage() for r in caplog.records) == 1

    # bf16: nothing changes
    model = GEMModel(cfg)
    assert apply_precision(model, "bf16", "cpu") == []
    assert all(type(m) is nn.Linear for m in model.modules() if isinstance(m, nn.Linear))


def test_precision_config_errors_are_one_line():
    from gem.train.config import TrainConfig

    with pytest.raises(ConfigError) as e:
        check_precision_device("fp8", torch.device("cpu"))
    assert str(e.value) == ("train.precision: fp8 needs a GPU with FP8 tensor cores (sm_89+) (got fp8 on cpu); "
                            "use mxfp8 for emulated numerics or bf16")
    check_precision_device("mxfp8", torch.device("cpu"))
    with pytest.raises(ConfigError) as e:
        apply_precision(GEMModel(tiny_cfg()), "fp8", "cpu")
    assert str(e.value).startswith("train.precision: fp8 needs a GPU")
    with pytest.raises(ConfigError) as e:
        TrainConfig.from_dict({"precision": "fp4"})
    assert str(e.value) == "train.precision: must be bf16, fp8, fp8_block or mxfp8 (got fp4)"
    with pytest.raises(ConfigError) as e:
        TrainConfig.from_dict({"precision_filter": "blocks.*"})
    assert str(e.value) == "train.precision_filter: expected a list (got blocks.*)"
    with pytest.raises(ConfigError) as e:
        apply_precision(GEMModel(tiny_cfg()), "mxfp8", "cpu", ["tower.*"])
    assert str(e.value) == "train.precision_filter: matches no nn.Linear of the model (got ['tower.*'])"


def test_fp8_is_refused_at_the_preflight_check(capsys, monkeypatch):
    from gem.cli.train import main

    if torch.cuda.is_available():
        pytest.skip("this machine may have FP8 tensor cores")
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    assert main(["--check", "train.precision=fp8"]) == 2
    msg = capsys.readouterr().err
    assert "gem-train: error: train.precision: fp8 needs a GPU with FP8 tensor cores (sm_89+)" in msg
    assert msg.count("\n") == 1


def _rows_dq(t: torch.Tensor) -> torch.Tensor:
    """Row-wise E4M3 quantize-dequantize written out: scale = amax / 448 per row."""
    s = t.float().abs().amax(-1, keepdim=True).clamp_min(1e-12) / 448.0
    return (t.float() / s).clamp(-448, 448).to(torch.float8_e4m3fn).float() * s


def test_fp8_linear_recipe_on_cpu():
    """torch._scaled_mm runs row-wise on the CPU too: forward and input gradient are the E4M3 row-wise GEMMs,
    the weight gradient is the bf16 GEMM of the unquantized operands."""
    torch.manual_seed(0)
    lin = FP8Linear(64, 48, bias=True)
    x = torch.randn(37, 64, dtype=torch.bfloat16, requires_grad=True)
    gy = torch.randn(37, 48, dtype=torch.bfloat16)
    y = lin(x)
    y.backward(gy)
    w = lin.weight.detach()
    xb = x.detach()
    y_ref = _rows_dq(xb) @ _rows_dq(w).t() + lin.bias.detach()  # the fp32 master weight is what gets quantized
    dx_ref = _rows_dq(gy) @ _rows_dq(w.t()).t()
    dw_ref = gy.float().t() @ xb.float()
    assert y.dtype == torch.bfloat16 and x.grad.dtype == torch.bfloat16
    torch.testing.assert_close(y.float(), y_ref, rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(x.grad.float(), dx_ref, rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(lin.weight.grad.float(), dw_ref, rtol=2e-2, atol=5e-2)
    torch.testing.assert_close(lin.bias.grad.float(), gy.float().sum(0), rtol=2e-2, atol=5e-2)


def _scaled_grouped_mm_emulated(a, b, sa, sb, offs, out_dtype, use_fast_accum=False):
    """torch._scaled_grouped_mm (2-D a, 3-D b) on the CPU: one row-wise torch._scaled_mm per group."""
    out, start = [], 0
    for e, end in enumerate(offs.tolist()):
        out.append(torch._scaled_mm(a[start:end], b[e], scale_a=sa[start:end, None], scale_b=sb[e][None],
                                    out_dtype=out_dtype))
        start = end
    return torch.cat(out)


@pytest.mark.parametrize("counts", [(16, 32, 16), (48, 0, 16), (0, 0, 16)])
def test_fp8_grouped_mm_recipe(monkeypatch, counts):
    """The MoE experts' fp8 grouped GEMM (emulated _scaled_grouped_mm on the CPU) against the dequantized
    reference per expert, forward and both gradients; groups may be empty."""
    monkeypatch.setattr(torch, "_scaled_grouped_mm", _scaled_grouped_mm_emulated, raising=False)
    torch.manual_seed(sum(counts))
    e, k, n = len(counts), 32, 48
    offs = torch.tensor(counts).cumsum(0).to(torch.int32)
    a = torch.randn(sum(counts), k, dtype=torch.bfloat16, requires_grad=True)
    w = torch.randn(e, k, n, dtype=torch.bfloat16, requires_grad=True)
    g = torch.randn(sum(counts), n, dtype=torch.bfloat16)
    y = prec.fp8_grouped_mm(a, w, offs)
    y.backward(g)
    start = 0
    for i, c in enumerate(counts):
        rows = slice(start, start + c)
        start += c
        wt = w.detach()[i]
        torch.testing.assert_close(y[rows].float(), _rows_dq(a.detach()[rows]) @ _rows_dq(wt.t()).t(),
                                   rtol=2e-2, atol=2e-2)
        torch.testing.assert_close(a.grad[rows].float(), _rows_dq(g[rows]) @ _rows_dq(wt).t(), rtol=2e-2, atol=2e-2)
        torch.testing.assert_close(w.grad[i].float(), a.detach()[rows].float().t() @ g[rows].float(),
                                   rtol=2e-2, atol=5e-2)


def test_fp8_conversion_covers_linears_and_moe_experts(monkeypatch):
    """fp8 (device check bypassed: the conversion itself is device-free) swaps the filtered nn.Linear layers and
    switches the MoE layers' experts to fp8 where the filter names them (not by default); mxfp8 leaves MoE layers
    alone; torchao missing is one line."""
    monkeypatch.setattr(prec, "check_precision_device", lambda *a: None)
    model = GEMModel(tiny_cfg())
    moes = {n for n, m in model.named_modules() if isinstance(m, MoE)}
    assert not set(apply_precision(model, "fp8", "cpu", DEFAULT_FILTER)) & moes
    assert not any(m.fp8_experts for m in model.modules() if isinstance(m, MoE))
    with_experts = (*DEFAULT_FILTER, "blocks.*.ffn")
    model = GEMModel(tiny_cfg())
    converted = apply_precision(model, "fp8", "cpu", with_experts)
    assert moes and moes <= set(converted)
    assert all(m.fp8_experts for m in model.modules() if isinstance(m, MoE))
    assert all(type(m) is FP8Linear for n, m in model.named_modules() if n in converted and n not in moes)
    model = GEMModel(tiny_cfg())
    assert not set(apply_precision(model, "mxfp8", "cpu", with_experts)) & moes
    assert not any(m.fp8_experts for m in model.modules() if isinstance(m, MoE))
    try:
        import torchao  # noqa: F401
    except ImportError:
        with pytest.raises(ConfigError) as e:
            apply_precision(GEMModel(tiny_cfg()), "fp8", "cpu", DEFAULT_FILTER, backend="torchao")
        assert str(e.value).startswith("train.fp8_backend: torchao is not installed") and "\n" not in str(e.value)
    with pytest.raises(ConfigError, match="train.fp8_backend: must be one of gem, torchao"):
        apply_precision(GEMModel(tiny_cfg()), "fp8", "cpu", DEFAULT_FILTER, backend="te")


@pytest.mark.gpu
def test_fp8_grouped_mm_close_to_bf16_on_gpu():
    if not (torch.cuda.is_available() and torch.cuda.get_device_capability() >= (9, 0)):
        pytest.skip("needs an sm_90 GPU (torch._scaled_grouped_mm)")
    torch.manual_seed(0)
    counts = (256, 0, 512, 16, 128)
    offs = torch.tensor(counts, device="cuda").cumsum(0).to(torch.int32)
    a = torch.randn(sum(counts), 256, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    w = (torch.randn(len(counts), 256, 512, device="cuda") / 16).to(torch.bfloat16).requires_grad_()
    ar, wr = (t.detach().clone().requires_grad_() for t in (a, w))
    g = torch.randn(sum(counts), 512, device="cuda", dtype=torch.bfloat16)
    prec.fp8_grouped_mm(a, w, offs).backward(g)
    y, yr = prec.fp8_grouped_mm(a, w, offs), torch._grouped_mm(ar, wr, offs=offs)
    yr.backward(g)

    def rel(p, q):
        return ((p.float() - q.float()).norm() / q.float().norm()).item()

    assert rel(y, yr) < 0.05 and rel(a.grad, ar.grad) < 0.1 and rel(w.grad, wr.grad) < 0.02


@pytest.mark.gpu
def test_fp8_linear_close_to_bf16_on_gpu():
    if not (torch.cuda.is_available() and torch.cuda.get_device_capability() >= (8, 9)):
        pytest.skip("needs a GPU with FP8 tensor cores")
    torch.manual_seed(0)
    lin = nn.Sequential(nn.Linear(256, 512, bias=True)).cuda()
    ref = nn.Linear(256, 512).cuda()
    ref.load_state_dict(lin[0].state_dict())
    apply_precision(lin, "fp8", "cuda", ["0"])
    assert type(lin[0]) is FP8Linear
    x = torch.randn(100, 256, device="cuda", requires_grad=True)
    xr = x.detach().clone().requires_grad_()
    with torch.autocast("cuda", dtype=torch.bfloat16):
        y, yr = lin(x), ref(xr)
    gy = torch.randn_like(yr)
    y.backward(gy)
    yr.backward(gy)

    def rel(a, b):
        return ((a.float() - b.float()).norm() / b.float().norm()).item()

    assert rel(y, yr) < 0.05 and rel(x.grad, xr.grad) < 0.1 and rel(lin[0].weight.grad, ref.weight.grad) < 0.1


@pytest.mark.slow
def test_mxfp8_linear_compiled_equals_eager():
    """Blocks compile their dense parts on CUDA: the MXFP8 Linear inside torch.compile (dynamic token counts)
    gives the eager result, forward and backward."""
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(32, 64, bias=False), nn.SiLU(), nn.Linear(64, 32, bias=True))
    apply_precision(m, "mxfp8", "cpu", ["0", "2"])
    cm = torch.compile(m, dynamic=True)
    for n in (50, 77):
        x = torch.randn(n, 32, requires_grad=True)
        xc = x.detach().clone().requires_grad_()
        y, yc = m(x), cm(xc)
        gy = torch.randn_like(y) * 1e-3
        y.backward(gy)
        grads = [p.grad.clone() for p in m.parameters()]
        m.zero_grad()
        yc.backward(gy)
        assert torch.equal(y, yc) and torch.equal(x.grad, xc.grad)
        assert all(torch.equal(p.grad, g) for p, g in zip(m.parameters(), grads))
        m.zero_grad()


def _training_runs(precisions, extra=()):
    """{precision: fit result} of 200 steps of the tiny model on synthetic data from one seed."""
    from gem.train.trainer import Trainer
    from tests.train._util import SMALL, compose

    results = {}
    for precision, cls in precisions:
        t = Trainer(compose(SMALL + ["train.steps=200", "train.eval_every=0", "train.seed=0", "train.log_every=50",
                                     "data.eval_batches=8", f"train.precision={precision}", *extra]))
        try:
            kinds = {type(m) for m in t.inner.modules()}
            assert cls is None or cls in kinds
            results[precision] = t.fit()
        finally:
            t.close()
    return results


def _assert_ne_tracks(results, ref="bf16"):
    """Eval NE within 1% (relative) of the `ref` run per task, and the low-precision trajectories really differ."""
    base = results[ref]
    for precision, res in results.items():
        if precision == ref:
            continue
        for task in ("click", "conversion"):
            assert base.eval_metrics[f"{task}/ne"] < 0.99, base.eval_metrics  # trained models are compared
            assert res.eval_metrics[f"{task}/ne"] == pytest.approx(base.eval_metrics[f"{task}/ne"], rel=0.01), (
                precision, task, base.eval_metrics, res.eval_metrics)
        assert res.losses != base.losses


@pytest.mark.slow
def test_low_precision_training_runs_track_fp32(monkeypatch):
    """200 steps of the tiny model on synthetic data, fp32 (autocast none on CPU) vs mxfp8 and fp8 from the same
    seed: eval NE within 1% (relative) per task. fp8 runs its recipe through torch._scaled_mm on the CPU (the
    device check is bypassed): the recipe's numerics, with exact accumulation."""
    monkeypatch.setattr(prec, "check_precision_device", lambda *a: None)
    _assert_ne_tracks(_training_runs((("bf16", None), ("mxfp8", MXFP8Linear), ("fp8", FP8Linear))))


@pytest.mark.gpu
def test_fp8_training_run_tracks_bf16_on_gpu():
    """The same 200 steps on the GPU with the Triton kernels and bf16 autocast: fp8 (tensor-core GEMMs) vs bf16."""
    if not (torch.cuda.is_available() and prec.fp8_supported(torch.device("cuda"))):
        pytest.skip("needs a GPU with FP8 tensor cores")
    _assert_ne_tracks(_training_runs((("bf16", None), ("fp8", FP8Linear)), extra=["model.kernel=auto"]))


def test_fp8_models_compile_without_mix_order_reduction(monkeypatch):
    """Only gem's fp8 (dense layers or experts) turns Inductor's mix-order reduction off, and parallelize hands the
    option to the compiled regions."""
    monkeypatch.setattr(prec, "check_precision_device", lambda *a: None)
    assert prec.inductor_options(GEMModel(tiny_cfg())) == {}
    model = GEMModel(tiny_cfg())
    apply_precision(model, "mxfp8", "cpu", DEFAULT_FILTER)
    assert prec.inductor_options(model) == {}
    for patterns in (DEFAULT_FILTER, ("blocks.*.ffn",)):
        model = GEMModel(tiny_cfg())
        apply_precision(model, "fp8", "cpu", patterns)
        assert prec.inductor_options(model) == {"triton.mix_order_reduction": False}

    from gem.parallel import api

    seen = []
    monkeypatch.setattr(api, "apply_compile", lambda inner, blocks, **kw: seen.append(kw))
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(port))
    was_up = torch.distributed.is_initialized()
    try:
        api.parallelize(model, {}, compile_cfg={"enabled": True},
                        sparse_optimizer_cfg={"name": "rowwise_adagrad", "lr": 0.1}, device=torch.device("cpu"))
    finally:
        if torch.distributed.is_initialized() and not was_up:
            torch.distributed.destroy_process_group()
    assert seen == [{"backend": "inductor", "options": {"triton.mix_order_reduction": False}}]


@pytest.mark.gpu
def test_mxfp8_block_scaled_gemm_on_mx_tensor_cores():
    """sm_100+ only: the block-scaled GEMM agrees with the emulation up to accumulation order and bf16 output."""
    if not (torch.cuda.is_available() and prec.mx_gemm_supported(torch.device("cuda"))):
        pytest.skip("needs MX tensor cores (sm_100+)")
    g = torch.Generator(device="cuda").manual_seed(0)
    for m, k, n in [(37, 64, 96), (1024, 1024, 3072), (4096, 4096, 1024)]:
        a = torch.randn(m, k, device="cuda", generator=g, dtype=torch.bfloat16)
        b_t = torch.randn(n, k, device="cuda", generator=g, dtype=torch.bfloat16)
        got = prec._MXBlockScaledGemms.mm(a, b_t, torch.bfloat16).float()
        want = prec._MXGemms.mm(a.float(), b_t.float(), torch.float32)
        torch.testing.assert_close(got, want, rtol=1e-2, atol=1e-2 * want.abs().max().item())
