"""Row-wise FP8 and the fused producers (gem.ops.fp8): Triton (interpreter on CPU, CUDA under -m gpu) bit for bit
against the reference on the quantized bytes and scales; fused equals "compute, then quantize"; forward and
backward against plain PyTorch."""

import pytest
import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from gem.model.precision import _fp8_rows
from gem.ops import fp8, mx
from gem.ops.triton_mx import round_bits, store_fp32_bits
from tests.ops.test_mx import _edgy, _same

pytestmark = pytest.mark.filterwarnings("ignore:overflow encountered in cast:RuntimeWarning")

KERNELS = ["reference", "triton"]
DTYPES = [torch.float32, torch.bfloat16, torch.float16]
FP8 = [torch.float8_e4m3fn, torch.float8_e5m2]
ELEM_OF = {torch.float8_e4m3fn: "e4m3", torch.float8_e5m2: "e5m2"}
SHAPES = [(5, 64), (3, 100), (1, 7), (2, 3, 45), (0, 32), (4, 0)]


def _quant(y, scaling, elem):
    """The unfused quantization of an op's output (reference kernels)."""
    if scaling == "row":
        return fp8.quantize_rows(y, mx.FORMATS[elem].dtype, kernel="reference")
    return mx.quantize(y, elem=elem, kernel="reference")


# ----------------------------------------------------------------------------- quantize_rows


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("qdtype", FP8)
def test_quantize_rows_triton_matches_reference(shape, dtype, qdtype):
    g = torch.Generator().manual_seed(hash(shape) % 2**31)
    x = _edgy(shape, dtype, g)
    d_ref, s_ref = fp8.quantize_rows(x, qdtype, kernel="reference")
    d_tri, s_tri = fp8.quantize_rows(x, qdtype, kernel="triton")
    assert d_ref.dtype == qdtype and d_ref.shape == x.shape
    assert s_ref.dtype == torch.float32 and s_ref.shape == shape[:-1] + (1,)
    _same(d_tri, d_ref)
    _same(s_tri, s_ref)
    # rows without specials, values over many binades
    x = (torch.randn(shape, generator=g) * torch.exp2(torch.randint(-30, 30, shape, generator=g).float())).to(dtype)
    for a, b in zip(fp8.quantize_rows(x, qdtype, kernel="triton"), fp8.quantize_rows(x, qdtype, kernel="reference")):
        _same(a, b)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("qdtype", FP8)
def test_quantize_rows_is_the_precision_formula(dtype, qdtype):
    g = torch.Generator().manual_seed(7)
    x = (torch.randn(6, 80, generator=g) * torch.exp2(torch.randint(-12, 12, (6, 1), generator=g).float())).to(dtype)
    want_d, want_s = _fp8_rows(x, qdtype)
    for kernel in KERNELS:
        d, s = fp8.quantize_rows(x, qdtype, kernel=kernel)
        assert torch.equal(d.view(torch.uint8), want_d.view(torch.uint8)) and torch.equal(s, want_s)


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("qdtype", FP8)
def test_quantize_rows_error_bound_and_specials(kernel, qdtype):
    fmt = mx.FORMATS[ELEM_OF[qdtype]]
    g = torch.Generator().manual_seed(8)
    x = torch.randn(8, 96, generator=g) * torch.exp2(torch.randint(-20, 20, (8, 1), generator=g).float())
    d, s = fp8.quantize_rows(x, qdtype, kernel=kernel)
    # the row's amax maps to the format's max exactly (up to the fp32 rounding of amax / max and back)
    torch.testing.assert_close(d.float().abs().amax(-1), torch.full((8,), fmt.max), rtol=2.0**-fmt.mbits, atol=0)
    back = d.float() * s
    half_ulp = x.abs() * 2.0 ** -(fmt.mbits + 1)
    half_sub = s * 2.0 ** (1 - fmt.ebias - fmt.mbits - 1)  # half the smallest subnormal step, scaled
    assert ((back - x).abs() <= (half_ulp + half_sub) * (1 + 1e-5)).all()

    x = torch.tensor([[0.0] * 4, [1.0, -2.0, float("nan"), 3.0], [1.0, -2.0, float("inf"), -0.0],
                      [2.0**-140, -(2.0**-149), 0.0, 0.0]])
    d, s = fp8.quantize_rows(x, qdtype, kernel=kernel)
    assert s[0, 0] == torch.tensor(1e-12) / fmt.max and (d[0].float() == 0).all()  # zero row: the clamped scale
    assert s[1].isnan().all() and d[1].float().isnan().all()  # NaN: the whole row
    assert s[2, 0] == float("inf") and d[2, 2].float().isnan()  # inf: scale inf, finite codes +-0
    assert d[2].view(torch.uint8)[[0, 1, 3]].tolist() == [0x00, 0x80, 0x80]
    assert s[3, 0] == s[0, 0] and d[3].view(torch.uint8).tolist() == [0x00, 0x80, 0x00, 0x00]  # tiny: clamped


