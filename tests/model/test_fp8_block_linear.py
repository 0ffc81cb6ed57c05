"""train.precision=fp8_block: BlockFP8Linear's three GEMMs against block-quantized references built independently
of the kernels' layouts, the stated GEMM error bound against the exact product, ragged and empty token counts,
the default filter, and tracing under torch.compile."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from gem.model.precision import BLOCK_FILTER, BlockFP8Linear, apply_precision
from gem.ops import fp8_block as fb

U = 2.0**-4  # E4M3 round-to-nearest: relative error of a normal value


def _deq_rows(t):
    """t [R, C] quantized in 1x128 blocks along C (reference) and dequantized, fp64."""
    q, s = fb.quantize_1x128(t, kernel="reference")
    return fb.dequantize_1x128(q, s, torch.float32, kernel="reference").double()


def _deq_tiles(w):
    q, _, s = fb.quantize_128x128(w, kernel="reference")
    return fb.dequantize_128x128(q, s, torch.float32, kernel="reference").double()


def _linear(k, n, bias, seed):
    torch.manual_seed(seed)
    m = nn.Sequential(nn.Linear(k, n, bias=bias))
    assert apply_precision(m, "fp8_block", "cpu", ["0"]) == ["0"]
    assert type(m[0]) is BlockFP8Linear
    return m[0]


@pytest.mark.parametrize("tokens,k,n,bias", [(130, 256, 384, False), (1, 128, 128, True), (3 * 77, 384, 128, True)])
def test_gemms_are_block_quantized_products(tokens, k, n, bias):
    lin = _linear(k, n, bias, tokens)
    g = torch.Generator().manual_seed(k)
    x = (torch.randn(tokens, k, generator=g) * 3).requires_grad_()
    gy = torch.randn(tokens, n, generator=g) * 1e-3
    y = lin(x)
    y.backward(gy)

    # x and W quantized from their own dtype (fp32); the gradient arrives as the bf16 output's
    xb, wb, gb = x.detach(), lin.weight.detach(), gy.bfloat16()
    want = (_deq_rows(xb) @ _deq_tiles(wb).t()).bfloat16()
    if bias:  # added to the GEMM's bf16 output
        want = want + lin.bias.detach().bfloat16()
    assert y.dtype == torch.float32
    torch.testing.assert_close(y.double(), want.double(), rtol=2**-8, atol=1e-6)
    # input gradient: g in 1x128 blocks along out-features, W's 128x128 tiles
    dx = _deq_rows(gb) @ _deq_tiles(wb)
    torch.testing.assert_close(x.grad.double(), dx.bfloat16().double(), rtol=2**-7, atol=1e-9)  # one bf16 ulp: fp32 vs exact sums
    # weight gradient: g and x both in blocks of 128 tokens (zero padding adds nothing)
    dw = _deq_rows(gb.t()) @ _deq_rows(xb.t()).t()
    torch.testing.assert_close(lin.weight.grad.double(), dw.bfloat16().double(), rtol=2**-7, atol=1e-9)  # one bf16 ulp: fp32 vs exact sums
    if bias:
        torch.testing.assert_close(lin.bias.grad, gb.float().sum(0), rtol=1e-5, atol=1e-7)


def _elem_err(t, scales_rows):
    """Per-element bound of |fp8(t) - t| for t's blocks: u |t| for normals, half the smallest E4M3 step (2^-10 s)
    below."""
    return torch.maximum(t.abs() * U, scales_rows * 2.0**-10)


def test_gemm_error_bound():
    """|y - x W^T| <= ex |W|^T + |x| ew^T + ex ew^T (+ bf16 rounding of y, 2^-8 |y|), with ex, ew the per-element
    quantization bounds: u = 2^-4 relative (E4M3), 2^-10 s absolute for values under a block's smallest normal."""
    k, n, tokens = 512, 256, 300
    lin = _linear(k, n, False, 0)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(tokens, k, generator=g) * torch.exp2(torch.randint(-6, 6, (tokens, k), generator=g).float())
    xb, wb = x.bfloat16(), lin.weight.detach().bfloat16()
    lin.weight.data = wb
    y = lin(xb).double()
    exact = xb.double() @ wb.double().t()
    _, sx = fb.quantize_1x128(xb, kernel="reference")
    _, _, sw = fb.quantize_128x128(wb, kernel="reference")
    ex = _elem_err(xb.double(), sx.double().repeat_interleave(128, 1))
    ew = _elem_err(wb.double(), sw.double().repeat_interleave(128, 0).repeat_interleave(128, 1))
    bound = ex @ wb.double().abs().t() + xb.double().abs() @ ew.t() + ex @ ew.t()
    err = (y - exact).abs()
    assert (err <= bound * 1.001 + exact.abs() * 2.0**-8 + 1e-30).all()
    assert err.max() > 0.1 * bound.max() * 0.01  # the bound is not vacuous against an exact product
    rel = (err.norm() / exact.norm()).item()
    assert 1e-3 < rel < 0.05


