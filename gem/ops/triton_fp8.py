"""Triton kernels for FP8 quantization fused into the producers of GEMM inputs (see gem.ops.fp8).

One row-wise kernel serves three producers (OP): a plain copy (quantize_rows), RMSNorm and SwiGLU. A program
takes one row as an [NB, BLOCK] tile (BLOCK consecutive elements per tile row, the MX block), computes the
producer's output in fp32, rounds it to the output dtype, stores it, and quantizes that rounded value: row-wise
(one fp32 scale a row, computed as torch computes it, divisions correctly rounded) or MX (gem.ops.triton_mx's
encoder). The quantized bytes and scales are therefore those of quantizing the stored output, bit for bit.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from gem.ops._common import cdiv, next_pow2
from gem.ops.fp8 import MIN_AMAX
from gem.ops.triton_mx import (
    IN_KIND_OF,
    bits_view,
    fp8_round,
    load_fp32_bits,
    mx_decode,
    mx_encode,
    round_bits,
    store_fp32_bits,
)
from gem.ops.triton_utils import num_sms

OP_COPY, OP_RMS_NORM, OP_SWIGLU = 0, 1, 2
SCALING_ROW, SCALING_MX = 0, 1
SCALINGS = {"row": SCALING_ROW, "mx": SCALING_MX}
MAX_WIDTH = 32768  # one row lives in registers; wider rows go through the reference
MIN_AMAX_FP32 = float(torch.tensor(MIN_AMAX, dtype=torch.float32))  # the fp32 value the reference clamps to


@triton.jit
def row_encode(bits, MBITS: tl.constexpr, EBIAS: tl.constexpr, MAXVAL: tl.constexpr, MIN_AMAX: tl.constexpr):
    """fp32 bit patterns of one row (any tile shape, padding 0) -> (element codes int32, fp32 scale):
    s = max(amax, MIN_AMAX) / MAXVAL and code = fp8(clamp(x / s, -MAXVAL, MAXVAL)), both divisions correctly
    rounded as torch's are. NaN anywhere makes s NaN and every code NaN; an inf amax gives s = inf, codes 0
    (NaN where x is inf)."""
    mag = bits & 0x7FFFFFFF
    amax = tl.max(tl.max(mag, axis=1), axis=0).to(tl.float32, bitcast=True)  # NaN bits order above inf
    amax = tl.where(amax < MIN_AMAX, MIN_AMAX, amax)
    s = tl.div_rn(amax, MAXVAL)
    r = tl.div_rn(mag.to(tl.float32, bitcast=True), s)  # |x / s| = |x| / s
    code = fp8_round(tl.where(r > MAXVAL, MAXVAL, r), MBITS, EBIAS)
    code = tl.where((r.to(tl.int32, bitcast=True) & 0x7FFFFFFF) > 0x7F800000, 0x7F, code) | ((bits >> 24) & 0x80)
    return code, s


@triton.jit
def _row_quant_kernel(a_ptr, b_ptr, w_ptr, y_ptr, data_ptr, scale_ptr, rstd_ptr, n, nb, eps,
                      OP: tl.constexpr, IN_KIND: tl.constexpr, W_KIND: tl.constexpr, SCALING: tl.constexpr,
                      Y_DEQUANT: tl.constexpr, MBITS: tl.constexpr, EBIAS: tl.constexpr, EMAX: tl.constexpr,
                      MAXVAL: tl.constexpr, MIN_AMAX: tl.constexpr, E5M2: tl.constexpr, BLOCK: tl.constexpr,
                      NB: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    blk = tl.arange(0, NB)
    col = blk[:, None] * BLOCK + tl.arange(0, BLOCK)[None, :]
    valid = col < n
    offs = row * n + col
    a = load_fp32_bits(a_ptr, offs, valid, IN_KIND).to(tl.float32, bitcast=True)
    if OP == 0:
        v = a
    elif OP == 1:  # RMSNorm: padding is 0 in x and w, so in v
        w = load_fp32_bits(w_ptr, col, valid, W_KIND).to(tl.float32, bitcast=True)
        rstd = tl.div_rn(1.0, tl.sqrt_rn(tl.div_rn(tl.sum(tl.sum(a * a, axis=1), axis=0), tl.cast(n, tl.float32)) + eps))
        tl.store(rstd_ptr + row, rstd)
        v = a * rstd * w
    else:  # SwiGLU: silu(a) * b
        b = load_fp32_bits(b_ptr, offs, valid, IN_KIND).to(tl.float32, bitcast=True)
        v = a / (1.0 + tl.exp(-a)) * b
    vbits = v.to(tl.int32, bitcast=True)
    if Y_DEQUANT:  # MX codes of the fp32 value; y is their dequantized value (straight-through rms_norm_mx)
        code, sbits = mx_encode(vbits, MBITS, EBIAS, EMAX, MAXVAL)
        tl.store(scale_ptr + row * nb + blk, sbits.to(tl.uint8), mask=blk < nb)
        store_fp32_bits(y_ptr, offs, mx_decode(code, sbits[:, None], MBITS, EBIAS, E5M2), valid, IN_KIND)
    else:
        qbits = round_bits(vbits, IN_KIND)  # the output as stored in its dtype: what gets quantized
        if OP != 0:
            store_fp32_bits(y_ptr, offs, qbits, valid, IN_KIND)
        if SCALING == 0:
            code, s = row_encode(qbits, MBITS, EBIAS, MAXVAL, MIN_AMAX)
            tl.store(scale_ptr + row, s)
        else:
            code, sbits = mx_encode(qbits, MBITS, EBIAS, EMAX, MAXVAL)
            tl.store(scale_ptr + row * nb + blk, sbits.to(tl.uint8), mask=blk < nb)
    tl.store(data_ptr + offs, code.to(tl.uint8), mask=valid)


@triton.jit
def _rms_norm_bwd_kernel(x_ptr, w_ptr, g_ptr, rstd_ptr, dx_ptr, dw_ptr, rows, n, rows_per_prog,
                         IN_KIND: tl.constexpr, W_KIND: tl.constexpr, BLOCK_N: tl.constexpr):
    """dx of rows [pid * rows_per_prog, ...) and this program's partial dw (fp32, one row of dw_ptr)."""
    pid = tl.program_id(0)
    col = tl.arange(0, BLOCK_N)
    cvalid = col < n
    w = load_fp32_bits(w_ptr, col, cvalid, W_KIND).to(tl.float32, bitcast=True)
    acc = tl.zeros([BLOCK_N], dtype=tl.float32)
    for i in range(rows_per_prog):
        row = pid.to(tl.int64) * rows_per_prog + i
        ok = row < rows
        valid = cvalid & ok
        offs = row * n + col
        x = load_fp32_bits(x_ptr, offs, valid, IN_KIND).to(tl.float32, bitcast=True)
        g = load_fp32_bits(g_ptr, offs, valid, IN_KIND).to(tl.float32, bitcast=True)
        rstd = tl.load(rstd_ptr + row, mask=ok, other=0.0)
        gw = g * w
        c = tl.sum(gw * x, axis=0) / n
        dx = rstd * gw - x * (rstd * rstd * rstd) * c
        store_fp32_bits(dx_ptr, offs, dx.to(tl.int32, bitcast=True), valid, IN_KIND)
        acc += g * x * rstd
    tl.store(dw_ptr + pid.to(tl.int64) * n + col, acc, mask=cvalid)


