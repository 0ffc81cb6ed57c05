"""FP8 quantization for the GEMM inputs, alone or fused into the kernel that produces them.

- quantize_rows: row-wise FP8, one fp32 scale a row, s = max(amax(row), 1e-12) / fp8 max and
  data = fp8(clamp(x / s, -max, max)), round-to-nearest-even (torch's cast): what torch._scaled_mm takes with
  per-token (activations) or per-output-channel (weights) scales.
- rms_norm_quant / layer_norm_quant: a norm whose one pass over a row writes y (x's dtype, for the weight
  gradient of the next GEMM), y quantized (row-wise or MX, gem.ops.mx) and rstd (and mean) for the backward.
  Backward: the norm's backward of y; the quantized outputs are side outputs without gradient.
- swiglu_quant: h = silu(a) * b in a's dtype and h quantized, in one pass; backward gives da, db from dh.

The quantized bytes and scales are those of quantizing the returned y / h (in its dtype): the fused ops equal
"compute, then quantize", bit for bit. y / h themselves are computed in fp32 and rounded once; the Triton kernels
and the references may differ there by the rounding of their sums and exponentials.

Special values follow the row-wise formula: NaN in a row makes its scale and all its codes NaN; inf makes the
scale inf, the finite codes 0 and the inf codes NaN. MX scaling follows gem.ops.mx (a NaN / inf block gets the
NaN scale; a width that is not a multiple of `block` ends in a partial block, padded with zeros).

kernel: "auto" (Triton on CUDA or under TRITON_INTERPRET=1, else the reference) | "triton" | "reference".
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from gem.ops._common import resolve_kernel
from gem.ops.mx import _DTYPES, _ELEM_OF_DTYPE, ElemFormat, _check_args, mx_dequantize_reference, mx_quantize_reference
from gem.ops.triton_fp8 import MIN_AMAX

__all__ = ["layer_norm_quant", "quantize_rows", "rms_norm_mx", "rms_norm_quant", "swiglu_quant"]

SCALINGS = ("row", "mx")


# ---------------------------------------------------------------------------------------------------- reference


def quantize_rows_reference(x2d: torch.Tensor, fmt: ElemFormat) -> tuple[torch.Tensor, torch.Tensor]:
    """[rows, n] -> (uint8 codes [rows, n], fp32 scales [rows, 1]), in torch ops."""
    rows, n = x2d.shape
    amax = x2d.abs().amax(-1, keepdim=True).float() if n else x2d.new_zeros((rows, 1), dtype=torch.float32)
    s = amax.clamp_min(MIN_AMAX) / fmt.max
    return (x2d.float() / s).clamp(-fmt.max, fmt.max).to(fmt.dtype).view(torch.uint8), s


def _quantize_reference(y2d, scaling, fmt, block):
    if scaling == "row":
        return quantize_rows_reference(y2d, fmt)
    return mx_quantize_reference(y2d, block, fmt)


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


def norm_quant_reference(x2d, weight, bias, eps, layer, scaling, fmt, block, y_dequant=False):
    """RMSNorm (LayerNorm: layer) in fp32 -> (y, codes, scales, (mean or None, rstd) fp32 [rows]).
    y_dequant (MX only): codes of the fp32 norm, y their dequantized value."""
    y32, mean, rstd = norm_reference(x2d, weight, bias, eps, layer)
    if y_dequant:
        codes, scale = mx_quantize_reference(y32, block, fmt)
        return mx_dequantize_reference(codes, scale, block, fmt, x2d.dtype), codes, scale, (mean, rstd)
    y = y32.to(x2d.dtype)
    return (y, *_quantize_reference(y, scaling, fmt, block), (mean, rstd))


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


def swiglu_quant_reference(a2d, b2d, scaling, fmt, block):
    h = swiglu_reference(a2d, b2d)
    return (h, *_quantize_reference(h, scaling, fmt, block))


def swiglu_bwd_reference(a, b, g):
    af, bf, gf = a.float(), b.float(), g.float()
    sig = torch.sigmoid(af)
    return (gf * bf * sig * (1 + af * (1 - sig))).to(a.dtype), (gf * af * sig).to(b.dtype)


# ---------------------------------------------------------------------------------------------------- checks


def _rows(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(math.prod(t.shape[:-1]), t.shape[-1]).contiguous()


def _check_scaling(scaling, where):
    if scaling not in SCALINGS:
        raise ValueError(f"{where}: scaling must be one of {SCALINGS} (got {scaling!r})")


def _impl(kernel, where, n, *tensors):
    impl = resolve_kernel(kernel, *tensors)
    if impl == "triton" and any(t.numel() == 0 for t in tensors):
        impl = "reference"  # nothing to compute: the reference gives the empty (or constant-scale) outputs
    if impl == "triton":
        from gem.ops.triton_fp8 import MAX_WIDTH

        if n > MAX_WIDTH:
            if kernel == "triton":
                raise ValueError(f"{where}: the Triton kernel takes rows of at most {MAX_WIDTH} elements (got {n})")
            impl = "reference"
    return impl


def _scale_view(scale, lead):
    return scale.view(*lead, scale.shape[-1])


def _fused_outputs(ctx, y2d, codes, scale, fmt, shape):
    """(y, data, scale) of a fused op in the input's shape; data and scale carry no gradient."""
    data = codes.view(fmt.dtype).view(shape)
    scale = _scale_view(scale, shape[:-1])
    ctx.mark_non_differentiable(data, scale)
    return y2d.view(shape), data, scale


