"""Block-scaled FP8 (gem.ops.fp8_block): the reference against first principles, the Triton kernels (interpreter on
CPU, CUDA under -m gpu) bit for bit against the reference, dequantize as the inverse, edge values and ragged
shapes."""

import pytest
import torch

from gem.ops import fp8_block as fb
from tests.ops.test_mx import _same

pytestmark = pytest.mark.filterwarnings("ignore:overflow encountered in cast:RuntimeWarning")

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
# ragged token counts (not multiples of 128) and ragged feature counts (partial last block)
SHAPES = [(1, 128), (5, 256), (130, 200), (257, 128), (3, 7), (0, 128), (4, 0)]


def _values(shape, dtype, g, specials=True):
    """Values over many binades with zeros, subnormals, saturating magnitudes and, sparsely, NaN / inf."""
    x = torch.randn(shape, generator=g) * torch.exp2(torch.randint(-20, 20, shape, generator=g).float())
    flat = x.view(-1)
    n = flat.numel()
    if n:
        extra = [0.0, -0.0, 2.0**-130, -(2.0**-149), 448.0, 449.0, 464.0, 480.0, 3e38, -65504.0, 2.0**-10]
        if specials:
            extra += [float("nan"), float("inf"), float("-inf")]
        pick = torch.randint(0, n, (max(1, n // 200),), generator=g)
        vals = torch.tensor(extra)
        flat[pick] = vals[torch.randint(0, vals.numel(), (pick.numel(),), generator=g)]
        flat[: min(n, 40)] = 0.0
    if dtype == torch.float16:
        x = x.clamp(-65504, 65504)
    return x.to(dtype)


def _first_principles(x2d):
    """Scales and codes from the definition, block by block in fp64 / Python: s = smallest power of two >= amax /
    448 (>= 2^-126), codes = fp8(x / s)."""
    m, k = x2d.shape
    codes = torch.empty((m, k), dtype=torch.uint8)
    scales = torch.empty((m, -(-k // 128)), dtype=torch.float32)
    for i in range(m):
        for b in range(scales.shape[1]):
            blk = x2d[i, b * 128:(b + 1) * 128].double()
            if not torch.isfinite(blk).all():
                scales[i, b] = float("nan")
                codes[i, b * 128:(b + 1) * 128] = 0x7F
                continue
            amax = blk.abs().max().item()
            e = -126
            while amax / 2.0**e > 448:
                e += 1
            scales[i, b] = 2.0**e
            codes[i, b * 128:(b + 1) * 128] = (blk / 2.0**e).to(torch.float32).to(fb.E4M3).view(torch.uint8)
    return codes, scales


@pytest.mark.parametrize("dtype", DTYPES)
def test_reference_matches_first_principles(dtype):
    g = torch.Generator().manual_seed(1)
    x = _values((6, 300), dtype, g)
    x[2, :128] = torch.tensor([2.0**-140] * 64 + [-(2.0**-133)] * 64).to(dtype)  # subnormal-only block (fp32)
    x[3, :128] = 448.0  # amax exactly 448: scale 1
    x[3, 128:256] = 1.0
    x[3, 128] = 452.0  # just above: scale 2
    x[4, 5] = float("nan")
    codes, scale = fb.quantize_1x128(x, kernel="reference")
    want_codes, want_scale = _first_principles(x.float())
    _same(codes.view(torch.uint8), want_codes)
    _same(scale, want_scale)
    assert scale[3, 0] == 1.0 and scale[3, 1] == 2.0
    assert scale[4, 0].isnan() and (codes.view(torch.uint8)[4, :128] == 0x7F).all()


def test_scale_of_special_amax():
    neg_nan = torch.tensor([-0x400000], dtype=torch.int32).view(torch.float32).item()  # 0xFFC00000, x86's NaN
    amax = torch.tensor([0.0, 2.0**-149, 448.0, 448.0 * (1 + 2.0**-23), 1.0, 3.4e38, float("inf"), float("nan"),
                         neg_nan])
    s, inv, nonfinite = fb.pow2_scale_reference(amax)
    assert s[:6].tolist() == [2.0**-126, 2.0**-126, 1.0, 2.0, 2.0**-8, 2.0**120]
    assert s[6:].isnan().all() and nonfinite.tolist() == [False] * 6 + [True] * 3
    assert torch.equal(s[:6] * inv[:6], torch.ones(6))


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_quantize_1x128_triton_matches_reference(shape, dtype):
    g = torch.Generator().manual_seed(sum(shape))
    x = _values(shape, dtype, g)
    got = fb.quantize_1x128(x, transposed=True, kernel="triton")
    want = fb.quantize_1x128(x, transposed=True, kernel="reference")
    for a, b in zip(got, want, strict=True):
        _same(a.view(torch.uint8) if a.dtype == fb.E4M3 else a, b.view(torch.uint8) if b.dtype == fb.E4M3 else b)
    rows_only = fb.quantize_1x128(x, kernel="triton")
    _same(rows_only[0].view(torch.uint8), want[0].view(torch.uint8))
    _same(rows_only[1], want[1])


def test_transposed_layout_is_quantized_transpose():
    g = torch.Generator().manual_seed(3)
    x = _values((200, 256), torch.bfloat16, g, specials=False)
    _, _, qt, st = fb.quantize_1x128(x, transposed=True, kernel="reference")
    assert qt.shape == (256, 256) and st.shape == (2, 256)
    assert (qt.view(torch.uint8)[:, 200:] == 0).all()
    padded = torch.cat([x, x.new_zeros(56, 256)]).t()
    q, s = fb.quantize_1x128(padded, kernel="reference")
    _same(qt.view(torch.uint8), q.view(torch.uint8))
    _same(st, s.t().contiguous())


@pytest.mark.parametrize("shape", [(128, 128), (256, 384), (200, 130), (5, 300)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_quantize_128x128_triton_matches_reference(shape, dtype):
    g = torch.Generator().manual_seed(sum(shape))
    w = _values(shape, dtype, g)
    got = fb.quantize_128x128(w, kernel="triton")
    want = fb.quantize_128x128(w, kernel="reference")
    for a, b in zip(got, want, strict=True):
        _same(a.view(torch.uint8) if a.dtype == fb.E4M3 else a, b.view(torch.uint8) if b.dtype == fb.E4M3 else b)
    _same(got[1].view(torch.uint8), got[0].view(torch.uint8).t().contiguous())
    for kernel in ("triton", "reference"):  # without W^T (an FSDP shard's codes): the same codes and scales
        q, qt, s = fb.quantize_128x128(w, kernel=kernel, transposed=False)
        assert qt is None
        _same(q.view(torch.uint8), got[0].view(torch.uint8))
        _same(s, got[2])


def test_128x128_reference_block_is_one_scale():
    w = torch.randn((256, 256), generator=torch.Generator().manual_seed(5))
    w[130, 7] = 1000.0  # raises block (1, 0) only
    codes, _, scale = fb.quantize_128x128(w, kernel="reference")
    assert scale[1, 0] == 4.0
    blk = w[128:256, :128]
    _same(codes.view(torch.uint8)[128:256, :128], (blk / 4.0).to(fb.E4M3).view(torch.uint8))


@pytest.mark.parametrize("kernel", ["reference", "triton"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_dequantize_inverts_within_e4m3(kernel, dtype):
    g = torch.Generator().manual_seed(7)
    x = _values((130, 300), torch.float32, g, specials=False).clamp(-1e4, 1e4)
    x[0, 0] = float("nan")
    q, s = fb.quantize_1x128(x, kernel=kernel)
    y = fb.dequantize_1x128(q, s, dtype=dtype, kernel=kernel)
    _same(y, fb.dequantize_1x128(q, s, dtype=dtype, kernel="reference"))
    assert y[0, :128].float().isnan().all()
    # E4M3 keeps 3 mantissa bits: |x - y| <= 2^-4 |x| for normals, <= s * 2^-10 (half the smallest step) below
    err = (y[1:].float() - x[1:]).abs()
    bound = torch.maximum(x[1:].abs() * 2.0**-4, s[1:].repeat_interleave(128, 1)[:, :300] * 2.0**-10)
    if dtype != torch.float32:
        bound = bound * 1.01 + x[1:].abs() * 2.0**-8
    assert (err <= bound).all()
    qw, _, sw = fb.quantize_128x128(x[1:129, :256], kernel=kernel)
    yw = fb.dequantize_128x128(qw, sw, dtype=dtype, kernel=kernel)
    _same(yw, fb.dequantize_128x128(qw, sw, dtype=dtype, kernel="reference"))


def test_bad_inputs():
    with pytest.raises(TypeError, match="x must be"):
        fb.quantize_1x128(torch.zeros(4, 128, dtype=torch.int32))
    with pytest.raises(ValueError, match="2-d"):
        fb.quantize_128x128(torch.zeros(2, 4, 128))
    q, s = fb.quantize_1x128(torch.zeros(4, 256), kernel="reference")
    with pytest.raises(ValueError, match="scale must be fp32 of shape"):
        fb.dequantize_1x128(q, s[:, :1])


# ----------------------------------------------------------------------------- GPU


@pytest.mark.gpu
@pytest.mark.parametrize("shape", [(65536 + 77, 1024), (1000, 4096), (129, 3072)])
def test_gpu_kernels_match_reference(shape):
    g = torch.Generator().manual_seed(11)
    x = _values(shape, torch.bfloat16, g).cuda()
    got = fb.quantize_1x128(x, transposed=True, kernel="triton")
    want = fb.quantize_1x128(x.cpu(), transposed=True, kernel="reference")
    for a, b in zip(got, want, strict=True):
        a = a.cpu()
        _same(a.view(torch.uint8) if a.dtype == fb.E4M3 else a, b.view(torch.uint8) if b.dtype == fb.E4M3 else b)
    rows = fb.quantize_1x128(x, kernel="triton")
    _same(rows[0].cpu().view(torch.uint8), want[0].view(torch.uint8))
    _same(rows[1].cpu(), want[1])
    w = _values((shape[1], 1024), torch.bfloat16, g).cuda()
    for a, b in zip(fb.quantize_128x128(w, kernel="triton"), fb.quantize_128x128(w.cpu(), kernel="reference"),
                    strict=True):
        _same(a.cpu().view(torch.uint8) if a.dtype == fb.E4M3 else a.cpu(),
              b.view(torch.uint8) if b.dtype == fb.E4M3 else b)
    y = fb.dequantize_1x128(got[0], got[1], torch.bfloat16, kernel="triton")
    _same(y.cpu(), fb.dequantize_1x128(want[0], want[1], torch.bfloat16, kernel="reference"))