def _tie_rows(qdtype):
    """Rows [fmax * k, t * k, -t * k]: scale k, and x / s = t exactly, a rounding tie of the element type, where
    x * (1 / s) rounds past it."""
    fmax = mx.FORMATS[ELEM_OF[qdtype]].max
    k = torch.arange(1, 4096, dtype=torch.float32)
    rows = []
    for t in ((17.0, 19.0) if qdtype == torch.float8_e4m3fn else (18.0, 22.0)):  # ties between codes in [16, 32)
        past = k[(t * k * (1 / k) != t) & (t * k / k == t)][:8]
        rows += [torch.stack([fmax * past, t * past, -t * past], 1)]
    x = torch.cat(rows)
    assert x.shape[0] == 16
    return x


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("qdtype", FP8)
def test_quantize_rows_divides_exactly(kernel, qdtype):
    """Only a correctly rounded division gives torch's codes on _tie_rows."""
    x = _tie_rows(qdtype)
    d, s = fp8.quantize_rows(x, qdtype, kernel=kernel)
    want_d, want_s = _fp8_rows(x, qdtype)
    assert torch.equal(s, want_s) and torch.equal(d.view(torch.uint8), want_d.view(torch.uint8))
    assert torch.equal(d[:, 1].float(), (x[:, 1] / s[:, 0]).to(qdtype).float())  # the tie, rounded to even


def test_quantize_rows_bad_input():
    with pytest.raises(TypeError, match="dtype must be torch.float8_e4m3fn or torch.float8_e5m2"):
        fp8.quantize_rows(torch.randn(2, 4), torch.int8)
    with pytest.raises(TypeError, match="float32, bfloat16 or float16"):
        fp8.quantize_rows(torch.randn(2, 4, dtype=torch.float64))
    with pytest.raises(ValueError, match="at least one dimension"):
        fp8.quantize_rows(torch.tensor(1.0))


@triton.jit
def _round_store_kernel(src, rounded, stored, N: tl.constexpr, KIND: tl.constexpr):
    i = tl.arange(0, N)
    bits = tl.load(src + i)
    tl.store(rounded + i, round_bits(bits, KIND))
    store_fp32_bits(stored, i, bits, i < N, KIND)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_rounding_to_the_output_dtype(dtype):
    """The kernels' fp32 -> bf16 / fp16 rounding equals torch's cast, NaN of any payload included (CUDA makes
    0x7FFFFFFF, which a plain add-and-shift would carry into -0)."""
    g = torch.Generator().manual_seed(11)
    x = torch.randn(1000, generator=g) * torch.exp2(torch.randint(-140, 128, (1000,), generator=g).float())
    x[:8] = torch.tensor([0.0, -0.0, float("inf"), float("-inf"), 3e38, -3e38, 1.0 + 2.0**-8, 1.0 + 3 * 2.0**-8])
    bits = torch.cat([x.view(torch.int32), torch.tensor([0x7FFFFFFF, -1, 0x7F800001, 0x7FC00000], dtype=torch.int32)])
    bits = torch.cat([bits, torch.zeros(1024 - bits.numel(), dtype=torch.int32)])
    rounded = torch.empty_like(bits)
    stored = torch.empty(1024, dtype=dtype)
    kind = {torch.bfloat16: 1, torch.float16: 2}[dtype]
    _round_store_kernel[(1,)](bits, rounded, stored.view(torch.int16) if kind == 1 else stored, N=1024, KIND=kind)
    want = bits.view(torch.float32).to(dtype)
    _same(stored, want)
    _same(rounded.view(torch.float32), want.float())