def test_empty_and_no_weight_grad():
    lin = _linear(128, 128, True, 1)
    x = torch.zeros(0, 128, requires_grad=True)
    y = lin(x)
    y.sum().backward()
    assert y.shape == (0, 128) and x.grad.shape == (0, 128) and torch.equal(lin.weight.grad, torch.zeros(128, 128))
    lin.weight.requires_grad_(False)
    x = torch.randn(5, 128, requires_grad=True)
    lin(x).sum().backward()
    assert x.grad.shape == (5, 128)


def test_default_filter_takes_interaction_projections():
    class Attn(nn.Module):
        def __init__(self):
            super().__init__()
            self.qkv, self.out = nn.Linear(128, 384, bias=False), nn.Linear(128, 128, bias=False)

    class Inter(nn.Module):
        def __init__(self):
            super().__init__()
            self.q_proj, self.kv_proj = nn.Linear(128, 128, bias=False), nn.Linear(128, 256, bias=False)
            self.out = nn.Linear(128, 100, bias=False)  # not a multiple of 128: stays bf16

    model = nn.Module()
    model.blocks = nn.ModuleList([nn.Module()])
    model.blocks[0].attn = Attn()
    model.interaction = Inter()
    model.head = nn.Linear(128, 128)
    got = apply_precision(model, "fp8_block", "cpu", list(BLOCK_FILTER[:5]))
    assert got == ["blocks.0.attn.qkv", "blocks.0.attn.out", "interaction.q_proj", "interaction.kv_proj"]
    assert type(model.interaction.out) is nn.Linear and type(model.head) is nn.Linear


def test_traces_under_compile():
    lin = _linear(256, 128, False, 2)
    x = torch.randn(70, 256, requires_grad=True)
    eager = lin(x)
    eager.sum().backward()
    gx, gw = x.grad.clone(), lin.weight.grad.clone()
    x.grad = None
    lin.weight.grad = None
    compiled = torch.compile(lin, backend="aot_eager", fullgraph=True)
    out = compiled(x)
    out.sum().backward()
    assert torch.equal(out, eager) and torch.equal(x.grad, gx) and torch.equal(lin.weight.grad, gw)


