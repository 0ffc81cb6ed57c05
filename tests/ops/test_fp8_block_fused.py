"""The fused block-FP8 producers (gem.ops.fp8_block.rms_norm_1x128 / layer_norm_1x128 / swiglu_1x128): Triton
(interpreter on CPU, CUDA under -m gpu) and reference against the unfused reference (the op, then quantize_1x128),
forward bytes and backward, on ragged token counts, zero rows, saturating and overflowing values."""

import pytest
import torch
import torch.nn.functional as F

from gem.ops import fp8_block as fb
from gem.ops.fp8_block import norm_reference, swiglu_reference
from tests.ops.test_mx import _same

pytestmark = pytest.mark.filterwarnings("ignore:overflow encountered in cast:RuntimeWarning")

KERNELS = ["triton", "reference"]
# ragged token counts (not multiples of 128: the token-blocked layout pads them), partial last feature blocks
CASES = [((1, 128), torch.bfloat16), ((130, 200), torch.float32), ((257, 256), torch.bfloat16),
         ((3, 7), torch.float16), ((129, 136), torch.float16)]


_EPS = {torch.float32: 2.0**-21, torch.bfloat16: 2.0**-7, torch.float16: 2.0**-10}


def _ulp_close(got, want, dtype):
    """Within one rounding of dtype: the kernel's fp32 arithmetic runs in another order than torch's."""
    torch.testing.assert_close(got.float(), want.float(), rtol=_EPS[dtype], atol=1e-30, equal_nan=True)


def _check_bytes(act, y, transposed):
    """act's codes and scales are exactly quantize_1x128 of the producer's own output y (the unfused path)."""
    q, s, *t = fb.quantize_1x128(y, transposed=transposed, kernel="reference")
    _same(act.data.view(torch.uint8), q.view(torch.uint8))
    _same(act.scale, s)
    if transposed:
        _same(act.data_t.view(torch.uint8), t[0].view(torch.uint8))
        _same(act.scale_t, t[1])
    else:
        assert act.data_t is None and act.scale_t is None


def _norm_inputs(shape, dtype, seed, layer):
    g = torch.Generator().manual_seed(seed)
    m, k = shape
    x = torch.randn(m, k, generator=g) * 3 + (2.0 if layer else 0.0)
    if m > 2:
        x[1] = 0.0  # a zero row: rstd = 1 / sqrt(eps), output 0, scales 2^-126
        x[2, 0] = 1e4  # one spike: the rest of its blocks quantize far below it
    w = torch.randn(k, generator=g) * torch.exp2(torch.randint(-12, 12, (k,), generator=g).float())
    b = torch.randn(k, generator=g) if layer else None
    if dtype == torch.float16:  # overflows fp16 in row 0's first block
        x[0, 0], w[0] = 20.0, 1e5
    return x.to(dtype).requires_grad_(), w.requires_grad_(), None if b is None else b.requires_grad_()


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("shape,dtype", CASES)
@pytest.mark.parametrize("layer", [False, True])
def test_norm_matches_unfused(kernel, dtype, shape, layer):
    x, w, b = _norm_inputs(shape, dtype, shape[0] + layer, layer)
    eps = 1e-5

    def run(**kw):
        if layer:
            return fb.layer_norm_1x128(x, w, b, eps, kernel=kernel, **kw)
        return fb.rms_norm_1x128(x, w, eps, kernel=kernel, **kw)

    act = run(output=True)
    y32, mean, rstd = norm_reference(x.detach(), w.detach(), None if b is None else b.detach(), eps, layer)
    # one rounding of dtype, plus fp32 sums in another order: the centring cancels up to |mean| * 2^-22 (LayerNorm)
    slack = 2.0**-21 * w.detach().abs()[None, :] * (rstd * (1 + (0 if mean is None else mean.abs())))[:, None]
    err = (act.out.detach().float() - y32.to(dtype).float()).abs()
    ok = err <= _EPS[dtype] * y32.to(dtype).float().abs() + slack
    assert (ok | (act.out.isnan() & y32.to(dtype).isnan()) | (act.out.isinf() & y32.to(dtype).isinf())).all()
    _check_bytes(act, act.out.detach(), True)
    if dtype == torch.float16:
        assert act.scale.isnan().any()  # an output past fp16's range: its block is NaN, as quantize says

    # without the output: the same bytes, a placeholder that holds no memory
    lean = run(output=False, transposed=False)
    _same(lean.data.view(torch.uint8), act.data.view(torch.uint8))
    assert lean.out.shape == x.shape and lean.out.stride() == (0, 0) and lean.data_t is None

    # backward against autograd through the fp32 definition
    gy = torch.randn(shape, generator=torch.Generator().manual_seed(7)).to(dtype)
    lean.out.backward(gy)
    got = [x.grad, w.grad] + ([b.grad] if layer else [])
    xr, wr = x.detach().float().requires_grad_(), w.detach().clone().requires_grad_()
    br = None if b is None else b.detach().clone().requires_grad_()
    yr = F.layer_norm(xr, (shape[1],), wr, br, eps) if layer else F.rms_norm(xr, (shape[1],), wr, eps)
    yr.backward(gy.float())
    want = [xr.grad, wr.grad] + ([br.grad] if layer else [])
    for gg, ww, name in zip(got, want, "xwb"):
        assert gg.dtype == (dtype if name == "x" else torch.float32)
        finite = torch.isfinite(ww)
        scale = ww[finite].abs().max().clamp_min(1e-30)
        assert torch.equal(torch.isfinite(gg.float()), finite) or dtype == torch.float16, name
        err = (gg.float() - ww)[finite & torch.isfinite(gg.float())].abs().max()
        assert err <= 4 * {torch.float32: 2.0**-20, torch.bfloat16: 2.0**-7, torch.float16: 2.0**-9}[dtype] * scale, name


