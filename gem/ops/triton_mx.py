"""Triton kernels for MXFP8 quantize / dequantize (OCP Microscaling v1.0), see gem.ops.mx for the format.

All rounding is done on integer bit patterns, never by float casts: the result is then the same under the CPU
interpreter and on any GPU, whatever the hardware's flush-to-zero or fp8 conversion modes are. Float arithmetic is
used only where it is exact and its operands and results that matter are fp32 normals.

Layout: a [rows, n] row-major tensor split into blocks of BLOCK consecutive elements of a row (the last block of a
row may be partial: its missing elements count as zeros). One program handles G blocks, numbered row-major.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from gem.ops._common import cdiv

IN_FP32, IN_BF16, IN_FP16 = 0, 1, 2
IN_KIND_OF = {torch.float32: IN_FP32, torch.bfloat16: IN_BF16, torch.float16: IN_FP16}


@triton.jit
def _block_coords(pid, total_blocks, nb, n, BLOCK: tl.constexpr, G: tl.constexpr):
    b = pid.to(tl.int64) * G + tl.arange(0, G)
    row = b // nb
    col = (b % nb)[:, None] * BLOCK + tl.arange(0, BLOCK)[None, :]
    bvalid = b < total_blocks
    valid = bvalid[:, None] & (col < n)
    return b, bvalid, row[:, None] * n + col, valid


@triton.jit
def mx_encode(bits, MBITS: tl.constexpr, EBIAS: tl.constexpr, EMAX: tl.constexpr, MAXVAL: tl.constexpr):
    """fp32 bit patterns [G, BLOCK] (one MX block a row) -> (element codes [G, BLOCK], E8M0 bits [G]), int32."""
    mag = bits & 0x7FFFFFFF
    # Magnitude bit patterns order like the magnitudes, and NaN / inf (exponent 255) above every finite value.
    e_amax = tl.max(mag, axis=1) >> 23
    nan_block = e_amax == 255
    # E8M0 bits = floor(log2(amax)) - emax + 127, clamped to [0, 254]; amax 0 or subnormal gives 0.
    sbits = tl.minimum(tl.maximum(e_amax - EMAX, 0), 254)
    sbits = tl.where(nan_block, 255, sbits)

    # r = |x| / 2^(sbits - 127) as (integer significand) * (normal power of two): exact whenever r is an fp32
    # normal; when it is not, r < 2^-126 rounds to element 0 anyway.
    e = mag >> 23
    sig = tl.where(e > 0, (mag & 0x7FFFFF) | 0x800000, mag)
    k = tl.maximum(e, 1) - 150 - (sbits[:, None] - 127)
    k = tl.minimum(tl.maximum(k, -100), 126)
    r = sig.to(tl.float32) * ((k + 127) << 23).to(tl.float32, bitcast=True)
    code = fp8_round(tl.minimum(r, MAXVAL), MBITS, EBIAS)  # saturated
    code = code | ((bits >> 24) & 0x80)
    code = tl.where(nan_block[:, None], 0x7F, code)  # 0x7F is NaN in both E4M3 and E5M2
    return code, sbits


@triton.jit
def fp8_round(r, MBITS: tl.constexpr, EBIAS: tl.constexpr):
    """Finite fp32 r in [0, element max] -> the element code of r rounded to nearest even (int32, sign bit 0).
    fp32 subnormals r (< 2^-126) give 0, as they round to 0 in either element type."""
    rb = r.to(tl.int32, bitcast=True)
    er = rb >> 23
    # Element normal range: drop the low 23 - MBITS mantissa bits, round to nearest even; rebias the exponent.
    SH: tl.constexpr = 23 - MBITS
    code_n = ((rb + ((1 << (SH - 1)) - 1) + ((rb >> SH) & 1)) >> SH) - ((127 - EBIAS) << MBITS)
    # Element subnormal range: r in units of 2^(1 - EBIAS - MBITS), round to nearest even.
    sr = (rb & 0x7FFFFF) | 0x800000
    s = tl.minimum(tl.maximum((151 - EBIAS - MBITS) - er, 1), 30)  # only used where >= 21
    q = sr >> s
    rem = sr & ((1 << s) - 1)
    half = 1 << (s - 1)
    q = q + ((rem > half) | ((rem == half) & ((q & 1) == 1))).to(tl.int32)
    return tl.where(er >= 128 - EBIAS, code_n, q)


@triton.jit
def mx_decode(c, sb, MBITS: tl.constexpr, EBIAS: tl.constexpr, E5M2: tl.constexpr):
    """Element codes [G, BLOCK] and E8M0 bits [G, 1] (int32) -> fp32 bit patterns of code * 2^(sb - 127)."""
    mag = c & 0x7F
    ef = mag >> MBITS
    mf = mag & ((1 << MBITS) - 1)
    # value = sig * 2^t with an integer significand; the fp32 bit pattern is built directly (subnormals included).
    sig = tl.where(ef == 0, mf, mf + (1 << MBITS))
    t = tl.maximum(ef, 1) - EBIAS - MBITS + sb - 127
    sig_bits = sig.to(tl.float32).to(tl.int32, bitcast=True)
    e_res = (sig_bits >> 23) + t
    vbits = tl.where(e_res >= 1, sig_bits + (t << 23), sig << tl.minimum(tl.maximum(t + 149, 0), 31))
    vbits = tl.where(e_res >= 255, 0x7F800000, vbits)
    vbits = tl.where(sig == 0, 0, vbits)
    if E5M2:
        is_inf = mag == 0x7C
        elem_nan = mag > 0x7C
        vbits = tl.where(is_inf, 0x7F800000, vbits)
    else:
        elem_nan = mag == 0x7F
    vbits = tl.where(elem_nan | (sb == 255), 0x7FC00000, vbits)
    return vbits | ((c & 0x80) << 24)


@triton.jit
def store_fp32_bits(ptr, offs, vbits, mask, OUT_KIND: tl.constexpr):
    """Stores fp32 bit patterns as fp32 (ptr: int32 view), bf16 (ptr: int16 view) or fp16."""
    if OUT_KIND == 0:
        tl.store(ptr + offs, vbits, mask=mask)
    elif OUT_KIND == 1:
        tl.store(ptr + offs, (round_bits(vbits, 1) >> 16).to(tl.int16), mask=mask)
    else:
        tl.store(ptr + offs, vbits.to(tl.float32, bitcast=True).to(tl.float16), mask=mask)


@triton.jit
def round_bits(vbits, KIND: tl.constexpr):
    """fp32 bit patterns -> those of the value rounded to nearest even in fp32 (unchanged), bf16 or fp16."""
    if KIND == 0:
        return vbits
    elif KIND == 1:  # on the bits; a NaN (any payload, CUDA's is 0x7FFFFFFF) stays a quiet NaN, not a carry
        nan = (vbits & 0x7FFFFFFF) > 0x7F800000
        return tl.where(nan, vbits | 0x400000, vbits + 0x7FFF + ((vbits >> 16) & 1)) & -65536
    else:
        return vbits.to(tl.float32, bitcast=True).to(tl.float16).to(tl.float32).to(tl.int32, bitcast=True)


@triton.jit
def load_fp32_bits(ptr, offs, mask, IN_KIND: tl.constexpr):
    """fp32 bit patterns of an fp32 (ptr: int32 view), bf16 (ptr: int16 view) or fp16 input; masked -> 0."""
    if IN_KIND == 0:
        bits = tl.load(ptr + offs, mask=mask, other=0)
    elif IN_KIND == 1:  # the fp32 bits are the bf16 bits shifted up
        bits = tl.load(ptr + offs, mask=mask, other=0).to(tl.int32) << 16
    else:  # fp16 -> fp32 is exact and gives fp32 normals (fp16 subnormals included)
        bits = tl.load(ptr + offs, mask=mask, other=0.0).to(tl.float32).to(tl.int32, bitcast=True)
    return bits


@triton.jit
def _mx_quantize_kernel(x_ptr, data_ptr, scale_ptr, total_blocks, nb, n,
                        IN_KIND: tl.constexpr, MBITS: tl.constexpr, EBIAS: tl.constexpr, EMAX: tl.constexpr,
                        MAXVAL: tl.constexpr, BLOCK: tl.constexpr, G: tl.constexpr):
    b, bvalid, offs, valid = _block_coords(tl.program_id(0), total_blocks, nb, n, BLOCK, G)
    bits = load_fp32_bits(x_ptr, offs, valid, IN_KIND)
    code, sbits = mx_encode(bits, MBITS, EBIAS, EMAX, MAXVAL)
    tl.store(data_ptr + offs, code.to(tl.uint8), mask=valid)
    tl.store(scale_ptr + b, sbits.to(tl.uint8), mask=bvalid)


@triton.jit
def _mx_dequantize_kernel(data_ptr, scale_ptr, out_ptr, total_blocks, nb, n,
                          OUT_KIND: tl.constexpr, MBITS: tl.constexpr, EBIAS: tl.constexpr, E5M2: tl.constexpr,
                          BLOCK: tl.constexpr, G: tl.constexpr):
    b, bvalid, offs, valid = _block_coords(tl.program_id(0), total_blocks, nb, n, BLOCK, G)
    c = tl.load(data_ptr + offs, mask=valid, other=0).to(tl.int32)
    sb = tl.load(scale_ptr + b, mask=bvalid, other=127).to(tl.int32)[:, None]
    store_fp32_bits(out_ptr, offs, mx_decode(c, sb, MBITS, EBIAS, E5M2), valid, OUT_KIND)


def bits_view(t: torch.Tensor) -> torch.Tensor:
    """What load_fp32_bits / store_fp32_bits take: fp32 as int32, bf16 as int16, fp16 as is."""
    return t.view(torch.int32) if t.dtype == torch.float32 else t.view(torch.int16) if t.dtype == torch.bfloat16 else t


def _group(block: int) -> int:
    return max(1, 2048 // block)


def mx_quantize_triton(x2d: torch.Tensor, block: int, fmt) -> tuple[torch.Tensor, torch.Tensor]:
    """x2d [rows, n] contiguous fp32/bf16/fp16 -> (uint8 element codes [rows, n], uint8 E8M0 [rows, nb])."""
    rows, n = x2d.shape
    nb = cdiv(n, block)
    data = torch.empty((rows, n), dtype=torch.uint8, device=x2d.device)
    scale = torch.empty((rows, nb), dtype=torch.uint8, device=x2d.device)
    total = rows * nb
    if total == 0:
        return data, scale
    kind = IN_KIND_OF[x2d.dtype]
    xin = bits_view(x2d)
    g = _group(block)
    _mx_quantize_kernel[(cdiv(total, g),)](
        xin, data, scale, total, nb, n,
        IN_KIND=kind, MBITS=fmt.mbits, EBIAS=fmt.ebias, EMAX=fmt.emax, MAXVAL=fmt.max,
        BLOCK=block, G=g)
    return data, scale


def mx_dequantize_triton(codes: torch.Tensor, scale: torch.Tensor, block: int, fmt, dtype) -> torch.Tensor:
    """uint8 codes [rows, n] and uint8 E8M0 [rows, nb] (both contiguous) -> [rows, n] of dtype."""
    rows, n = codes.shape
    nb = scale.shape[1]
    out = torch.empty((rows, n), dtype=dtype, device=codes.device)
    total = rows * nb
    if total == 0 or n == 0:
        return out
    g = _group(block)
    _mx_dequantize_kernel[(cdiv(total, g),)](
        codes, scale, bits_view(out), total, nb, n,
        OUT_KIND=IN_KIND_OF[dtype], MBITS=fmt.mbits, EBIAS=fmt.ebias, E5M2=fmt.name == "e5m2", BLOCK=block, G=g)
    return out