def test_gemms_stay_one_opaque_op_under_dynamic_compile():
    """Inductor's lowering of block-scaled _scaled_mm asserts on symbolic scale shapes (a dynamic token count):
    every GEMM of the forward and backward graphs must reach the compiler as gem's op, never as aten._scaled_mm."""
    from torch._dynamo.backends.common import aot_autograd

    graphs = []

    def keep(gm, inputs):
        symbolic = any(isinstance(i, torch.SymInt) for i in inputs)
        graphs.append((symbolic, [str(n.target) for n in gm.graph.nodes if n.op == "call_function"]))
        return gm

    lin = _linear(256, 128, False, 2)
    compiled = torch.compile(lin, backend=aot_autograd(fw_compiler=keep, bw_compiler=keep), dynamic=True)
    for tokens in (70, 131):
        x = torch.randn(tokens, 256, requires_grad=True)
        xe = x.detach().clone().requires_grad_()
        lin.weight.grad = None
        eager = lin(xe)
        eager.sum().backward()
        gw = lin.weight.grad.clone()
        lin.weight.grad = None
        out = compiled(x)
        out.sum().backward()
        assert torch.equal(out, eager) and torch.equal(x.grad, xe.grad) and torch.equal(lin.weight.grad, gw)
    assert any(symbolic for symbolic, _ in graphs), "no graph with a symbolic token count"
    fw_bw = [t for _, t in graphs]
    assert [t.count("gem.fp8_block_mm.default") for t in fw_bw] == [1, 2] * (len(fw_bw) // 2)
    assert not any("_scaled_mm" in t for g in fw_bw for t in g)


@pytest.mark.gpu
@pytest.mark.parametrize("tokens", [65536 + 77, 1000])
def test_gpu_gemms_match_emulation(tokens):
    from gem.model import precision as prec

    assert prec.block_gemm_supported(torch.device("cuda"))
    torch.manual_seed(0)
    lin = nn.Sequential(nn.Linear(1024, 3072, bias=False)).cuda()
    apply_precision(lin, "fp8_block", "cuda", ["0"])
    x = torch.randn(tokens, 1024, device="cuda", requires_grad=True)
    gy = torch.randn(tokens, 3072, device="cuda") * 1e-2
    y = lin(x)
    y.backward(gy)
    xc, wc, gc = x.detach().cpu(), lin[0].weight.detach().cpu(), gy.cpu()
    lin_cpu = nn.Sequential(nn.Linear(1024, 3072, bias=False))
    lin_cpu[0].weight.data.copy_(wc)
    apply_precision(lin_cpu, "fp8_block", "cpu", ["0"])
    xc.requires_grad_()
    yc = lin_cpu(xc)
    yc.backward(gc)
    for got, want in ((y, yc), (x.grad, xc.grad), (lin[0].weight.grad, lin_cpu[0].weight.grad)):
        rel = ((got.detach().cpu().double() - want.double()).norm() / want.double().norm()).item()
        assert rel < 2e-3, rel
    compiled = torch.compile(lin)
    torch.testing.assert_close(compiled(x), y, rtol=1e-2, atol=1e-2)


def test_gpu_large_preset_builds_and_converts():
    from gem.model import GEMModel
    from gem.model.moe import MoE
    from gem.train.trainer import build_configs
    from tests.train._util import compose

    cfg = compose(["experiment=gpu_large", "train.precision=fp8_block"])
    with torch.device("meta"):
        model = GEMModel(build_configs(cfg, 1).model, embedding_device="meta")
    blocks = model.blocks
    assert len(blocks) == 8 and sum(isinstance(m, MoE) for m in model.modules()) == 4
    assert blocks[0].attn.qkv.weight.shape == (3 * 16 * 128, 2048) and blocks[0].ffn.w1.weight.shape == (8192, 2048)
    got = apply_precision(model, "fp8_block", "cpu", list(cfg.train.precision_filter))
    assert len(got) == 8 * 2 + 4 * 3 + 3  # attention in every block, the 4 dense FFNs, the interaction projections
    assert {"interaction.q_proj", "interaction.kv_proj", "interaction.out"} <= set(got)
    assert all(type(model.get_submodule(n)) is BlockFP8Linear for n in got)


@pytest.mark.slow
def test_fp8_block_training_run_tracks_bf16():
    """200 steps of a tiny model widened to 128-multiples (so its tower and interaction convert), fp8_block
    (emulated GEMMs on the CPU) against the same run without it: eval NE within 1% per task."""
    from tests.model.test_precision import _assert_ne_tracks, _training_runs

    wide = ["model.d_model=128", "model.tower.head_dim=64", "model.tower.d_ff=256", "model.interaction.head_dim=64",
            "model.tower.num_blocks=1"]
    _assert_ne_tracks(_training_runs((("bf16", None), ("fp8_block", BlockFP8Linear)), wide))


@pytest.mark.parametrize("m,k,n", [(1000, 1024, 3072), (65613, 4096, 1024), (130, 128, 128)])
def test_cublas_scale_layouts(m, k, n):
    """The scales block_mm hands torch._scaled_mm on sm_90, for the three GEMMs: the shapes torch's checks take
    (meta tensors) and the strides cuBLAS reads (1x128 outer-dim-major; 128x128 reduction-blocks contiguous with a
    16-byte leading stride), holding the same values."""
    from gem.model.precision import _cublas_block_scales

    mp, kb, nb = -(-m // 128) * 128, k // 128, n // 128
    sx, sw = torch.rand(m, kb), torch.rand(nb, kb)
    sg, sgt, sxt = torch.rand(m, nb), torch.rand(mp // 128, n), torch.rand(mp // 128, k)
    for (mm, kk, nn_), sa, sb, tiles in (((m, k, n), sx, sw, True),  # forward: x @ W^T
                                         ((m, n, k), sg, sw.t(), True),  # input gradient: g @ W
                                         ((n, mp, k), sgt.t(), sxt.t(), False)):  # weight gradient: g^T @ x
        scale_a, scale_b = _cublas_block_scales(sa, sb, tiles)
        assert scale_a.stride(0) == 1 and torch.equal(scale_a, sa)
        assert torch.equal(scale_b, sb.t())
        if tiles:
            assert scale_b.stride(0) == 1 and scale_b.stride(1) % 4 == 0
        else:
            assert scale_b.stride(1) == 1
        a = torch.empty(mm, kk, dtype=fb.E4M3, device="meta")
        b = torch.empty(nn_, kk, dtype=fb.E4M3, device="meta")
        out = torch._scaled_mm(a, b.t(), scale_a=scale_a.to("meta"), scale_b=scale_b.to("meta"),
                               out_dtype=torch.bfloat16)
        assert out.shape == (mm, nn_)


# ------------------------------------------------------------------------------------- cached weights, producers


def _counting(monkeypatch, module, name):
    calls = []
    fn = getattr(module, name)

    def counted(*args, **kwargs):
        calls.append(name)
        return fn(*args, **kwargs)

    monkeypatch.setattr(module, name, counted)
    return calls


def _fresh_output(lin, x, calls):
    """lin's output from a layer that has never seen lin's weight (no cached copy); its quantization uncounted."""
    other = _linear(lin.in_features, lin.out_features, False, 0)
    other.weight = nn.Parameter(lin.weight.detach().clone())
    n = len(calls)
    out = other(x)
    del calls[n:]
    return out


def test_weight_quantized_once_per_optimizer_step(monkeypatch):
    calls = _counting(monkeypatch, fb, "quantize_128x128")
    lin = _linear(256, 128, False, 3)
    opt = torch.optim.SGD(lin.parameters(), lr=0.5)
    x = torch.randn(70, 256)
    for _ in range(2):  # gradient accumulation: two micro-batches, one weight
        lin(x).square().sum().backward()
    assert len(calls) == 1
    before = lin(x).detach()
    opt.step()
    after = lin(x)
    assert len(calls) == 2 and not torch.equal(after, before)
    assert torch.equal(after, _fresh_output(lin, x, calls))
    lin(x)
    assert len(calls) == 2
    with torch.no_grad():  # an in-place edit bumps the version counter
        lin.weight.mul_(0.5)
    assert torch.equal(lin(x), _fresh_output(lin, x, calls)) and len(calls) == 3


def test_weight_cache_follows_fsdp_style_updates(monkeypatch):
    """FSDP2 all-gathers into its unsharded parameter without bumping the version counter: the optimizer step
    before it (on the shard) and a state-dict load invalidate the copy."""
    calls = _counting(monkeypatch, fb, "quantize_128x128")
    lin = _linear(128, 128, False, 4)
    shard = nn.Parameter(lin.weight.detach().clone())
    opt = torch.optim.SGD([shard], lr=1.0)
    x = torch.randn(9, 128)
    lin(x)
    shard.grad = torch.randn_like(shard)
    opt.step()
    with torch.no_grad(), torch.autograd._unsafe_preserve_version_counter(lin.weight):
        version = lin.weight._version
        lin.weight.copy_(shard)
    assert lin.weight._version == version
    assert torch.equal(lin(x), _fresh_output(lin, x, calls)) and len(calls) == 2
    state = {"weight": torch.randn(128, 128)}
    with torch.no_grad(), torch.autograd._unsafe_preserve_version_counter(lin.weight):
        lin.load_state_dict(state)
    assert torch.equal(lin(x), _fresh_output(lin, x, calls)) and len(calls) == 3


def test_fused_input_equals_quantizing_the_same_values():
    """A BlockFP8Act from a producer gives the GEMMs the bytes quantize_1x128 gives its output: the same forward,
    input, norm-weight and weight gradients as handing the layer that output as a tensor."""
    lin = _linear(256, 384, True, 5)
    x = torch.randn(130, 256, requires_grad=True)
    w = torch.randn(256, requires_grad=True)
    gy = torch.randn(130, 384)
    runs = []
    for output in (False, True):
        act = fb.rms_norm_1x128(x, w, output=output)
        y = lin(act if not output else act.out)
        y.backward(gy)
        runs.append([y.detach(), x.grad, w.grad, lin.weight.grad, lin.bias.grad])
        x.grad = w.grad = lin.weight.grad = lin.bias.grad = None
    for a, b in zip(*runs):
        assert torch.equal(a, b)
    with pytest.raises(ValueError, match="token-blocked layout"):
        lin(fb.rms_norm_1x128(x, w, transposed=False))
    with torch.no_grad():
        lin(fb.rms_norm_1x128(x, w, transposed=False))  # no weight gradient: the tokens' layout is not needed


def _block(precision, norm="rmsnorm"):
    from gem.model.attention import JaggedSelfAttention, SwiGLU, TransformerBlock

    torch.manual_seed(11)
    blk = TransformerBlock(128, JaggedSelfAttention(128, 1, 1, 128, kernel="reference"), SwiGLU(128, 256), norm=norm)
    if precision != "bf16":
        apply_precision(blk, precision, "cpu", ["attn.qkv", "attn.out", "ffn.w1", "ffn.w2", "ffn.w3"])
    return blk


def _run_block(blk, x, offsets):
    x = x.clone().requires_grad_()
    y, _ = blk(x, offsets, 9)
    y.backward(torch.linspace(-1, 1, y.numel()).view_as(y))
    grads = [x.grad] + [p.grad for p in blk.parameters()]
    blk.zero_grad()
    return [y.detach()] + grads


@pytest.mark.parametrize("norm", ["rmsnorm", "layernorm"])
def test_block_feeds_its_fp8_gemms_from_the_producers(monkeypatch, norm):
    """Under fp8_block the attention norm and the FFN norm write their consumers' FP8 blocks (one producer call
    each, w1 and w3 sharing one) and the FFN runs as one op whose SwiGLU writes FP8 both ways; the block computes
    exactly what it computes with each producer's output handed over as a tensor and the FFN as three layers with
    swiglu_1x128 between them, and what the unfused modules compute (to the norm's rounding). bf16 calls none."""
    from gem.model import attention
    from gem.model import precision as prec

    norm_name = "layer_norm_1x128" if norm == "layernorm" else "rms_norm_1x128"
    norm_calls = _counting(monkeypatch, fb, norm_name)
    ffn_calls, ffn_apply = [], prec._BlockFP8SwiGLUFn.apply
    monkeypatch.setattr(prec._BlockFP8SwiGLUFn, "apply", lambda *a: ffn_calls.append(1) or ffn_apply(*a))
    x, offsets = torch.randn(13, 128), torch.tensor([0, 9, 13])
    _run_block(_block("bf16", norm), x, offsets)
    assert norm_calls == [] and ffn_calls == []
    blk = _block("fp8_block", norm)
    fused = _run_block(blk, x, offsets)
    assert (len(norm_calls), len(ffn_calls)) == (2, 1)

    norm_fn, producer = attention.block_fp8_norm, getattr(fb, norm_name)
    monkeypatch.setattr(fb, norm_name, lambda *a, **k: producer(*a, **{**k, "output": True}))
    monkeypatch.setattr(attention, "block_fp8_norm", lambda *a: norm_fn(*a).out)
    monkeypatch.setattr(attention, "block_fp8_ffn",
                        lambda x_, w1, w3, w2, _w8: w2(fb.swiglu_1x128(w1(x_), w3(x_), output=True).out))
    for a, b in zip(fused, _run_block(blk, x, offsets)):
        assert torch.equal(a, b)

    monkeypatch.setattr(attention, "block_fp8_norm", lambda norm_, x_, *_: norm_(x_))
    monkeypatch.setattr(attention, "block_fp8_ffn", lambda x_, w1, w3, w2, _w8: w2(F.silu(w1(x_)) * w3(x_)))
    for a, b in zip(fused, _run_block(blk, x, offsets)):
        assert ((a - b).norm() / b.norm()).item() < 2e-2


def test_ffn_op_equals_three_layers():
    """block_fp8_ffn against w1, w3 -> swiglu_1x128 -> w2 (fused forward, every gradient quantized by the layers):
    the same bytes everywhere, so equal outputs and gradients; with a BlockFP8Act input and a plain one."""
    from gem.model.precision import block_fp8_ffn

    w1, w3, w2 = _linear(128, 256, False, 6), _linear(128, 256, False, 7), _linear(256, 128, False, 8)
    x = torch.randn(130, 128, requires_grad=True)
    wn = torch.randn(128, requires_grad=True)
    gy = torch.randn(130, 128)
    params = [x, wn, w1.weight, w3.weight, w2.weight]
    for pre in (True, False):
        runs = []
        for fused in (True, False):
            h = fb.rms_norm_1x128(x, wn, output=not pre)
            h = h if pre else h.out
            y = block_fp8_ffn(h, w1, w3, w2) if fused else w2(fb.swiglu_1x128(w1(h), w3(h)))
            y.backward(gy)
            runs.append([y.detach()] + [p.grad for p in params])
            for p in params:
                p.grad = None
        for a, b in zip(*runs):
            assert torch.equal(a, b)



def test_block_regions_compile_with_the_producers(monkeypatch):
    """The compiled regions take the producers' blocks and the FP8 weight copies as arguments (looked up in eager
    code, once per optimizer step: no quantization of a weight inside the graphs); same results as eager, before
    and after an optimizer step."""
    import copy

    blk = _block("fp8_block")
    eager_blk = copy.deepcopy(blk)
    x, offsets = torch.randn(13, 128), torch.tensor([0, 4, 13])
    torch._dynamo.reset()
    blk.compile_regions(backend="aot_eager", fullgraph=True)
    calls = _counting(monkeypatch, fb, "quantize_128x128")
    opts = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (blk, eager_blk)]
    for step in range(2):
        for _ in range(2):
            got, want = _run_block(blk, x, offsets), _run_block(eager_blk, x, offsets)
            for a, b in zip(got, want):
                assert torch.equal(a, b)
        assert len(calls) == 10 * (step + 1)  # five weights, both blocks, once per step
        for m, opt in zip((blk, eager_blk), opts):
            for p in m.parameters():
                p.grad = torch.full_like(p, 0.01)
            opt.step()


def _fp8_gathered(lin: nn.Module) -> nn.Parameter:
    """lin's weight as FSDP2's FP8 all-gather leaves it: the unsharded BlockFP8GatheredWeight parameter holding the
    full weight's codes, W^T's codes (transposed from the codes, as after an all-gather) and tile scales."""
    from gem.model.precision import BlockFP8GatheredWeight

    kernel = "auto" if lin.weight.is_cuda else "reference"
    q, qt, s = fb.quantize_128x128(lin.weight.detach(), kernel=kernel)
    g = BlockFP8GatheredWeight(q, torch.empty_like(qt), s, lin.weight.dtype)
    g.transpose_codes()
    assert torch.equal(g.fp8()[1].view(torch.uint8), qt.view(torch.uint8))
    return nn.Parameter(g, requires_grad=lin.weight.requires_grad)


@pytest.mark.parametrize("shape", [(300, 130), (1, 1), (128, 256), (0, 64)])
def test_fp8_gathered_weight_reads_as_its_dequantized_values(shape):
    """Ops that read an FP8-gathered weight (a norm for logging, arithmetic, a copy, a matmul) see the weight its
    codes stand for, exactly the dequantized tiles; writing into it is refused in one line, since the codes would
    not change. Ragged tile edges, a 1x1 weight and an empty one included."""
    from gem.model.precision import BlockFP8GatheredWeight

    torch.manual_seed(0)
    lin = nn.Linear(shape[1], shape[0], bias=False)
    w = _fp8_gathered(lin)
    assert isinstance(w, BlockFP8GatheredWeight)
    q, s = w.fp8()[0], w.fp8()[2]
    want = fb.dequantize_128x128_reference(q.view(torch.uint8), s, lin.weight.dtype)
    assert torch.equal(w.dense(), want)
    with torch.no_grad():
        assert torch.equal(w * 2, want * 2) and torch.equal(w.clone(), want)
        assert torch.equal(torch.linalg.vector_norm(w), torch.linalg.vector_norm(want))
        x = torch.randn(3, shape[1])
        assert torch.equal(x @ w.t(), x @ want.t())
        buf = torch.empty_like(want)
        torch.mul(w, 1.0, out=buf)  # an out= write into a plain tensor reads w
        assert torch.equal(buf, want)
        if shape[0] and shape[1]:
            assert (want - lin.weight).abs().max() <= lin.weight.abs().max() / 8  # E4M3's step at the tile maximum
        with pytest.raises(RuntimeError, match="writing into it"):
            w.add_(1.0)
        with pytest.raises(RuntimeError, match="writing into it"):
            torch.mul(want, 1.0, out=w)


@pytest.mark.parametrize("device,backend", [
    ("cpu", None), ("cpu", "aot_eager"), pytest.param("cuda", "inductor", marks=pytest.mark.gpu)])
def test_block_runs_on_fp8_gathered_weights(device, backend):
    """A block whose fp8_block weights are FSDP2's FP8-gathered parameters (no values, only the FP8 copies the GEMMs
    read) computes exactly what the block computes from the plain weights, eagerly or with both blocks' regions
    compiled (fullgraph): the output, the input gradient and every parameter's gradient, the weights' as plain
    tensors of the weight's dtype (what FSDP2 reduce-scatters)."""
    import copy

    from gem.model.precision import BlockFP8GatheredWeight, fp8_weights

    blk = _block("fp8_block").to(device)
    plain = copy.deepcopy(blk)
    for name in ["attn.qkv", "attn.out", "ffn.w1", "ffn.w3", "ffn.w2"]:
        lin = blk.get_submodule(name)
        lin.weight = _fp8_gathered(lin)
        assert fp8_weights(lin)[0] == lin.weight.fp8()  # the copies handed to the regions: the gathered tensors
    if backend is not None:
        torch._dynamo.reset()
        for m in (blk, plain):
            m.compile_regions(backend=backend, fullgraph=True)
    x, offsets = torch.randn(13, 128, device=device), torch.tensor([0, 4, 13], device=device)
    for _ in range(2):
        got, want = _run_block(blk, x, offsets), _run_block(plain, x, offsets)
        assert len(got) == len(want) == 2 + len(list(blk.parameters()))
        for a, b in zip(got, want):
            assert type(a) is torch.Tensor and torch.equal(a, b)
    w = blk.attn.qkv.weight
    assert isinstance(w, BlockFP8GatheredWeight) and isinstance(w, nn.Parameter)
    with torch.no_grad():  # other ops read the weight the codes stand for
        assert torch.equal(w.bfloat16(), w.dense().bfloat16())
        assert torch.equal(F.linear(x, w), F.linear(x, w.dense()))
        with pytest.raises(RuntimeError, match="writing into it"):
            w.zero_()
