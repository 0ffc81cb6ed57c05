"""Block-scaled FP8 (E4M3) as DeepSeek-V3 trains with it: 1 x 128 blocks for activations and gradients, 128 x 128
for weights, one fp32 scale a block.

Scale of a block: the smallest power of two s with amax / s <= 448 (E4M3's largest finite value), from amax's bits:
amax = 1.f * 2^E gives s = 2^(E - 8 + (1.f > 1.75)), floored at 2^-126 (all-zero blocks get 2^-126).
Codes: fp8(clamp(x / s, -448, 448)), round-to-nearest-even (torch's cast); x / s is exact (s a power of two).
Powers of two keep the division exact and cost at most one bit of E4M3's range against s = amax / 448.
A block holding NaN or +-inf gets scale NaN and every code 0x7F (NaN): E4M3 has no inf. Dequantize: code * s.

Layouts (what torch._scaled_mm's block-wise recipes take; the token axis may be ragged):
- quantize_1x128(x [M, K]): data [M, K], scale [M, ceil(K / 128)]; blocks along K (the reduction axis of the
  forward and input-gradient GEMMs). A ragged K ends in a partial block (zeros count for nothing in amax).
- transposed=True also returns the blocks along M for the weight-gradient GEMM (reduction over tokens), from the same
  read of x: data_t [K, Mp] (x^T, Mp = M rounded up to 128, padding columns 0) and scale_t [Mp / 128, K].
- quantize_128x128(w [N, K]): data [N, K], data_t [K, N] (w^T, the input-gradient GEMM's operand), scale
  [ceil(N / 128), ceil(K / 128)] (w^T's scales are scale.t()).

Producers that write their output straight into these blocks (BlockFP8Act: both layouts from one kernel, the bytes
of quantize_1x128 of the op's own output, no bf16 copy unless asked for): rms_norm_1x128, layer_norm_1x128,
swiglu_1x128; and swiglu_bwd_quant_op, SwiGLU's backward writing da and db only as blocks.

kernel: "auto" (Triton on CUDA or under TRITON_INTERPRET=1, else the reference) | "triton" | "reference"; both
give the same bytes (NaN payloads included: codes 0x7F).
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch
import torch.nn.functional as F

from gem.ops._common import cdiv, resolve_kernel

__all__ = ["BLOCK", "FP8_MAX", "BlockFP8Act", "dequantize_1x128", "dequantize_128x128", "layer_norm_1x128",
           "quantize_1x128", "quantize_128x128", "rms_norm_1x128", "swiglu_1x128"]

BLOCK = 128
FP8_MAX = 448.0
E4M3 = torch.float8_e4m3fn
_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


# ---------------------------------------------------------------------------------------------------- reference


def pow2_scale_reference(amax: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """fp32 amax (>= 0 or NaN) -> (scale, 1 / scale, non-finite mask), the bit arithmetic of the kernels."""
    bits = amax.float().contiguous().view(torch.int32) & 0x7FFFFFFF  # a NaN amax may carry the sign bit (x86's)
    ex = bits >> 23
    k = (ex - 135 + ((bits & 0x7FFFFF) > 0x600000).to(torch.int32)).clamp_min(-126)
    nonfinite = ex >= 255
    scale = ((k + 127) << 23).view(torch.float32)
    scale = torch.where(nonfinite, torch.full_like(scale, float("nan")), scale)
    return scale, ((127 - k) << 23).view(torch.float32), nonfinite


def _encode_reference(xf: torch.Tensor, inv: torch.Tensor, nonfinite: torch.Tensor) -> torch.Tensor:
    codes = (xf * inv).clamp(-FP8_MAX, FP8_MAX).to(E4M3).view(torch.uint8)
    return torch.where(nonfinite, torch.full_like(codes, 0x7F), codes)


def quantize_1x128_reference(x2d: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[M, K] -> (uint8 codes [M, K], fp32 scales [M, ceil(K / 128)])."""
    m, k = x2d.shape
    nb = cdiv(k, BLOCK)
    xf = F.pad(x2d.float(), (0, nb * BLOCK - k)).reshape(m, nb, BLOCK)
    amax = xf.abs().amax(-1) if m * nb else xf.new_zeros(m, nb)
    scale, inv, nonfinite = pow2_scale_reference(amax)
    codes = _encode_reference(xf, inv[..., None], nonfinite[..., None])
    return codes.reshape(m, nb * BLOCK)[:, :k].contiguous(), scale