# ----------------------------------------------------------------------------- rms_norm_quant


CASES = [  # dtype, scaling, elem
    (torch.float32, "row", "e4m3"), (torch.bfloat16, "row", "e4m3"), (torch.float16, "row", "e5m2"),
    (torch.float32, "mx", "e5m2"), (torch.bfloat16, "mx", "e4m3"),
]


def _ulps_close(a, b, dtype):
    """a, b within one unit in the last place of dtype (rounding of fp32 sums and rsqrt / exp differ)."""
    eps = torch.finfo(dtype).eps
    torch.testing.assert_close(a.float(), b.float(), rtol=eps * (1 if dtype != torch.float32 else 8), atol=1e-6)


def _check_fused(out, inputs, plain, grad, scaling, elem, tol):
    """out = (y, data, scale) of a fused op on `inputs`: data / scale are y quantized, bit for bit; y is
    plain(inputs in fp32) rounded once; the gradients of y equal autograd's through plain in fp32."""
    y, data, scale = out
    dtype = inputs[0].dtype
    assert y.dtype == dtype and y.shape == inputs[0].shape and data.dtype == mx.FORMATS[elem].dtype
    want_d, want_s = _quant(y.detach().cpu(), scaling, elem)
    _same(data.cpu(), want_d)
    _same(scale.cpu(), want_s)
    ins32 = [t.detach().float().requires_grad_() for t in inputs]
    y32 = plain(*ins32)
    _ulps_close(y, y32.to(dtype), dtype)
    y.backward(grad)
    y32.backward(grad.float())
    for t, t32 in zip(inputs, ins32):
        torch.testing.assert_close(t.grad.float(), t32.grad, rtol=tol, atol=tol)


def _norm(kind, x, w, b, **kw):
    if kind == "rms":
        return fp8.rms_norm_quant(x, w, eps=1e-5, **kw)
    return fp8.layer_norm_quant(x, w, b, eps=1e-5, **kw)


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("dtype,scaling,elem", CASES)
@pytest.mark.parametrize("shape", [(5, 96), (2, 3, 70), (1, 33)])
@pytest.mark.parametrize("kind", ["rms", "layer"])
def test_norm_quant_forward_backward(kernel, dtype, scaling, elem, shape, kind):
    g = torch.Generator().manual_seed(4)
    n = shape[-1]
    x = (torch.randn(shape, generator=g) * 3 + 1).to(dtype).requires_grad_()
    w = (torch.rand(n, generator=g) + 0.5).to(dtype).requires_grad_()
    b = torch.randn(n, generator=g).to(dtype).requires_grad_()
    gy = torch.randn(shape, generator=g).to(dtype)
    out = _norm(kind, x, w, b, scaling=scaling, elem=elem, kernel=kernel)
    if kind == "rms":
        inputs, plain = (x, w), lambda x, w: F.rms_norm(x, (n,), w, 1e-5)
    else:
        inputs, plain = (x, w, b), lambda x, w, b: F.layer_norm(x, (n,), w, b, 1e-5)
    _check_fused(out, inputs, plain, gy, scaling, elem, 1e-5 if dtype == torch.float32 else 1e-2)