# ---------------------------------------------------------------------------------------------------- public API


def quantize_rows(x: torch.Tensor, dtype: torch.dtype = torch.float8_e4m3fn,
                  kernel: str = "auto") -> tuple[torch.Tensor, torch.Tensor]:
    """Row-wise FP8 along the last axis: (data of x's shape as `dtype`, scale [..., 1] fp32) with
    x ~= data * scale. dtype: torch.float8_e4m3fn or torch.float8_e5m2."""
    where = "gem.ops.fp8.quantize_rows"
    if dtype not in _ELEM_OF_DTYPE:
        raise TypeError(f"{where}: dtype must be torch.float8_e4m3fn or torch.float8_e5m2 (got {dtype})")
    fmt = _ELEM_OF_DTYPE[dtype]
    _check_args(x, 32, fmt.name, where)
    if x.dim() == 0:
        raise ValueError(f"{where}: x must have at least one dimension (got a scalar)")
    x2d = _rows(x)
    if _impl(kernel, where, x.shape[-1], x) == "triton":
        from gem.ops.triton_fp8 import OP_COPY, row_quant_triton

        _, codes, scale, _ = row_quant_triton(OP_COPY, x2d, fmt=fmt)
    else:
        codes, scale = quantize_rows_reference(x2d, fmt)
    return codes.view(dtype).view(x.shape), _scale_view(scale, x.shape[:-1])


class _NormQuant(torch.autograd.Function):
    """Forward: the fused norm + quantize. Backward: the norm's backward of y from the saved x, weight and stats."""

    @staticmethod
    def forward(ctx, x, weight, bias, eps, layer, scaling, fmt, block, impl, y_dequant):
        x2d = _rows(x)
        if impl == "triton":
            from gem.ops.triton_fp8 import OP_LAYER_NORM, OP_RMS_NORM, row_quant_triton

            y, codes, scale, (mean, rstd) = row_quant_triton(
                OP_LAYER_NORM if layer else OP_RMS_NORM, x2d, weight=weight.contiguous(),
                bias=None if bias is None else bias.contiguous(), eps=eps, scaling=scaling, fmt=fmt, block=block,
                y_dequant=y_dequant)
        else:
            y, codes, scale, (mean, rstd) = norm_quant_reference(x2d, weight, bias, eps, layer, scaling, fmt, block,
                                                                 y_dequant)
        ctx.save_for_backward(x2d, weight, mean, rstd)
        ctx.impl, ctx.has_bias = impl, bias is not None
        return _fused_outputs(ctx, y, codes, scale, fmt, x.shape)

    @staticmethod
    def backward(ctx, gy, _gdata, _gscale):
        x2d, weight, mean, rstd = ctx.saved_tensors
        g2d = _rows(gy.to(x2d.dtype))
        if ctx.impl == "triton":
            from gem.ops.triton_fp8 import norm_bwd_triton

            dx, dw, db = norm_bwd_triton(x2d, weight.contiguous(), g2d, mean, rstd, ctx.has_bias)
        else:
            dx, dw, db = norm_bwd_reference(x2d, weight, g2d, mean, rstd, ctx.has_bias)
        dw = dw.to(weight.dtype) if ctx.needs_input_grad[1] else None
        db = db.to(weight.dtype) if ctx.has_bias and ctx.needs_input_grad[2] else None
        return (dx.view(gy.shape), dw, db) + (None,) * 7


def _norm_quant(x, weight, bias, eps, layer, scaling, elem, block, kernel, where, y_dequant=False):
    fmt, block = _check_args(x, block, elem, where)
    _check_scaling(scaling, where)
    if x.dim() == 0 or x.shape[-1] == 0:
        raise ValueError(f"{where}: x needs a non-empty last axis to normalize (got shape {tuple(x.shape)})")
    n = x.shape[-1]
    if weight is None:
        weight = torch.ones(n, dtype=x.dtype if bias is None else bias.dtype, device=x.device)
    for name, t in (("weight", weight), ("bias", bias)):
        if t is not None and (t.shape != (n,) or t.dtype not in _DTYPES):
            raise ValueError(f"{where}: {name} must be a float [{n}] tensor (got {t.dtype} {tuple(t.shape)})")
    if bias is not None and bias.dtype != weight.dtype:
        raise ValueError(f"{where}: bias must have weight's dtype (got {bias.dtype} and {weight.dtype})")
    impl = _impl(kernel, where, n, x, weight)
    return _NormQuant.apply(x, weight, bias, float(eps), layer, scaling, fmt, block, impl, y_dequant)


