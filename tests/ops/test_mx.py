"""MXFP8 (gem.ops.mx): the reference against hand-computed spec cases and an independent round-to-nearest-even
oracle; the Triton kernels (interpreter on CPU, CUDA under -m gpu) bit for bit against the reference."""

import math

import pytest
import torch

from gem.ops import mx

# fp16 outputs that overflow become inf, as they should; the interpreter's numpy cast warns about it.
pytestmark = pytest.mark.filterwarnings("ignore:overflow encountered in cast:RuntimeWarning")

KERNELS = ["reference", "triton"]
ELEMS = ["e4m3", "e5m2"]
DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def _bits(t):
    return t.view(torch.uint8) if t.element_size() == 1 else t


def _same(a, b):
    """Bit-exact equality, with any NaN equal to any NaN (payloads carry no meaning)."""
    assert a.shape == b.shape and a.dtype == b.dtype
    nan_a, nan_b = a.float().isnan(), b.float().isnan()
    assert torch.equal(nan_a, nan_b)
    ia = a.view(torch.uint8) if a.element_size() == 1 else a.view({2: torch.int16, 4: torch.int32}[a.element_size()])
    ib = b.view(torch.uint8) if b.element_size() == 1 else b.view({2: torch.int16, 4: torch.int32}[b.element_size()])
    assert torch.equal(ia[~nan_a], ib[~nan_b])


def _row(*vals, n=32):
    x = torch.zeros(n)
    x[: len(vals)] = torch.tensor(vals, dtype=torch.float64).float()
    return x


# ----------------------------------------------------------------------------- hand-computed spec cases


@pytest.mark.parametrize("kernel", KERNELS)
def test_e4m3_scale_rounding_and_saturation(kernel):
    # amax 1.0: X = 2^(0 - 8). Scaled: 256, 128, -192; 17 ties to 16 and 19 to 20 (spacing 2 in [16, 32));
    # subnormals (spacing 2^-9): 1.5 units tie to 2, 0.5 unit ties to 0, 2.5 units tie to 2.
    X = 2.0**-8
    u = 2.0**-9
    x = _row(1.0, 0.5, -0.75, 17 * X, 19 * X, 1.5 * u * X, 0.5 * u * X, 2.5 * u * X, -0.0)
    data, scale = mx.quantize(x[None], kernel=kernel)
    assert scale.tolist() == [[127 - 8]]
    want = [256, 128, -192, 16, 20, 2 * u, 0, 2 * u, -0.0]
    assert data[0, :9].float().tolist() == want
    assert data.view(torch.uint8)[0, 8] == 0x80  # -0 keeps its sign
    # amax 1.96875: X = 2^-8 and 504 saturates to 448 (not NaN); dequantized 448 * 2^-8 = 1.75.
    data, scale = mx.quantize(_row(1.96875, -1.96875)[None], kernel=kernel)
    assert data[0, :2].float().tolist() == [448.0, -448.0]
    assert mx.dequantize(data, scale, kernel=kernel)[0, :2].tolist() == [1.75, -1.75]


@pytest.mark.parametrize("kernel", KERNELS)
def test_e5m2_scale_and_saturation(kernel):
    # amax 1.99: X = 2^(0 - 15), 1.99 * 2^15 = 65208 > 57344 saturates; 0.25 -> 8192 exactly.
    data, scale = mx.quantize(_row(1.99, 0.25, -3 * 2.0**-15)[None], elem="e5m2", kernel=kernel)
    assert data.dtype == torch.float8_e5m2
    assert scale.tolist() == [[127 - 15]]
    assert data[0, :3].float().tolist() == [57344.0, 8192.0, -3.0]
    assert mx.dequantize(data, scale, kernel=kernel)[0, :3].tolist() == [1.75, 0.25, -3 * 2.0**-15]