@pytest.mark.parametrize("kernel", KERNELS)
def test_norm_edges(kernel):
    """No weight, empty token count, a NaN row (its blocks NaN, other rows untouched), bad arguments."""
    x = torch.randn(5, 256)
    x[3, 17] = float("nan")
    act = fb.rms_norm_1x128(x, None, output=True, kernel=kernel)
    _check_bytes(act, act.out, True)
    assert act.scale[3].isnan().all() and not act.scale[[0, 1, 2, 4]].isnan().any()
    empty = fb.rms_norm_1x128(torch.zeros(0, 128, requires_grad=True), torch.ones(128), kernel=kernel)
    assert empty.data.shape == (0, 128) and empty.data_t.shape == (128, 0) and empty.scale_t.shape == (0, 128)
    empty.out.sum().backward()
    with pytest.raises(ValueError, match="non-empty last axis"):
        fb.rms_norm_1x128(torch.zeros(4, 0), kernel=kernel)
    with pytest.raises(ValueError, match="weight must be a float"):
        fb.rms_norm_1x128(x, torch.ones(128), kernel=kernel)
    with pytest.raises(TypeError, match="x must be a float32"):
        fb.layer_norm_1x128(x.long(), kernel=kernel)


def _swiglu_inputs(shape, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    a = torch.randn(shape, generator=g) * 4
    b = torch.randn(shape, generator=g) * torch.exp2(torch.randint(-10, 10, shape, generator=g).float())
    flat_a, flat_b = a.view(-1), b.view(-1)
    n = flat_a.numel()
    flat_a[: min(n, 130)] = 0.0  # zeros: whole zero blocks in the first row
    flat_b[n // 2] = 1e5  # an outlier in one block
    flat_a[n // 2] = 30.0
    if n > 3:
        flat_a[-1], flat_b[-1] = -88.0, 3e4  # silu underflows to -0
    return a.to(dtype).requires_grad_(), b.to(dtype).requires_grad_()


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("shape,dtype", CASES)
def test_swiglu_matches_unfused(kernel, dtype, shape):
    a, b = _swiglu_inputs(shape, dtype, shape[0])
    act = fb.swiglu_1x128(a, b, output=True, kernel=kernel)
    _ulp_close(act.out, swiglu_reference(a.detach(), b.detach()), dtype)
    _check_bytes(act, act.out.detach(), True)
    if dtype == torch.float16 and shape[0] * shape[1] > 3:
        assert act.scale.isnan().any()  # 30 * 1e5 overflows fp16: that block is NaN

    lean = fb.swiglu_1x128(a, b, kernel=kernel)
    _same(lean.data_t.view(torch.uint8), act.data_t.view(torch.uint8))
    assert lean.out.stride() == (0, 0)
    gh = torch.randn(shape, generator=torch.Generator().manual_seed(3)).to(dtype)
    lean.out.backward(gh)
    ar, br = a.detach().float().requires_grad_(), b.detach().float().requires_grad_()
    (F.silu(ar) * br).backward(gh.float())
    # one rounding of dtype, plus fp32 slack for the cancellation in silu' = sig (1 + a (1 - sig)) near a = -1.28
    af, bf, gf = ar.detach(), br.detach(), gh.float()
    slack = 2.0**-19 * gf.abs() * (bf.abs() * (1 + af.abs()) + af.abs())
    for got, want in ((a.grad, ar.grad), (b.grad, br.grad)):
        assert got.dtype == dtype
        want = want.to(dtype).float()
        ok = (got.float() - want).abs() <= 2 * _EPS[dtype] * want.abs() + slack
        assert (ok | (got.isnan() & want.isnan()) | (got.isinf() & (got.float() == want))).all()


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("shape,dtype", [((130, 200), torch.bfloat16), ((3, 128), torch.float32)])
def test_swiglu_backward_writes_fp8_gradients(kernel, shape, dtype):
    """The backward that writes da and db only as 1x128 blocks: the bytes of quantizing the unfused backward's
    (in bf16, as a BlockFP8Linear receives its output gradient)."""
    a, b = (t.detach() for t in _swiglu_inputs(shape, dtype, 5))
    g = torch.randn(shape, generator=torch.Generator().manual_seed(2)).to(dtype)
    for transposed in (True, False):
        out = fb.swiglu_bwd_quant_op(a, b, g, transposed, kernel)
        for grad, (q, s, qt, st) in zip(fb.swiglu_bwd_op(a, b, g, kernel), (out[:4], out[4:])):
            act = fb.BlockFP8Act(grad, q, s, qt if transposed else None, st if transposed else None)
            _check_bytes(act, grad.bfloat16(), transposed)  # rounded as a layer's output gradient arrives
            assert transposed or qt.numel() == 0


def test_swiglu_nan_and_bad_arguments():
    a, b = torch.randn(4, 128), torch.randn(4, 128)
    a[2, 5] = float("nan")
    act = fb.swiglu_1x128(a, b, output=True, kernel="triton")
    _check_bytes(act, act.out, True)
    assert act.scale[:, 0].isnan().tolist() == [False, False, True, False]  # row 2's block
    assert act.scale_t[0].isnan().nonzero().flatten().tolist() == [5]  # column 5's block of tokens
    with pytest.raises(ValueError, match="b must match a"):
        fb.swiglu_1x128(a, b[:3])


def test_compiles_around_the_producers():
    """torch.compile traces the producers as opaque ops: the same bytes and gradients as eager."""
    x = torch.randn(70, 256, requires_grad=True)
    w = torch.randn(256, requires_grad=True)

    def f(x, w):
        act = fb.rms_norm_1x128(x, w)
        h = fb.swiglu_1x128(x, x * 2)
        return act.out, act.data.float() * act.scale.repeat_interleave(128, 1), h.out, h.data_t.float()

    eager = f(x, w)
    (eager[0] + eager[2]).sum().backward()
    gx, gw = x.grad.clone(), w.grad.clone()
    x.grad = w.grad = None
    torch._dynamo.reset()
    got = torch.compile(f, backend="aot_eager", fullgraph=True)(x, w)
    (got[0] + got[2]).sum().backward()
    for a, b in zip(got, eager):
        assert torch.equal(a, b)
    assert torch.equal(x.grad, gx) and torch.equal(w.grad, gw)


@pytest.mark.gpu
@pytest.mark.parametrize("m", [65536 + 77, 300])
def test_gpu_producers_match_reference(m):
    """The hardware fp8 cast path: bytes of the CUDA kernels equal quantizing their own output, and the outputs
    match the reference within one rounding."""
    for k in (1024, 4096):
        x, w, _ = _norm_inputs((m, k), torch.bfloat16, k, False)
        x, w = x.detach().cuda(), w.detach().cuda()
        act = fb.rms_norm_1x128(x, w, output=True)
        _check_bytes(act, act.out, True)
        _ulp_close(act.out, norm_reference(x, w, None, 1e-6, False)[0].bfloat16(), torch.bfloat16)
        a, b = (t.detach().cuda() for t in _swiglu_inputs((m, k), torch.bfloat16, k))
        act = fb.swiglu_1x128(a, b, output=True)
        _check_bytes(act, act.out, True)
        _ulp_close(act.out, swiglu_reference(a, b), torch.bfloat16)
