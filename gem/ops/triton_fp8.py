"""Triton kernels for FP8 quantization fused into the producers of GEMM inputs (see gem.ops.fp8).

One row-wise kernel serves four producers (OP): a plain copy (quantize_rows), RMSNorm, LayerNorm and SwiGLU. A program
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

OP_COPY, OP_RMS_NORM, OP_SWIGLU, OP_LAYER_NORM = 0, 1, 2, 3
SCALING_ROW, SCALING_MX = 0, 1
SCALINGS = {"row": SCALING_ROW, "mx": SCALING_MX}
MAX_WIDTH = 32768  # one row lives in registers; wider rows go through the reference
MIN_AMAX = 1e-12  # the smallest row amax a scale is taken from (gem.ops.fp8's reference clamps to it too)
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
def _row_quant_kernel(a_ptr, b_ptr, w_ptr, bias_ptr, y_ptr, data_ptr, scale_ptr, mean_ptr, rstd_ptr, n, nb, eps,
                      OP: tl.constexpr, IN_KIND: tl.constexpr, W_KIND: tl.constexpr, HAS_BIAS: tl.constexpr,
                      SCALING: tl.constexpr,
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
    elif OP == 2:  # SwiGLU: silu(a) * b
        b = load_fp32_bits(b_ptr, offs, valid, IN_KIND).to(tl.float32, bitcast=True)
        v = a / (1.0 + tl.exp(-a)) * b
    else:  # RMSNorm (OP 1) or LayerNorm (OP 3); padding is 0 in the centred x, w and bias, so in v
        nf = tl.cast(n, tl.float32)
        if OP == 3:
            mean = tl.div_rn(tl.sum(tl.sum(a, axis=1), axis=0), nf)
            tl.store(mean_ptr + row, mean)
            a = tl.where(valid, a - mean, 0.0)
        rstd = tl.div_rn(1.0, tl.sqrt_rn(tl.div_rn(tl.sum(tl.sum(a * a, axis=1), axis=0), nf) + eps))
        tl.store(rstd_ptr + row, rstd)
        w = load_fp32_bits(w_ptr, col, valid, W_KIND).to(tl.float32, bitcast=True)
        v = a * rstd * w
        if HAS_BIAS:
            v += load_fp32_bits(bias_ptr, col, valid, W_KIND).to(tl.float32, bitcast=True)
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
def _norm_bwd_kernel(x_ptr, w_ptr, g_ptr, mean_ptr, rstd_ptr, dx_ptr, dw_ptr, db_ptr, rows, n, rows_per_prog,
                     IN_KIND: tl.constexpr, W_KIND: tl.constexpr, LAYER: tl.constexpr, HAS_BIAS: tl.constexpr,
                     BLOCK_N: tl.constexpr):
    """RMSNorm (LayerNorm: LAYER) backward of rows [pid * rows_per_prog, ...): dx, and this program's partial
    dw (and db) in fp32, one row of dw_ptr (db_ptr). xhat = (x - mean) * rstd, mean 0 for RMSNorm."""
    pid = tl.program_id(0)
    col = tl.arange(0, BLOCK_N)
    cvalid = col < n
    w = load_fp32_bits(w_ptr, col, cvalid, W_KIND).to(tl.float32, bitcast=True)
    acc_w = tl.zeros([BLOCK_N], dtype=tl.float32)
    acc_b = tl.zeros([BLOCK_N], dtype=tl.float32)
    for i in range(rows_per_prog):
        row = pid.to(tl.int64) * rows_per_prog + i
        ok = row < rows
        valid = cvalid & ok
        offs = row * n + col
        x = load_fp32_bits(x_ptr, offs, valid, IN_KIND).to(tl.float32, bitcast=True)
        g = load_fp32_bits(g_ptr, offs, valid, IN_KIND).to(tl.float32, bitcast=True)
        rstd = tl.load(rstd_ptr + row, mask=ok, other=0.0)
        if LAYER:
            x = tl.where(valid, x - tl.load(mean_ptr + row, mask=ok, other=0.0), 0.0)
        xhat = x * rstd
        gw = g * w
        dx = gw - xhat * (tl.sum(gw * xhat, axis=0) / n)
        if LAYER:
            dx -= tl.sum(gw, axis=0) / n
        store_fp32_bits(dx_ptr, offs, (rstd * dx).to(tl.int32, bitcast=True), valid, IN_KIND)
        acc_w += g * xhat
        if HAS_BIAS:
            acc_b += g
    tl.store(dw_ptr + pid.to(tl.int64) * n + col, acc_w, mask=cvalid)
    if HAS_BIAS:
        tl.store(db_ptr + pid.to(tl.int64) * n + col, acc_b, mask=cvalid)


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


def row_quant_triton(op: int, a: torch.Tensor, *, b=None, weight=None, bias=None, eps: float = 0.0,
                     scaling: str = "row", fmt=None, block: int = 32, y_dequant: bool = False):
    """a (and b) [rows, n] contiguous fp32 / bf16 / fp16 -> (y [rows, n] in a's dtype or None for OP_COPY,
    codes uint8 [rows, n], scales (fp32 [rows, 1] row-wise, uint8 E8M0 [rows, ceil(n / block)] MX),
    (mean, rstd) fp32 [rows] for the norms (mean None for RMSNorm), else None)."""
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
    norm = op in (OP_RMS_NORM, OP_LAYER_NORM)
    rstd = torch.empty(rows, dtype=torch.float32, device=dev) if norm else None
    mean = torch.empty(rows, dtype=torch.float32, device=dev) if op == OP_LAYER_NORM else None
    stats = (mean, rstd) if norm else None
    if rows == 0:
        return y, codes, scale, stats
    NB = next_pow2(nb)
    av = bits_view(a)
    _row_quant_kernel[(rows,)](
        av, *(av if t is None else bits_view(t) for t in (b, weight, bias, y)), codes, scale,
        scale if mean is None else mean, scale if rstd is None else rstd, n, nb, float(eps),
        OP=op, IN_KIND=IN_KIND_OF[a.dtype], W_KIND=IN_KIND_OF[weight.dtype] if weight is not None else 0,
        HAS_BIAS=bias is not None, SCALING=sc, Y_DEQUANT=y_dequant, MBITS=fmt.mbits, EBIAS=fmt.ebias, EMAX=fmt.emax, MAXVAL=fmt.max,
        MIN_AMAX=MIN_AMAX_FP32, E5M2=fmt.name == "e5m2", BLOCK=block, NB=NB, num_warps=_warps(NB * block))
    return y, codes, scale, stats


def norm_bwd_triton(x2d: torch.Tensor, weight: torch.Tensor, g2d: torch.Tensor, mean, rstd: torch.Tensor,
                    has_bias: bool):
    """RMSNorm (mean None) or LayerNorm backward from the saved x, weight and stats: (dx in x's dtype, dw fp32 [n],
    db fp32 [n] or None)."""
    rows, n = x2d.shape
    dx = torch.empty_like(x2d)
    if rows == 0:
        zero = torch.zeros(n, dtype=torch.float32, device=x2d.device)
        return dx, zero, zero.clone() if has_bias else None
    progs = min(rows, 4 * num_sms(x2d.device))
    per = cdiv(rows, progs)
    progs = cdiv(rows, per)
    dw = torch.empty((progs, n), dtype=torch.float32, device=x2d.device)
    db = torch.empty_like(dw) if has_bias else dw
    width = next_pow2(n)
    _norm_bwd_kernel[(progs,)](
        bits_view(x2d), bits_view(weight), bits_view(g2d), rstd if mean is None else mean, rstd, bits_view(dx), dw,
        db, rows, n, per, IN_KIND=IN_KIND_OF[x2d.dtype], W_KIND=IN_KIND_OF[weight.dtype], LAYER=mean is not None,
        HAS_BIAS=has_bias, BLOCK_N=width, num_warps=_warps(width))
    return dx, dw.sum(0), db.sum(0) if has_bias else None


def swiglu_bwd_triton(a: torch.Tensor, b: torch.Tensor, g: torch.Tensor):
    """(da, db) in a's dtype from a, b and the gradient of h (all contiguous, same shape and dtype)."""
    da, db = torch.empty_like(a), torch.empty_like(b)
    total = a.numel()
    if total:
        blk = 1024
        _swiglu_bwd_kernel[(cdiv(total, blk),)](bits_view(a), bits_view(b), bits_view(g), bits_view(da),
                                               bits_view(db), total, IN_KIND=IN_KIND_OF[a.dtype], BLOCK=blk)
    return da, db