@pytest.mark.parametrize("kernel", KERNELS)
def test_zero_tiny_huge_blocks(kernel):
    sub = 2.0**-130  # an fp32 subnormal
    x = torch.stack([
        torch.zeros(32),                       # amax 0: the smallest scale, data 0
        _row(sub),                             # amax subnormal: scale 2^-127, data 2^-3 exactly
        _row(2.0**-149),                       # smallest subnormal: scale 2^-127, rounds to 0
        _row(2.0**-126, 2.0**-127),            # log2 amax - 8 = -134 clamps to -127: data 2, 1
        _row(torch.finfo(torch.float32).max),  # floor(log2) = 127 -> scale 2^119, 511.99.. saturates to 448
    ])
    data, scale = mx.quantize(x, kernel=kernel)
    assert scale[:, 0].tolist() == [0, 0, 0, 0, 127 + 119]
    assert data[:, 0].float().tolist() == [0.0, 0.125, 0.0, 2.0, 448.0]
    assert data[3, 1].float() == 1.0 and (data[0].float() == 0).all()
    back = mx.dequantize(data, scale, kernel=kernel)
    assert back[1, 0].item() == sub and back[3, 0].item() == 2.0**-126 and back[3, 1].item() == 2.0**-127
    assert back[4, 0].item() == 448.0 * 2.0**119


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("elem", ELEMS)
@pytest.mark.parametrize("special", [float("nan"), float("inf"), float("-inf")])
def test_nan_and_inf_make_the_block_nan(kernel, elem, special):
    x = torch.ones(2, 64)
    x[0, 40] = special  # second block of row 0
    data, scale = mx.quantize(x, elem=elem, kernel=kernel)
    assert scale.tolist() == [[127 - mx.FORMATS[elem].emax, 0xFF], [127 - mx.FORMATS[elem].emax] * 2]
    assert (data.view(torch.uint8)[0, 32:] == 0x7F).all() and data[0, 32:].float().isnan().all()
    back = mx.dequantize(data, scale, kernel=kernel)
    assert back[0, 32:].isnan().all()
    assert (back[0, :32] == 1).all() and (back[1] == 1).all()
    if hasattr(torch, "float8_e8m0fnu"):
        assert mx.scale_as_e8m0(scale).float()[0, 1].isnan()


def test_scale_as_e8m0_view():
    if not hasattr(torch, "float8_e8m0fnu"):
        pytest.skip("this torch has no float8_e8m0fnu")
    s = torch.tensor([0, 1, 119, 127, 254], dtype=torch.uint8)
    v = mx.scale_as_e8m0(s)
    assert v.dtype == torch.float8_e8m0fnu
    assert v.float().tolist() == [2.0 ** (b - 127) for b in s.tolist()]
    # dequantize takes either form
    data, scale = mx.quantize(torch.randn(3, 32), kernel="reference")
    _same(mx.dequantize(data, mx.scale_as_e8m0(scale), kernel="reference"),
          mx.dequantize(data, scale, kernel="reference"))


# ----------------------------------------------------------------------------- independent RNE oracle