def rms_norm_quant(x: torch.Tensor, weight: torch.Tensor | None = None, eps: float = 1e-6, scaling: str = "row",
                   elem: str = "e4m3", block: int = 32,
                   kernel: str = "auto") -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """RMSNorm over the last axis that also writes its output quantized for the next GEMM.

    Returns (y, data, scale): y = rms_norm(x) * weight in x's dtype (carries the gradient), data / scale = y
    quantized along the last axis: scaling "row" -> quantize_rows(y) (scale [..., 1] fp32), "mx" ->
    gem.ops.mx.quantize(y, block, elem) (scale [..., ceil(n / block)] uint8 E8M0). elem: "e4m3" | "e5m2".
    weight None: no affine scale.
    """
    return _norm_quant(x, weight, None, eps, False, scaling, elem, block, kernel, "gem.ops.fp8.rms_norm_quant")


def layer_norm_quant(x: torch.Tensor, weight: torch.Tensor | None = None, bias: torch.Tensor | None = None,
                     eps: float = 1e-5, scaling: str = "row", elem: str = "e4m3", block: int = 32,
                     kernel: str = "auto") -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """LayerNorm over the last axis (F.layer_norm's biased variance) that also writes its output quantized:
    (y, data, scale) as rms_norm_quant gives them; the gradient of y flows to x, weight and bias."""
    return _norm_quant(x, weight, bias, eps, True, scaling, elem, block, kernel, "gem.ops.fp8.layer_norm_quant")


class _SwiGLUQuant(torch.autograd.Function):
    @staticmethod
    def forward(ctx, a, b, scaling, fmt, block, impl):
        a2d, b2d = _rows(a), _rows(b)
        if impl == "triton":
            from gem.ops.triton_fp8 import OP_SWIGLU, row_quant_triton

            h, codes, scale, _ = row_quant_triton(OP_SWIGLU, a2d, b=b2d, scaling=scaling, fmt=fmt, block=block)
        else:
            h, codes, scale = swiglu_quant_reference(a2d, b2d, scaling, fmt, block)
        ctx.save_for_backward(a2d, b2d)
        ctx.impl = impl
        return _fused_outputs(ctx, h, codes, scale, fmt, a.shape)

    @staticmethod
    def backward(ctx, gh, _gdata, _gscale):
        a2d, b2d = ctx.saved_tensors
        g2d = _rows(gh.to(a2d.dtype))
        if ctx.impl == "triton":
            from gem.ops.triton_fp8 import swiglu_bwd_triton

            da, db = swiglu_bwd_triton(a2d, b2d, g2d)
        else:
            da, db = swiglu_bwd_reference(a2d, b2d, g2d)
        return da.view(gh.shape), db.view(gh.shape), None, None, None, None


def swiglu_quant(a: torch.Tensor, b: torch.Tensor, scaling: str = "row", elem: str = "e4m3", block: int = 32,
                 kernel: str = "auto") -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """SwiGLU h = silu(a) * b (a's dtype, carries the gradient) that also writes h quantized along the last axis
    (the down projection's reduction axis): returns (h, data, scale), data / scale as in rms_norm_quant."""
    where = "gem.ops.fp8.swiglu_quant"
    fmt, block = _check_args(a, block, elem, where)
    _check_scaling(scaling, where)
    if not isinstance(b, torch.Tensor) or b.shape != a.shape or b.dtype != a.dtype or b.device != a.device:
        raise ValueError(f"{where}: b must match a in shape, dtype and device (got "
                         f"{tuple(b.shape)} {b.dtype} {b.device} vs {tuple(a.shape)} {a.dtype} {a.device})")
    if a.dim() == 0:
        raise ValueError(f"{where}: a must have at least one dimension (got a scalar)")
    impl = _impl(kernel, where, a.shape[-1], a, b)
    return _SwiGLUQuant.apply(a, b, scaling, fmt, block, impl)


def rms_norm_mx(x: torch.Tensor, weight: torch.Tensor | None = None, eps: float = 1e-6, block: int = 32,
                elem: str = "e4m3", kernel: str = "auto") -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """RMSNorm over the last axis fused with MX quantization along it (the next GEMM's reduction axis).

    Returns (y, data, scale): data / scale as quantize(rms_norm(x) in fp32) gives them (no rounding through x's
    dtype in between), and y = their dequantized value in x's dtype, which carries the gradient: backward is
    the RMSNorm backward with the quantization passed straight through. weight None: no affine scale.
    """
    return _norm_quant(x, weight, None, eps, False, "mx", elem, block, kernel, "gem.ops.fp8.rms_norm_mx",
                       y_dequant=True)