@pytest.mark.parametrize("dtype,scaling,elem", CASES)
@pytest.mark.parametrize("kind", ["rms", "layer"])
def test_norm_quant_triton_matches_reference(dtype, scaling, elem, kind):
    g = torch.Generator().manual_seed(5)
    x = (torch.randn(6, 100, generator=g) * 4).to(dtype)
    x[1] = 0.0
    x[2, 7] = float("nan")
    x[3, 50] = float("inf")
    w = torch.rand(100, generator=g) + 0.5
    out = {k: _norm(kind, x, w, None, scaling=scaling, elem=elem, kernel=k) for k in KERNELS}
    (y_r, d_r, s_r), (y_t, d_t, s_t) = out["reference"], out["triton"]
    _ulps_close(y_t[~y_r.isnan()], y_r[~y_r.isnan()], dtype)
    assert torch.equal(y_t.isnan(), y_r.isnan())
    same_rows = [i for i in range(6) if torch.equal(y_t[i].isnan(), y_r[i].isnan())
                 and torch.equal(y_t[i].nan_to_num(), y_r[i].nan_to_num())]
    assert len(same_rows) >= 4
    for i in same_rows:  # where the norm rounds alike, the quantization is bit for bit the same
        _same(d_t[i], d_r[i])
        _same(s_t[i], s_r[i])
    assert (d_r[1].float() == 0).all() and (y_r[1] == 0).all()  # zero row: y 0, codes 0
    for s in (s_r, s_t):  # NaN rows: the row-wise scale is NaN, the MX scales of the row are NaN (0xFF)
        bad = s[2].isnan().all() if scaling == "row" else (s[2] == 0xFF).any()
        assert bad


def test_rms_norm_quant_edges_and_bad_input():
    for kernel in KERNELS:
        y, data, scale = fp8.rms_norm_quant(torch.tensor([[3.0], [-2.0]]), kernel=kernel)  # one-element rows: +-1
        torch.testing.assert_close(y, torch.tensor([[1.0], [-1.0]]))
        assert data.float().tolist() == [[448.0], [-448.0]] and torch.equal(scale, y.abs() / 448)
        x = torch.randn(0, 64, requires_grad=True)
        y, data, scale = fp8.rms_norm_quant(x, scaling="mx", kernel=kernel)
        assert y.shape == (0, 64) and data.shape == (0, 64) and scale.shape == (0, 2)
        y.sum().backward()
        assert x.grad.shape == (0, 64)
    with pytest.raises(ValueError, match="scaling must be one of"):
        fp8.rms_norm_quant(torch.randn(2, 32), scaling="col")
    with pytest.raises(ValueError, match="non-empty last axis"):
        fp8.rms_norm_quant(torch.randn(2, 0))
    with pytest.raises(ValueError, match=r"weight must be a float \[32\]"):
        fp8.rms_norm_quant(torch.randn(2, 32), torch.ones(16))
    with pytest.raises(ValueError, match="bias must have weight's dtype"):
        fp8.layer_norm_quant(torch.randn(2, 32), torch.ones(32), torch.ones(32, dtype=torch.bfloat16))


# ----------------------------------------------------------------------------- swiglu_quant


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("dtype,scaling,elem", CASES)
@pytest.mark.parametrize("shape", [(5, 96), (2, 3, 70)])
def test_swiglu_quant_forward_backward(kernel, dtype, scaling, elem, shape):
    g = torch.Generator().manual_seed(6)
    a = (torch.randn(shape, generator=g) * 3).to(dtype).requires_grad_()
    b = (torch.randn(shape, generator=g) * 2).to(dtype).requires_grad_()
    gh = torch.randn(shape, generator=g).to(dtype)
    out = fp8.swiglu_quant(a, b, scaling=scaling, elem=elem, kernel=kernel)
    _check_fused(out, (a, b), lambda a, b: F.silu(a) * b, gh, scaling, elem, 1e-5 if dtype == torch.float32 else 1e-2)