@triton.jit
def _swiglu_bwd_kernel(a_ptr, b_ptr, g_ptr, da_ptr, db_ptr, total, IN_KIND: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    valid = offs < total
    a = load_fp32_bits(a_ptr, offs, valid, IN_KIND).to(tl.float32, bitcast=True)
    b = load_fp32_bits(b_ptr, offs, valid, IN_KIND).to(tl.float32, bitcast=True)
    g = load_fp32_bits(g_ptr, offs, valid, IN_KIND).to(tl.float32, bitcast=True)
    sig = 1.0 / (1.0 + tl.exp(-a))
    da = g * b * sig * (1.0 + a * (1.0 - sig))
    db = g * (a * sig)
    store_fp32_bits(da_ptr, offs, da.to(tl.int32, bitcast=True), valid, IN_KIND)
    store_fp32_bits(db_ptr, offs, db.to(tl.int32, bitcast=True), valid, IN_KIND)


def _warps(width: int) -> int:
    return min(16, max(4, width // 512))


def row_quant_triton(op: int, a: torch.Tensor, *, b=None, weight=None, eps: float = 0.0, scaling: str = "row",
                     fmt=None, block: int = 32, y_dequant: bool = False):
    """a (and b) [rows, n] contiguous fp32 / bf16 / fp16 -> (y [rows, n] in a's dtype or None for OP_COPY,
    codes uint8 [rows, n], scales (fp32 [rows, 1] row-wise, uint8 E8M0 [rows, ceil(n / block)] MX),
    rstd fp32 [rows] for OP_RMS_NORM else None)."""
    rows, n = a.shape
    dev = a.device
    sc = SCALINGS[scaling]
    if sc == SCALING_ROW:
        block = 32  # only the tile shape
    nb = cdiv(n, block)
    codes = torch.empty((rows, n), dtype=torch.uint8, device=dev)
    scale = (torch.empty((rows, 1), dtype=torch.float32, device=dev) if sc == SCALING_ROW
             else torch.empty((rows, nb), dtype=torch.uint8, device=dev))
    y = None if op == OP_COPY else torch.empty_like(a)
    rstd = torch.empty(rows, dtype=torch.float32, device=dev) if op == OP_RMS_NORM else None
    if rows == 0:
        return y, codes, scale, rstd
    NB = next_pow2(nb)
    av = bits_view(a)
    _row_quant_kernel[(rows,)](
        av, bits_view(b) if b is not None else av, bits_view(weight) if weight is not None else av,
        bits_view(y) if y is not None else av, codes, scale, rstd if rstd is not None else scale, n, nb, float(eps),
        OP=op, IN_KIND=IN_KIND_OF[a.dtype], W_KIND=IN_KIND_OF[weight.dtype] if weight is not None else 0,
        SCALING=sc, Y_DEQUANT=y_dequant, MBITS=fmt.mbits, EBIAS=fmt.ebias, EMAX=fmt.emax, MAXVAL=fmt.max,
        MIN_AMAX=MIN_AMAX_FP32, E5M2=fmt.name == "e5m2", BLOCK=block, NB=NB, num_warps=_warps(NB * block))
    return y, codes, scale, rstd


def rms_norm_bwd_triton(x2d: torch.Tensor, weight: torch.Tensor, g2d: torch.Tensor, rstd: torch.Tensor):
    """RMSNorm backward from the saved x, weight and rstd: (dx in x's dtype, dw fp32 [n])."""
    rows, n = x2d.shape
    dx = torch.empty_like(x2d)
    if rows == 0:
        return dx, torch.zeros(n, dtype=torch.float32, device=x2d.device)
    progs = min(rows, 4 * num_sms(x2d.device))
    per = cdiv(rows, progs)
    progs = cdiv(rows, per)
    partial = torch.empty((progs, n), dtype=torch.float32, device=x2d.device)
    width = next_pow2(n)
    _rms_norm_bwd_kernel[(progs,)](
        bits_view(x2d), bits_view(weight), bits_view(g2d), rstd, bits_view(dx), partial, rows, n, per,
        IN_KIND=IN_KIND_OF[x2d.dtype], W_KIND=IN_KIND_OF[weight.dtype], BLOCK_N=width, num_warps=_warps(width))
    return dx, partial.sum(0)


def swiglu_bwd_triton(a: torch.Tensor, b: torch.Tensor, g: torch.Tensor):
    """(da, db) in a's dtype from a, b and the gradient of h (all contiguous, same shape and dtype)."""
    da, db = torch.empty_like(a), torch.empty_like(b)
    total = a.numel()
    if total:
        blk = 1024
        _swiglu_bwd_kernel[(cdiv(total, blk),)](bits_view(a), bits_view(b), bits_view(g), bits_view(da),
                                               bits_view(db), total, IN_KIND=IN_KIND_OF[a.dtype], BLOCK=blk)
    return da, db