def quantize_1x128_t_reference(x2d: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[M, K] -> blocks of 128 along M: (uint8 codes of x^T [K, Mp], fp32 scales [Mp / 128, K]), Mp = M rounded
    up to 128, padding codes 0."""
    m = x2d.shape[0]
    mp = cdiv(m, BLOCK) * BLOCK
    codes, scale = quantize_1x128_reference(F.pad(x2d, (0, 0, 0, mp - m)).t())
    return codes, scale.t().contiguous()


def quantize_128x128_reference(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[N, K] -> (uint8 codes [N, K], fp32 scales [ceil(N / 128), ceil(K / 128)])."""
    n, k = w.shape
    nbn, nbk = cdiv(n, BLOCK), cdiv(k, BLOCK)
    wf = F.pad(w.float(), (0, nbk * BLOCK - k, 0, nbn * BLOCK - n)).reshape(nbn, BLOCK, nbk, BLOCK)
    amax = wf.abs().amax((1, 3)) if nbn * nbk else wf.new_zeros(nbn, nbk)
    scale, inv, nonfinite = pow2_scale_reference(amax)
    codes = _encode_reference(wf, inv[:, None, :, None], nonfinite[:, None, :, None])
    return codes.reshape(nbn * BLOCK, nbk * BLOCK)[:n, :k].contiguous(), scale


def dequantize_1x128_reference(codes: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    k = codes.shape[1]
    s = scale.repeat_interleave(BLOCK, dim=1)[:, :k]
    return (codes.view(E4M3).float() * s).to(dtype)


def dequantize_128x128_reference(codes: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    n, k = codes.shape
    s = scale.repeat_interleave(BLOCK, dim=0).repeat_interleave(BLOCK, dim=1)[:n, :k]
    return (codes.view(E4M3).float() * s).to(dtype)


def norm_reference(x2d, weight, bias, eps, layer):
    """RMSNorm (LayerNorm: layer) in fp32 -> (y fp32, mean fp32 [rows] or None, rstd fp32 [rows])."""
    xf = x2d.float()
    mean = xf.mean(-1) if layer else None
    xc = xf - mean[:, None] if layer else xf
    rstd = torch.rsqrt(xc.pow(2).mean(-1) + eps)
    y32 = xc * rstd[:, None] * weight.float()
    if bias is not None:
        y32 = y32 + bias.float()
    return y32, mean, rstd


def norm_bwd_reference(x2d, weight, g2d, mean, rstd, has_bias):
    """(dx in x's dtype, dw fp32 [n], db fp32 [n] or None) of y = (x - mean) * rstd * w (+ b), mean None: 0."""
    g, r = g2d.float(), rstd[:, None]
    xhat = (x2d.float() if mean is None else x2d.float() - mean[:, None]) * r
    gw = g * weight.float()
    dx = gw - xhat * (gw * xhat).mean(-1, keepdim=True)
    if mean is not None:
        dx = dx - gw.mean(-1, keepdim=True)
    return (r * dx).to(x2d.dtype), (g * xhat).sum(0), g.sum(0) if has_bias else None


def swiglu_reference(a2d, b2d):
    """silu(a) * b in fp32, rounded once to a's dtype."""
    return (F.silu(a2d.float()) * b2d.float()).to(a2d.dtype)


def swiglu_bwd_reference(a, b, g):
    af, bf, gf = a.float(), b.float(), g.float()
    sig = torch.sigmoid(af)
    return (gf * bf * sig * (1 + af * (1 - sig))).to(a.dtype), (gf * af * sig).to(b.dtype)


# ---------------------------------------------------------------------------------------------------- public API


def _check_x(x, where: str) -> None:
    if not isinstance(x, torch.Tensor) or x.dtype not in _DTYPES:
        raise TypeError(f"{where}: x must be a float32, bfloat16 or float16 tensor (got "
                        f"{x.dtype if isinstance(x, torch.Tensor) else type(x).__name__})")
    if x.dim() == 0:
        raise ValueError(f"{where}: x must have at least one dimension (got a scalar)")


def _impl(kernel: str, *tensors: torch.Tensor) -> str:
    impl = resolve_kernel(kernel, *tensors)
    return "reference" if impl == "triton" and any(t.numel() == 0 for t in tensors) else impl


def quantize_1x128(x: torch.Tensor, transposed: bool = False, kernel: str = "auto"):
    """x [..., K] flattened to [M, K] -> (data E4M3 [M, K], scale fp32 [M, ceil(K / 128)]); transposed=True also
    (data_t E4M3 [K, Mp], scale_t fp32 [Mp / 128, K]) with blocks of 128 along M, from the same pass."""
    where = "gem.ops.fp8_block.quantize_1x128"
    _check_x(x, where)
    x2d = x.reshape(math.prod(x.shape[:-1]), x.shape[-1]).contiguous()
    if _impl(kernel, x2d) == "triton":
        from gem.ops.triton_fp8_block import quantize_1x128_triton

        out = quantize_1x128_triton(x2d, transposed)
    else:
        out = quantize_1x128_reference(x2d)
        if transposed:
            out = out + quantize_1x128_t_reference(x2d)
    return tuple(t.view(E4M3) if t.dtype == torch.uint8 else t for t in out)


def quantize_128x128(w: torch.Tensor, kernel: str = "auto", transposed: bool = True):
    """w [N, K] -> (data E4M3 [N, K], data_t E4M3 [K, N] (w^T; None unless transposed), scale fp32
    [ceil(N / 128), ceil(K / 128)])."""
    where = "gem.ops.fp8_block.quantize_128x128"
    _check_x(w, where)
    if w.dim() != 2:
        raise ValueError(f"{where}: w must be 2-d [out, in] (got shape {tuple(w.shape)})")
    w = w.contiguous()
    if _impl(kernel, w) == "triton":
        from gem.ops.triton_fp8_block import quantize_128x128_triton

        codes, codes_t, scale = quantize_128x128_triton(w, transposed)
    else:
        codes, scale = quantize_128x128_reference(w)
        codes_t = codes.t().contiguous() if transposed else None
    return codes.view(E4M3), None if codes_t is None else codes_t.view(E4M3), scale


def _check_dequant(data, scale, dtype, want, where):
    if not isinstance(data, torch.Tensor) or data.dtype != E4M3 or data.dim() != 2:
        raise TypeError(f"{where}: data must be a 2-d float8_e4m3fn tensor")
    if scale.dtype != torch.float32 or tuple(scale.shape) != want:
        raise ValueError(f"{where}: scale must be fp32 of shape {want} for data {tuple(data.shape)} "
                         f"(got {scale.dtype} {tuple(scale.shape)})")
    if dtype not in _DTYPES:
        raise TypeError(f"{where}: dtype must be float32, bfloat16 or float16 (got {dtype})")


def dequantize_1x128(data: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.bfloat16,
                     kernel: str = "auto") -> torch.Tensor:
    """Inverse of quantize_1x128's first pair: data [M, K] * scale [M, ceil(K / 128)] per block, as dtype."""
    where = "gem.ops.fp8_block.dequantize_1x128"
    _check_dequant(data, scale, dtype, (data.shape[0], cdiv(data.shape[1], BLOCK)) if data.dim() == 2 else (), where)
    codes, scale = data.contiguous().view(torch.uint8), scale.contiguous()
    if _impl(kernel, codes, scale) == "triton":
        from gem.ops.triton_fp8_block import dequantize_triton

        return dequantize_triton(codes, scale, dtype, weight=False)
    return dequantize_1x128_reference(codes, scale, dtype)


def dequantize_128x128(data: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.bfloat16,
                       kernel: str = "auto") -> torch.Tensor:
    """Inverse of quantize_128x128: data [N, K] * scale [ceil(N / 128), ceil(K / 128)] per block, as dtype."""
    where = "gem.ops.fp8_block.dequantize_128x128"
    want = (cdiv(data.shape[0], BLOCK), cdiv(data.shape[1], BLOCK)) if data.dim() == 2 else ()
    _check_dequant(data, scale, dtype, want, where)
    codes, scale = data.contiguous().view(torch.uint8), scale.contiguous()
    if _impl(kernel, codes, scale) == "triton":
        from gem.ops.triton_fp8_block import dequantize_triton

        return dequantize_triton(codes, scale, dtype, weight=True)
    return dequantize_128x128_reference(codes, scale, dtype)


# ---------------------------------------------------------------------------------------------------- custom ops
# Opaque to torch.compile (the Triton kernels run as they are), traceable around them.


@torch.library.custom_op("gem::fp8_block_quantize_act", mutates_args=())
def quantize_act_op(x2d: torch.Tensor, transposed: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor,
                                                                  torch.Tensor]:
    """quantize_1x128(x2d, transposed) for a 2-d x2d; without transposed, the last two outputs are empty."""
    out = quantize_1x128(x2d, transposed, kernel="auto" if x2d.is_cuda else "reference")
    if not transposed:
        out = out + (x2d.new_empty((0,), dtype=E4M3), x2d.new_empty((0,), dtype=torch.float32))
    return out


@quantize_act_op.register_fake
def _(x2d, transposed):
    m, k = x2d.shape
    mp = cdiv(m, BLOCK) * BLOCK
    q, s = x2d.new_empty((m, k), dtype=E4M3), x2d.new_empty((m, cdiv(k, BLOCK)), dtype=torch.float32)
    if not transposed:
        return q, s, x2d.new_empty((0,), dtype=E4M3), x2d.new_empty((0,), dtype=torch.float32)
    return q, s, x2d.new_empty((k, mp), dtype=E4M3), x2d.new_empty((mp // BLOCK, k), dtype=torch.float32)


@torch.library.custom_op("gem::fp8_block_quantize_weight", mutates_args=())
def quantize_weight_op(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """quantize_128x128(w)."""
    return quantize_128x128(w, kernel="auto" if w.is_cuda else "reference")


@quantize_weight_op.register_fake
def _(w):
    n, k = w.shape
    return (w.new_empty((n, k), dtype=E4M3), w.new_empty((k, n), dtype=E4M3),
            w.new_empty((cdiv(n, BLOCK), cdiv(k, BLOCK)), dtype=torch.float32))


# ---------------------------------------------------------------------------------------------------- producers
# RMSNorm / LayerNorm and SwiGLU that write their output straight into 1x128 blocks (and the token-blocked
# transposed layout), for a BlockFP8Linear that takes the result as its input: no separate quantization pass, and
# no bf16 copy of the output unless asked for. Their backward is the op's own (Triton kernels), from the
# inputs they save; the gradient arrives through BlockFP8Act.out.


class BlockFP8Act(NamedTuple):
    """A GEMM input already in 1x128 blocks, as BlockFP8Linear takes it.

    out: [..., K] in the producer's dtype, the tensor the gradient flows back through. Its values are the
    producer's output when it was asked for (output=True), else it is a zero-strided placeholder of that shape.
    data / scale: E4M3 [M, K] / fp32 [M, ceil(K / 128)] (M: the tokens, out's leading dims flattened).
    data_t / scale_t: E4M3 [K, Mp] / fp32 [Mp / 128, K], blocks along the tokens (the weight gradient's operand),
    or None when not produced (transposed=False)."""

    out: torch.Tensor
    data: torch.Tensor
    scale: torch.Tensor
    data_t: torch.Tensor | None
    scale_t: torch.Tensor | None


def _empty(t: torch.Tensor, dtype=E4M3) -> torch.Tensor:
    return t.new_empty((0,), dtype=dtype)


def _codes(t: torch.Tensor | None, like: torch.Tensor) -> torch.Tensor:
    return _empty(like) if t is None else t.view(E4M3)


def _block_outputs_fake(x2d, transposed):
    m, k = x2d.shape
    mp = cdiv(m, BLOCK) * BLOCK
    q, s = x2d.new_empty((m, k), dtype=E4M3), x2d.new_empty((m, cdiv(k, BLOCK)), dtype=torch.float32)
    if not transposed:
        return q, s, _empty(x2d), _empty(x2d, torch.float32)
    return q, s, x2d.new_empty((k, mp), dtype=E4M3), x2d.new_empty((mp // BLOCK, k), dtype=torch.float32)


def _reference_blocks(y2d, transposed):
    q, s = quantize_1x128_reference(y2d)
    if not transposed:
        return q.view(E4M3), s, _empty(y2d), _empty(y2d, torch.float32)
    qt, st = quantize_1x128_t_reference(y2d)
    return q.view(E4M3), s, qt.view(E4M3), st


@torch.library.custom_op("gem::fp8_block_norm_fwd", mutates_args=())
def norm_fwd_op(x2d: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, eps: float, layer: bool,
                transposed: bool, write_y: bool, impl: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor,
                                                                     torch.Tensor, torch.Tensor, torch.Tensor,
                                                                     torch.Tensor]:
    """(y (empty unless write_y), q, s, qt, st (empty unless transposed), mean (empty for RMSNorm), rstd)."""
    if impl == "triton" and x2d.numel():
        from gem.ops.triton_fp8_block import norm_quant_triton

        y, q, s, qt, st, mean, rstd = norm_quant_triton(x2d, weight, bias, eps, layer, transposed, write_y)
        return (_empty(x2d, x2d.dtype) if y is None else y, q.view(E4M3), s, _codes(qt, x2d),
                _empty(x2d, torch.float32) if st is None else st, _empty(x2d, torch.float32) if mean is None else mean,
                rstd)
    y32, mean, rstd = norm_reference(x2d, weight, bias, eps, layer)
    y = y32.to(x2d.dtype)
    return (y if write_y else _empty(x2d, x2d.dtype), *_reference_blocks(y, transposed),
            _empty(x2d, torch.float32) if mean is None else mean, rstd)


@norm_fwd_op.register_fake
def _(x2d, weight, bias, eps, layer, transposed, write_y, impl):
    m = x2d.shape[0]
    y = x2d.new_empty(x2d.shape) if write_y else _empty(x2d, x2d.dtype)
    stat = x2d.new_empty((m,), dtype=torch.float32)
    return (y, *_block_outputs_fake(x2d, transposed), stat if layer else _empty(x2d, torch.float32), stat.clone())


@torch.library.custom_op("gem::fp8_block_norm_bwd", mutates_args=())
def norm_bwd_op(x2d: torch.Tensor, weight: torch.Tensor, g2d: torch.Tensor, mean: torch.Tensor, rstd: torch.Tensor,
                layer: bool, has_bias: bool, impl: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dx in x's dtype, dw fp32 [K], db fp32 [K] (empty without bias)) of the norm, from its saved inputs."""
    m = None if not layer else mean
    if impl == "triton" and x2d.numel():
        from gem.ops.triton_fp8_block import norm_bwd_triton

        dx, dw, db = norm_bwd_triton(x2d, weight, g2d, m, rstd, has_bias)
    else:
        dx, dw, db = norm_bwd_reference(x2d, weight, g2d, m, rstd, has_bias)
    return dx, dw, _empty(x2d, torch.float32) if db is None else db


@norm_bwd_op.register_fake
def _(x2d, weight, g2d, mean, rstd, layer, has_bias, impl):
    k = x2d.shape[1]
    return (x2d.new_empty(x2d.shape), x2d.new_empty((k,), dtype=torch.float32),
            x2d.new_empty((k,) if has_bias else (0,), dtype=torch.float32))


@torch.library.custom_op("gem::fp8_block_swiglu_fwd", mutates_args=())
def swiglu_fwd_op(a2d: torch.Tensor, b2d: torch.Tensor, transposed: bool, write_y: bool,
                  impl: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(h (empty unless write_y), q, s, qt, st (empty unless transposed))."""
    if impl == "triton" and a2d.numel():
        from gem.ops.triton_fp8_block import swiglu_quant_triton

        h, q, s, qt, st = swiglu_quant_triton(a2d, b2d, transposed, write_y)
        return (_empty(a2d, a2d.dtype) if h is None else h, q.view(E4M3), s, _codes(qt, a2d),
                _empty(a2d, torch.float32) if st is None else st)
    h = swiglu_reference(a2d, b2d)
    return (h if write_y else _empty(a2d, a2d.dtype), *_reference_blocks(h, transposed))


@swiglu_fwd_op.register_fake
def _(a2d, b2d, transposed, write_y, impl):
    return (a2d.new_empty(a2d.shape) if write_y else _empty(a2d, a2d.dtype), *_block_outputs_fake(a2d, transposed))


@torch.library.custom_op("gem::fp8_block_swiglu_bwd", mutates_args=())
def swiglu_bwd_op(a2d: torch.Tensor, b2d: torch.Tensor, g2d: torch.Tensor,
                  impl: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(da, db) in a's dtype of h = silu(a) * b."""
    if impl == "triton" and a2d.numel():
        from gem.ops.triton_fp8_block import swiglu_bwd_triton

        return swiglu_bwd_triton(a2d, b2d, g2d)
    return swiglu_bwd_reference(a2d, b2d, g2d)


@swiglu_bwd_op.register_fake
def _(a2d, b2d, g2d, impl):
    return a2d.new_empty(a2d.shape), b2d.new_empty(b2d.shape)


class _NormFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, eps, layer, transposed, write_y, impl):
        x2d = _rows(x)
        y, q, s, qt, st, mean, rstd = torch.ops.gem.fp8_block_norm_fwd(x2d, weight, bias, eps, layer, transposed,
                                                                       write_y, impl)
        ctx.save_for_backward(x2d, weight, mean, rstd)
        ctx.layer, ctx.has_bias, ctx.impl = layer, bias is not None, impl
        ctx.mark_non_differentiable(q, s, qt, st)
        return (y if write_y else x.new_zeros(()).expand(x.shape)), q, s, qt, st

    @staticmethod
    def backward(ctx, gy, *_):
        x2d, weight, mean, rstd = ctx.saved_tensors
        g2d = _rows(gy.to(x2d.dtype))
        dx, dw, db = torch.ops.gem.fp8_block_norm_bwd(x2d, weight, g2d, mean, rstd, ctx.layer, ctx.has_bias, ctx.impl)
        return (dx.view(gy.shape), dw.to(weight.dtype) if ctx.needs_input_grad[1] else None,
                db.to(weight.dtype) if ctx.has_bias and ctx.needs_input_grad[2] else None) + (None,) * 5


class _SwiGLUFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, a, b, transposed, write_y, impl):
        a2d, b2d = _rows(a), _rows(b)
        h, q, s, qt, st = torch.ops.gem.fp8_block_swiglu_fwd(a2d, b2d, transposed, write_y, impl)
        ctx.save_for_backward(a2d, b2d)
        ctx.impl = impl
        ctx.mark_non_differentiable(q, s, qt, st)
        return (h if write_y else a.new_zeros(()).expand(a.shape)), q, s, qt, st

    @staticmethod
    def backward(ctx, gh, *_):
        a2d, b2d = ctx.saved_tensors
        da, db = torch.ops.gem.fp8_block_swiglu_bwd(a2d, b2d, _rows(gh.to(a2d.dtype)), ctx.impl)
        return da.view(gh.shape), db.view(gh.shape), None, None, None


@torch.library.custom_op("gem::fp8_block_swiglu_bwd_quant", mutates_args=())
def swiglu_bwd_quant_op(a2d: torch.Tensor, b2d: torch.Tensor, g2d: torch.Tensor, transposed: bool,
                        impl: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor,
                                         torch.Tensor, torch.Tensor, torch.Tensor]:
    """SwiGLU's backward with da and db written only as 1x128 blocks: (q, s, qt, st) of da, then of db (qt / st
    empty unless transposed); the bytes of quantize_1x128 of swiglu_bwd_op's (da, db) rounded to bf16 (the dtype a
    BlockFP8Linear receives its output gradient in)."""
    if impl == "triton" and a2d.numel():
        from gem.ops.triton_fp8_block import swiglu_bwd_quant_triton

        out = []
        for q, s, qt, st in swiglu_bwd_quant_triton(a2d, b2d, g2d, transposed):
            out += [q.view(E4M3), s, _codes(qt, a2d), _empty(a2d, torch.float32) if st is None else st]
        return tuple(out)
    da, db = swiglu_bwd_reference(a2d, b2d, g2d)
    return (*_reference_blocks(da.bfloat16(), transposed), *_reference_blocks(db.bfloat16(), transposed))


@swiglu_bwd_quant_op.register_fake
def _(a2d, b2d, g2d, transposed, impl):
    return (*_block_outputs_fake(a2d, transposed), *_block_outputs_fake(a2d, transposed))


def _rows(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(math.prod(t.shape[:-1]), t.shape[-1]).contiguous()


def _producer_impl(kernel: str, *tensors: torch.Tensor) -> str:
    impl = resolve_kernel(kernel, *tensors)
    if kernel == "auto" and impl == "triton" and not tensors[0].is_cuda:
        return "reference"  # the Triton interpreter would be far too slow for a model on CPU
    return impl


def _pack(outs, shape, transposed, write_y) -> BlockFP8Act:
    out, q, s, qt, st = outs
    return BlockFP8Act(out.view(shape) if write_y else out, q, s, qt if transposed else None,
                       st if transposed else None)


def _norm(x, weight, bias, eps, layer, transposed, output, kernel, where) -> BlockFP8Act:
    _check_x(x, where)
    k = x.shape[-1]
    if k == 0:
        raise ValueError(f"{where}: x needs a non-empty last axis to normalize (got shape {tuple(x.shape)})")
    if weight is None:
        weight = torch.ones(k, dtype=x.dtype if bias is None else bias.dtype, device=x.device)
    for name, t in (("weight", weight), ("bias", bias)):
        if t is not None and (not isinstance(t, torch.Tensor) or t.shape != (k,) or t.dtype not in _DTYPES):
            raise ValueError(f"{where}: {name} must be a float [{k}] tensor (got "
                             f"{getattr(t, 'dtype', type(t).__name__)} {tuple(getattr(t, 'shape', ()))})")
    if bias is not None and bias.dtype != weight.dtype:
        raise ValueError(f"{where}: bias must have weight's dtype (got {bias.dtype} and {weight.dtype})")
    impl = _producer_impl(kernel, x, weight)
    outs = _NormFn.apply(x, weight.contiguous(), None if bias is None else bias.contiguous(), float(eps), layer,
                         transposed, output, impl)
    return _pack(outs, x.shape, transposed, output)


def rms_norm_1x128(x: torch.Tensor, weight: torch.Tensor | None = None, eps: float = 1e-6, transposed: bool = True,
                   output: bool = False, kernel: str = "auto") -> BlockFP8Act:
    """RMSNorm over the last axis (x * rsqrt(mean(x^2) + eps) * weight in fp32, rounded to x's dtype) written
    straight into 1x128 blocks: the bytes of quantize_1x128(y, transposed) for that y, in one kernel. output=True
    also writes y (BlockFP8Act.out); the gradient of out flows to x and weight. weight None: no affine scale."""
    return _norm(x, weight, None, eps, False, transposed, output, kernel, "gem.ops.fp8_block.rms_norm_1x128")


def layer_norm_1x128(x: torch.Tensor, weight: torch.Tensor | None = None, bias: torch.Tensor | None = None,
                     eps: float = 1e-5, transposed: bool = True, output: bool = False,
                     kernel: str = "auto") -> BlockFP8Act:
    """LayerNorm over the last axis (F.layer_norm's biased variance) written straight into 1x128 blocks, as
    rms_norm_1x128; the gradient of out flows to x, weight and bias."""
    return _norm(x, weight, bias, eps, True, transposed, output, kernel, "gem.ops.fp8_block.layer_norm_1x128")


def swiglu_1x128(a: torch.Tensor, b: torch.Tensor, transposed: bool = True, output: bool = False,
                 kernel: str = "auto") -> BlockFP8Act:
    """h = silu(a) * b (in fp32, rounded once to a's dtype) written straight into 1x128 blocks along the last
    axis (the down projection's reduction axis): the bytes of quantize_1x128(h, transposed). output=True also
    writes h (BlockFP8Act.out); the gradient of out flows to a and b."""
    where = "gem.ops.fp8_block.swiglu_1x128"
    _check_x(a, where)
    if not isinstance(b, torch.Tensor) or b.shape != a.shape or b.dtype != a.dtype or b.device != a.device:
        raise ValueError(f"{where}: b must match a in shape, dtype and device (got "
                         f"{tuple(getattr(b, 'shape', ()))} {getattr(b, 'dtype', type(b).__name__)} vs "
                         f"{tuple(a.shape)} {a.dtype})")
    impl = _producer_impl(kernel, a, b)
    return _pack(_SwiGLUFn.apply(a, b, transposed, output, impl), a.shape, transposed, output)
