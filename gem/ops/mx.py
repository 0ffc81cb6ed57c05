"""MXFP8 (OCP Microscaling Formats v1.0): quantize / dequantize with a PyTorch reference and Triton kernels.

A block of `block` (32 in the spec) consecutive elements along `axis` (the reduction axis of the GEMM that will
consume it) shares one E8M0 scale X = 2^(floor(log2(amax)) - emax_elem), emax_elem = 8 for E4M3 and 15 for E5M2;
each element is V / X cast to the element type with round-to-nearest-even, saturating at the largest finite
value (448 for E4M3, 57344 for E5M2).

Special cases (the spec leaves some to the implementation; these are the choices here):
- amax == 0 (all zeros) or amax so small that the exponent falls under -127: the smallest scale, 2^-127 (bits 0).
- NaN anywhere in a block: scale NaN (0xFF) and every element 0x7F (NaN in both element types); dequantize gives
  NaN for the whole block.
- +-inf anywhere in a block: treated as NaN (E4M3 has no inf, and an inf amax gives no finite scale), as above.
- Length along `axis` not a multiple of `block`: the last block is partial (padded with zeros internally, which
  leaves its amax unchanged); there are ceil(n / block) scales per row.
- Empty tensors give empty outputs.

Scales are returned as uint8 E8M0 bits (bias 127, 0xFF = NaN); `scale_as_e8m0` views them as
torch.float8_e8m0fnu. Inputs may be fp32, bf16 or fp16; the math is exact in fp32. The Triton kernels
(gem.ops.triton_mx) agree with the reference bit for bit (NaN payloads aside).

"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from gem.ops._common import cdiv, resolve_kernel


@dataclass(frozen=True)
class ElemFormat:
    name: str
    dtype: torch.dtype
    mbits: int  # mantissa bits
    ebias: int  # exponent bias
    emax: int  # exponent of the largest normal
    max: float  # largest finite value


FORMATS = {
    "e4m3": ElemFormat("e4m3", torch.float8_e4m3fn, 3, 7, 8, 448.0),
    "e5m2": ElemFormat("e5m2", torch.float8_e5m2, 2, 15, 15, 57344.0),
}
SCALE_NAN = 0xFF
_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_ELEM_OF_DTYPE = {f.dtype: f for f in FORMATS.values()}


def scale_as_e8m0(scale: torch.Tensor) -> torch.Tensor:
    """uint8 E8M0 bits viewed as torch.float8_e8m0fnu where this torch has it (else returned unchanged)."""
    e8m0 = getattr(torch, "float8_e8m0fnu", None)
    return scale.view(e8m0) if e8m0 is not None and scale.dtype == torch.uint8 else scale


def _scale_bits(scale: torch.Tensor, where: str) -> torch.Tensor:
    if scale.dtype == torch.uint8:
        return scale
    if scale.dtype == getattr(torch, "float8_e8m0fnu", None):
        return scale.view(torch.uint8)
    raise TypeError(f"{where}: scale must be uint8 E8M0 bits or float8_e8m0fnu (got {scale.dtype})")


def _check_block(block, where: str) -> int:
    if not isinstance(block, int) or block < 1 or block & (block - 1):
        raise ValueError(f"{where}: block must be a positive power of two (got {block!r})")
    return block


def _format(elem, where: str) -> ElemFormat:
    if elem not in FORMATS:
        raise ValueError(f"{where}: elem must be one of {tuple(FORMATS)} (got {elem!r})")
    return FORMATS[elem]


def _check_args(x, block, elem, where: str) -> tuple[ElemFormat, int]:
    fmt = _format(elem, where)
    block = _check_block(block, where)
    if not isinstance(x, torch.Tensor) or x.dtype not in _DTYPES:
        raise TypeError(f"{where}: x must be a float32, bfloat16 or float16 tensor (got "
                        f"{x.dtype if isinstance(x, torch.Tensor) else type(x).__name__})")
    return fmt, block


def _to_rows(t: torch.Tensor, axis: int) -> torch.Tensor:
    """`axis` moved last, flattened to [rows, n], contiguous."""
    t = t.movedim(axis, -1)
    return t.reshape(math.prod(t.shape[:-1]), t.shape[-1]).contiguous()


def _from_rows(t2d: torch.Tensor, moved_shape: tuple, axis: int) -> torch.Tensor:
    return t2d.reshape(moved_shape).movedim(-1, axis).contiguous()


# ---------------------------------------------------------------------------------------------------- reference


def _pow2_fp32(e: torch.Tensor) -> torch.Tensor:
    """2^e in fp32 for integer e in [-127, 127], built from bits (2^-127 is an fp32 subnormal)."""
    e = e.to(torch.int32)
    normal = ((e + 127).clamp_min(1) << 23).view(torch.float32)
    return torch.where(e == -127, torch.tensor(2.0**-127, dtype=torch.float32, device=e.device), normal)


def mx_quantize_reference(x2d: torch.Tensor, block: int, fmt: ElemFormat) -> tuple[torch.Tensor, torch.Tensor]:
    """[rows, n] -> (uint8 element codes [rows, n], uint8 E8M0 bits [rows, ceil(n / block)]), in torch ops."""
    rows, n = x2d.shape
    nb = cdiv(n, block)
    xf = F.pad(x2d.float(), (0, nb * block - n)).reshape(rows, nb, block)
    amax = xf.abs().amax(-1) if nb else xf.new_zeros(rows, 0)  # NaN propagates
    finite = torch.isfinite(amax)
    _, e = torch.frexp(torch.where(finite, amax, torch.zeros_like(amax)))  # amax = m * 2^e, m in [0.5, 1)
    shared = torch.where(amax == 0, -127, (e - 1 - fmt.emax).clamp(-127, 127))
    scale = torch.where(finite, shared + 127, SCALE_NAN).to(torch.uint8)
    r = xf * _pow2_fp32(-shared)[..., None]  # exact: a power of two that stays in range
    codes = r.clamp(-fmt.max, fmt.max).to(fmt.dtype).view(torch.uint8)
    codes = torch.where(finite[..., None], codes, torch.full_like(codes, 0x7F))
    return codes.reshape(rows, nb * block)[:, :n], scale


def mx_dequantize_reference(codes: torch.Tensor, scale: torch.Tensor, block: int, fmt: ElemFormat,
                            dtype: torch.dtype) -> torch.Tensor:
    """uint8 codes [rows, n], uint8 E8M0 [rows, nb] -> [rows, n] of dtype."""
    rows, n = codes.shape
    nb = scale.shape[1]
    vals = F.pad(codes.view(fmt.dtype).float(), (0, nb * block - n)).reshape(rows, nb, block)
    s = scale.to(torch.int32)
    x = _pow2_fp32((s - 127).clamp(-127, 127))
    x = torch.where(s == SCALE_NAN, torch.tensor(float("nan"), device=s.device), x)
    return (vals * x[..., None]).reshape(rows, nb * block)[:, :n].to(dtype)


# ---------------------------------------------------------------------------------------------------- public API


def quantize(x: torch.Tensor, block: int = 32, elem: str = "e4m3", axis: int = -1,
             kernel: str = "auto") -> tuple[torch.Tensor, torch.Tensor]:
    """MX-quantize x along `axis` in blocks of `block`.

    Returns (data, scale): data of x's shape as torch.float8_e4m3fn / float8_e5m2, scale as uint8 E8M0 bits of
    x's shape with `axis` cut to ceil(n / block) (scale_as_e8m0 views it as float8_e8m0fnu).
    kernel: "auto" (Triton on CUDA or under TRITON_INTERPRET=1, else the reference) | "triton" | "reference".
    """
    where = "gem.ops.mx.quantize"
    fmt, block = _check_args(x, block, elem, where)
    if x.dim() == 0:
        raise ValueError(f"{where}: x must have at least one dimension (got a scalar)")
    axis = axis % x.dim() if -x.dim() <= axis < x.dim() else None
    if axis is None:
        raise ValueError(f"{where}: axis out of range for a {x.dim()}-d tensor")
    moved = tuple(x.movedim(axis, -1).shape)
    x2d = _to_rows(x, axis)
    impl = resolve_kernel(kernel, x)
    if impl == "triton":
        from gem.ops.triton_mx import mx_quantize_triton

        codes, scale = mx_quantize_triton(x2d, block, fmt)
    else:
        codes, scale = mx_quantize_reference(x2d, block, fmt)
    scale_shape = moved[:-1] + (scale.shape[1],)
    return _from_rows(codes.view(fmt.dtype), moved, axis), _from_rows(scale, scale_shape, axis)


def dequantize(data: torch.Tensor, scale: torch.Tensor, block: int = 32, axis: int = -1,
               dtype: torch.dtype = torch.float32, kernel: str = "auto") -> torch.Tensor:
    """Inverse of quantize: data * 2^(scale - 127) per block, as dtype (fp32, bf16 or fp16).

    The element type comes from data's dtype (float8_e4m3fn or float8_e5m2); a NaN scale (0xFF) makes its whole
    block NaN.
    """
    where = "gem.ops.mx.dequantize"
    block = _check_block(block, where)
    if not isinstance(data, torch.Tensor) or data.dtype not in _ELEM_OF_DTYPE:
        raise TypeError(f"{where}: data must be float8_e4m3fn or float8_e5m2 (got "
                        f"{data.dtype if isinstance(data, torch.Tensor) else type(data).__name__})")
    fmt = _ELEM_OF_DTYPE[data.dtype]
    scale = _scale_bits(scale, where)
    if dtype not in _DTYPES:
        raise TypeError(f"{where}: dtype must be float32, bfloat16 or float16 (got {dtype})")
    if data.dim() == 0:
        raise ValueError(f"{where}: data must have at least one dimension (got a scalar)")
    if not -data.dim() <= axis < data.dim():
        raise ValueError(f"{where}: axis out of range for a {data.dim()}-d tensor")
    axis = axis % data.dim()
    moved = tuple(data.movedim(axis, -1).shape)
    want = moved[:-1] + (cdiv(moved[-1], block),)
    if scale.dim() != data.dim() or tuple(scale.movedim(axis, -1).shape) != want:
        raise ValueError(f"{where}: scale shape {tuple(scale.shape)} does not match data {tuple(data.shape)} "
                         f"with block={block} along axis {axis}")
    if scale.device != data.device:
        raise ValueError(f"{where}: scale is on {scale.device} but data is on {data.device}")
    codes = _to_rows(data.view(torch.uint8), axis)
    s2d = _to_rows(scale, axis).reshape(codes.shape[0], want[-1])
    impl = resolve_kernel(kernel, data, scale)
    if impl == "triton":
        from gem.ops.triton_mx import mx_dequantize_triton

        out = mx_dequantize_triton(codes, s2d, block, fmt, dtype)
    else:
        out = mx_dequantize_reference(codes, s2d, block, fmt, dtype)
    return _from_rows(out, moved, axis)


def blocked_scales(scale: torch.Tensor) -> torch.Tensor:
    """Scales [rows, cols] (E8M0, uint8 bits or float8_e8m0fnu) in the tiled layout of block-scaled GEMMs (cuBLAS's
    block scaling factors layout, what torch._scaled_mm takes for MX operands on sm_100+), flat.

    rows are padded to a multiple of 128 and cols to a multiple of 4 (bits 0, the smallest scale; the padded rows
    and blocks hold no data); each 128 x 4 tile is stored as 32 x 16 with scale (r, c) at (r % 32, 4 * (r // 32)
    + c), and the tiles follow each other row-major (tile (i, j) at (i * ceil(cols / 4) + j) * 512)."""
    if scale.dim() != 2:
        raise ValueError(f"gem.ops.mx.blocked_scales: scale must be 2-d [rows, blocks] (got {tuple(scale.shape)})")
    bits = _scale_bits(scale, "gem.ops.mx.blocked_scales")
    rows, cols = bits.shape
    rt, ct = cdiv(rows, 128), cdiv(cols, 4)
    padded = F.pad(bits, (0, ct * 4 - cols, 0, rt * 128 - rows))
    # [rt, 4 (r // 32), 32 (r % 32), ct, 4 (c)] -> [rt, ct, r % 32, r // 32, c]
    tiles = padded.reshape(rt, 4, 32, ct, 4).permute(0, 3, 2, 1, 4)
    return scale_as_e8m0(tiles.reshape(-1))