@pytest.mark.parametrize("dtype,scaling,elem", CASES)
def test_swiglu_quant_triton_matches_reference(dtype, scaling, elem):
    g = torch.Generator().manual_seed(9)
    a = (torch.randn(5, 80, generator=g) * 4).to(dtype)
    b = torch.randn(5, 80, generator=g).to(dtype)
    b[1, 3] = float("nan")
    b[2] = 0.0
    out = {k: fp8.swiglu_quant(a, b, scaling=scaling, elem=elem, kernel=k) for k in KERNELS}
    (h_r, d_r, s_r), (h_t, d_t, s_t) = out["reference"], out["triton"]
    assert torch.equal(h_t.isnan(), h_r.isnan())
    _ulps_close(h_t.nan_to_num(), h_r.nan_to_num(), dtype)
    for i in range(5):
        if torch.equal(h_t[i].nan_to_num(), h_r[i].nan_to_num()):
            _same(d_t[i], d_r[i])
            _same(s_t[i], s_r[i])
    assert (d_r[2].float() == 0).all()
    assert s_t[1].isnan().all() if scaling == "row" else (s_t[1] == 0xFF).any()


def test_swiglu_quant_empty_and_bad_input():
    for kernel in KERNELS:
        a = torch.randn(0, 64, requires_grad=True)
        b = torch.randn(0, 64, requires_grad=True)
        h, data, scale = fp8.swiglu_quant(a, b, kernel=kernel)
        assert h.shape == data.shape == (0, 64) and scale.shape == (0, 1)
        h.sum().backward()
        assert a.grad.shape == b.grad.shape == (0, 64)
    with pytest.raises(ValueError, match="b must match a"):
        fp8.swiglu_quant(torch.randn(2, 32), torch.randn(2, 16))
    with pytest.raises(ValueError, match="elem must be one of"):
        fp8.swiglu_quant(torch.randn(2, 32), torch.randn(2, 32), elem="e2m1")


# ----------------------------------------------------------------------------- CUDA


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("scaling", ["row", "mx"])
def test_cuda_fusions(dtype, scaling):
    g = torch.Generator().manual_seed(10)
    for qdtype in FP8:
        for x in (_edgy((1024, 4096), dtype, g), _tie_rows(qdtype).to(dtype)):
            d_ref, s_ref = fp8.quantize_rows(x, qdtype, kernel="reference")
            d_gpu, s_gpu = fp8.quantize_rows(x.cuda(), qdtype, kernel="triton")
            _same(d_gpu.cpu(), d_ref)
            _same(s_gpu.cpu(), s_ref)
    tol = 1e-4 if dtype == torch.float32 else 2e-2
    x = (torch.randn(512, 4000, generator=g) * 3).to(dtype).cuda().requires_grad_()
    w = (torch.rand(4000, generator=g) + 0.5).to(dtype).cuda().requires_grad_()
    gy = torch.randn(512, 4000, generator=g).to(dtype).cuda()
    _check_fused(fp8.rms_norm_quant(x, w, scaling=scaling, kernel="triton"), (x, w),
                 lambda x, w: F.rms_norm(x, (4000,), w, 1e-6), gy, scaling, "e4m3", tol)
    a = (torch.randn(512, 4096, generator=g) * 3).to(dtype).cuda().requires_grad_()
    b = torch.randn(512, 4096, generator=g).to(dtype).cuda().requires_grad_()
    gh = torch.randn(512, 4096, generator=g).to(dtype).cuda()
    _check_fused(fp8.swiglu_quant(a, b, scaling=scaling, kernel="triton"), (a, b), lambda a, b: F.silu(a) * b, gh,
                 scaling, "e4m3", tol)
    # NaN made on the GPU (inf * 0 in the norm) carries CUDA's payload; it must stay NaN through the bf16 store
    x = torch.randn(4, 256, generator=g).to(dtype)
    x[1, 5], x[2, 7] = float("inf"), float("nan")
    y_ref, d_ref, s_ref = fp8.rms_norm_quant(x, scaling=scaling, kernel="reference")
    y_gpu, d_gpu, s_gpu = fp8.rms_norm_quant(x.cuda(), scaling=scaling, kernel="triton")
    assert torch.equal(y_gpu.isnan().cpu(), y_ref.isnan()) and y_ref[1, 5].isnan()
    for i in (1, 2):
        _same(d_gpu[i].cpu(), d_ref[i])
        _same(s_gpu[i].cpu(), s_ref[i])