def _oracle_codes(r, fmt):
    """Nearest finite element value to r (|r| <= max), ties to the even code: a search over all 256 codes."""
    codes = torch.arange(256, dtype=torch.uint8)
    vals = codes.view(fmt.dtype).double()
    ok = vals.isfinite()
    codes, vals = codes[ok], vals[ok]
    dist = (r.double()[:, None] - vals[None, :]).abs()
    best = dist.min(1, keepdim=True).values
    tie_ok = (dist == best) & ((codes.to(torch.int64) & 1) == 0)[None, :]
    pick = torch.where(tie_ok.any(1, keepdim=True), tie_ok, dist == best).to(torch.int8).argmax(1)
    out = codes[pick]
    # zero results keep the sign of r
    zero = vals[pick] == 0
    return torch.where(zero & r.signbit(), torch.full_like(out, 0x80), torch.where(zero, torch.zeros_like(out), out))


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("elem", ELEMS)
def test_elements_round_to_nearest_even(kernel, elem):
    fmt = mx.FORMATS[elem]
    g = torch.Generator().manual_seed(1)
    vals = torch.arange(256, dtype=torch.uint8).view(fmt.dtype).float()
    vals = vals[vals.isfinite() & (vals >= 0)].sort().values
    mids = (vals[1:] + vals[:-1]) / 2  # exact ties
    rnd = torch.exp2(torch.empty(400).uniform_(-fmt.ebias - fmt.mbits - 2, fmt.emax + 1, generator=g))
    r = torch.cat([mids, mids.nextafter(torch.tensor(0.0)), vals, rnd, torch.tensor([fmt.max * 1.07])])
    r = torch.cat([r, -r])
    r = torch.cat([r, torch.zeros((-r.numel()) % 31)])
    # each block: 2^emax first (so X = 1) and 31 test values below 2^(emax + 1)
    blocks = torch.cat([torch.full((r.numel() // 31, 1), 2.0**fmt.emax), r.reshape(-1, 31)], 1)
    data, scale = mx.quantize(blocks, elem=elem, kernel=kernel)
    assert (scale == 127).all()
    want = _oracle_codes(r.clamp(-fmt.max, fmt.max), fmt)
    assert torch.equal(data.view(torch.uint8)[:, 1:].reshape(-1), want)


@pytest.mark.parametrize("elem", ELEMS)
def test_round_trip_error_bound(elem):
    fmt = mx.FORMATS[elem]
    g = torch.Generator().manual_seed(2)
    x = torch.randn(64, 96, generator=g) * torch.exp2(torch.randint(-20, 20, (64, 1), generator=g).float())
    data, scale = mx.quantize(x, elem=elem, kernel="reference")
    back = mx.dequantize(data, scale, kernel="reference")
    X = torch.exp2(scale.float() - 127).repeat_interleave(32, 1)
    normal = (x / X).abs() >= 2.0 ** (1 - fmt.ebias)  # in the element's normal range
    saturated = (x / X).abs() > fmt.max
    rel = ((back - x).abs() / x.abs())[normal]
    assert normal.float().mean() > 0.8
    assert rel.max() <= 2.0**-3  # saturation included: (r - max) / r < 2^-3 for r < 2^(emax + 1)
    half_ulp = 2.0 ** -(fmt.mbits + 1)  # RNE: at most half a unit in the last place
    assert ((back - x).abs() / x.abs())[normal & ~saturated].max() <= half_ulp
    # below the normal range the error is at most half the smallest subnormal step
    sub = ~normal
    assert ((back - x).abs() <= X * 2.0 ** (1 - fmt.ebias - fmt.mbits - 1))[sub].all()


# ----------------------------------------------------------------------------- Triton vs reference, bit for bit


def _edgy(shape, dtype, g):
    """Random values over many binades plus zeros, subnormals, ties, huge values, NaN and inf."""
    x = torch.randn(shape, generator=g) * torch.exp2(torch.randint(-30, 30, shape, generator=g).float())
    flat = x.view(-1)
    n = flat.numel()
    if n:
        pick = torch.randint(0, n, (max(1, n // 10),), generator=g)
        specials = torch.tensor([0.0, -0.0, 2.0**-130, -(2.0**-149), 1.0 + 2.0**-4, 17 * 2.0**-8, 3e38, -6e4,
                                 float("nan"), float("inf"), float("-inf"), 2.0**-10, 1e-20])
        flat[pick] = specials[torch.randint(0, specials.numel(), (pick.numel(),), generator=g)]
        if n >= 64:
            flat[:32] = 0.0
    return x.to(dtype)


CASES = [  # (shape, axis, block)
    ((5, 64), -1, 32),
    ((3, 100), -1, 32),
    ((2, 3, 45), 1, 32),
    ((70, 3), 0, 32),
    ((4, 50), -1, 16),
    ((2, 130), -1, 64),
    ((1, 7), -1, 32),
    ((0, 32), -1, 32),
    ((4, 0), -1, 32),
]


@pytest.mark.parametrize("shape,axis,block", CASES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("elem", ELEMS)
def test_triton_matches_reference(shape, axis, block, dtype, elem):
    g = torch.Generator().manual_seed(hash((shape, axis, block)) % 2**31)
    x = _edgy(shape, dtype, g)
    d_ref, s_ref = mx.quantize(x, block, elem, axis, kernel="reference")
    d_tri, s_tri = mx.quantize(x, block, elem, axis, kernel="triton")
    n = shape[axis]
    want_scale = list(shape)
    want_scale[axis] = math.ceil(n / block)
    assert d_ref.shape == x.shape and list(s_ref.shape) == want_scale and s_ref.dtype == torch.uint8
    assert d_ref.dtype == mx.FORMATS[elem].dtype
    assert torch.equal(_bits(d_ref), _bits(d_tri)) and torch.equal(s_ref, s_tri)
    for out in DTYPES:
        _same(mx.dequantize(d_ref, s_ref, block, axis, out, kernel="triton"),
              mx.dequantize(d_ref, s_ref, block, axis, out, kernel="reference"))


@pytest.mark.parametrize("elem", ELEMS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_dequantize_any_codes_and_scales(elem, dtype):
    """Every element code (NaN and E5M2 inf included) against every kind of scale, 0 and 254 included."""
    fmt = mx.FORMATS[elem]
    codes = torch.arange(256, dtype=torch.uint8).reshape(8, 32)
    scales = torch.tensor([0, 1, 2, 100, 127, 200, 254, 255], dtype=torch.uint8)
    data = codes.repeat(8, 1).view(fmt.dtype)
    scale = scales.repeat_interleave(8)[:, None]
    ref = mx.dequantize(data, scale, dtype=dtype, kernel="reference")
    _same(mx.dequantize(data, scale, dtype=dtype, kernel="triton"), ref)
    # the reference is the product data * 2^(scale - 127), computed here in float64
    want = data.double() * torch.exp2(scale.double() - 127).where(scale != 255, torch.tensor(float("nan")))
    _same(ref, want.to(dtype))


def test_axis_matches_transpose():
    x = torch.randn(64, 5, 3)
    d0, s0 = mx.quantize(x, axis=0, kernel="reference")
    d1, s1 = mx.quantize(x.movedim(0, -1).contiguous(), kernel="reference")
    assert torch.equal(_bits(d0), _bits(d1.movedim(-1, 0))) and torch.equal(s0, s1.movedim(-1, 0))
    assert s0.shape == (2, 5, 3)
    _same(mx.dequantize(d0, s0, axis=0), mx.dequantize(d1, s1).movedim(-1, 0).contiguous())


def test_partial_block_equals_zero_padding():
    x = torch.randn(3, 40)
    d, s = mx.quantize(x, kernel="reference")
    dp, sp = mx.quantize(torch.nn.functional.pad(x, (0, 24)), kernel="reference")
    assert torch.equal(s, sp) and torch.equal(_bits(d), _bits(dp)[:, :40])


@pytest.mark.parametrize("call,match", [
    (lambda: mx.quantize(torch.randn(4, 32), elem="e3m2"), "elem must be one of"),
    (lambda: mx.quantize(torch.randn(4, 32), block=24), "block must be a positive power of two"),
    (lambda: mx.quantize(torch.randn(4, 32, dtype=torch.float64)), "float32, bfloat16 or float16"),
    (lambda: mx.quantize(torch.randn(4, 32), axis=2), "axis out of range"),
    (lambda: mx.quantize(torch.tensor(1.0)), "at least one dimension"),
    (lambda: mx.dequantize(torch.zeros(4, 32, dtype=torch.float8_e4m3fn), torch.zeros(4, 2, dtype=torch.uint8)),
     "does not match"),
    (lambda: mx.dequantize(torch.zeros(4, 32), torch.zeros(4, 1, dtype=torch.uint8)), "float8_e4m3fn or"),
    (lambda: mx.dequantize(torch.zeros(4, 32, dtype=torch.float8_e4m3fn), torch.zeros(4, 1)), "scale must be"),
])
def test_bad_input_one_line(call, match):
    with pytest.raises((ValueError, TypeError), match=match) as info:
        call()
    assert "\n" not in str(info.value)


# ----------------------------------------------------------------------------- CUDA


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("elem", ELEMS)
def test_cuda_triton_matches_reference(dtype, elem):
    g = torch.Generator().manual_seed(3)
    for shape, axis, block in CASES + [((257, 4096), -1, 32), ((4096, 96), 0, 32)]:
        x = _edgy(shape, dtype, g)
        d_ref, s_ref = mx.quantize(x, block, elem, axis, kernel="reference")
        d_gpu, s_gpu = mx.quantize(x.cuda(), block, elem, axis, kernel="triton")
        assert torch.equal(_bits(d_ref), _bits(d_gpu.cpu())) and torch.equal(s_ref, s_gpu.cpu())
        for out in DTYPES:
            _same(mx.dequantize(d_gpu, s_gpu, block, axis, out, kernel="triton").cpu(),
                  mx.dequantize(d_ref, s_ref, block, axis, out, kernel="reference"))
