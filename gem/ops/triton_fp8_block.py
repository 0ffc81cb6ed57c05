"""Triton kernels for gem.ops.fp8_block: block-scaled E4M3 quantize / dequantize.

Each program owns a [BLOCK_M, 128] tile (BLOCK_M rows of one 128-column block): one contiguous read of the input,
the block amaxes as tile reductions, one write of the codes (and, for the transposed layout, of the tile
transposed, so a second layout costs a write but no read). The fp8 cast is the hardware's (round-to-nearest-even,
saturating) on the GPU; the interpreter has no exact fp8 cast, so there the rounding runs on the bits
(gem.ops.triton_mx.fp8_round), giving the same bytes.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from gem.ops._common import cdiv, triton_interpreting
from gem.ops.triton_mx import IN_KIND_OF, bits_view, fp8_round, load_fp32_bits, mx_decode, store_fp32_bits

BLOCK = 128


@triton.jit
def _pow2_scale(amax_bits):
    """|amax| fp32 bits (int32) -> (scale, 1 / scale, non-finite): see gem.ops.fp8_block."""
    ex = amax_bits >> 23
    k = tl.maximum(ex - 135 + ((amax_bits & 0x7FFFFF) > 0x600000).to(tl.int32), -126)
    nonfinite = ex >= 255
    scale = tl.where(nonfinite, 0x7FC00000, (k + 127) << 23).to(tl.float32, bitcast=True)
    return scale, ((127 - k) << 23).to(tl.float32, bitcast=True), nonfinite


@triton.jit
def _encode(x, inv, nonfinite, EXACT: tl.constexpr):
    """fp32 x times a power of two -> E4M3 codes (int32), 0x7F where the block is not finite."""
    r = tl.minimum(tl.maximum(x * inv, -448.0), 448.0)
    if EXACT:
        bits = r.to(tl.int32, bitcast=True)
        code = fp8_round((bits & 0x7FFFFFFF).to(tl.float32, bitcast=True), 3, 7) | ((bits >> 24) & 0x80)
    else:
        code = r.to(tl.float8e4nv).to(tl.uint8, bitcast=True).to(tl.int32)
    return tl.where(nonfinite, 0x7F, code)


@triton.jit
def _quant_kernel(x_ptr, q_ptr, s_ptr, qt_ptr, st_ptr, M, K, MP, NKB,
                  IN_KIND: tl.constexpr, ROWS: tl.constexpr, TRANS: tl.constexpr, WEIGHT: tl.constexpr,
                  EXACT: tl.constexpr, BLOCK_M: tl.constexpr):
    """ROWS: 1 x 128 codes q [M, K], scales s [M, NKB]. TRANS (BLOCK_M == 128): blocks along M, written transposed:
    qt [K, MP], st [MP / 128, K]. WEIGHT (BLOCK_M == 128): one scale per tile s [cdiv(M, 128), NKB], codes q and
    q^T (qt [K, M])."""
    pid_m = tl.program_id(0)
    pid_k = tl.program_id(1)
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rk = pid_k * 128 + tl.arange(0, 128)
    mrow = rm < M
    mcol = rk < K
    mask = mrow[:, None] & mcol[None, :]
    bits = load_fp32_bits(x_ptr, rm.to(tl.int64)[:, None] * K + rk[None, :], mask, IN_KIND)
    x = bits.to(tl.float32, bitcast=True)
    mag = bits & 0x7FFFFFFF  # integer max: NaN bits order above inf's, inf's above every finite value
    if ROWS:
        s, inv, nf = _pow2_scale(tl.max(mag, axis=1))
        code = _encode(x, inv[:, None], nf[:, None], EXACT)
        tl.store(q_ptr + rm.to(tl.int64)[:, None] * K + rk[None, :], code.to(tl.uint8), mask=mask)
        tl.store(s_ptr + rm.to(tl.int64) * NKB + pid_k, s, mask=mrow)
    if TRANS:
        s, inv, nf = _pow2_scale(tl.max(mag, axis=0))
        code = tl.trans(_encode(x, inv[None, :], nf[None, :], EXACT).to(tl.uint8))  # [128 (k), BLOCK_M (m)]
        tmask = mcol[:, None] & (rm < MP)[None, :]
        tl.store(qt_ptr + rk.to(tl.int64)[:, None] * MP + rm[None, :], code, mask=tmask)
        tl.store(st_ptr + pid_m.to(tl.int64) * K + rk, s, mask=mcol)
    if WEIGHT:
        s, inv, nf = _pow2_scale(tl.max(tl.max(mag, axis=1), axis=0))
        code = _encode(x, inv, nf, EXACT).to(tl.uint8)
        tl.store(q_ptr + rm.to(tl.int64)[:, None] * K + rk[None, :], code, mask=mask)
        tl.store(qt_ptr + rk.to(tl.int64)[:, None] * M + rm[None, :], tl.trans(code),
                 mask=mcol[:, None] & mrow[None, :])
        tl.store(s_ptr + pid_m * NKB + pid_k, s)


@triton.jit
def _dequant_kernel(q_ptr, s_ptr, out_ptr, M, K, NKB, OUT_KIND: tl.constexpr, WEIGHT: tl.constexpr,
                    EXACT: tl.constexpr, BLOCK_M: tl.constexpr):
    pid_m = tl.program_id(0)
    pid_k = tl.program_id(1)
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rk = pid_k * 128 + tl.arange(0, 128)
    mask = (rm < M)[:, None] & (rk < K)[None, :]
    offs = rm.to(tl.int64)[:, None] * K + rk[None, :]
    c = tl.load(q_ptr + offs, mask=mask, other=0)
    if EXACT:
        v = mx_decode(c.to(tl.int32), 127, 3, 7, False).to(tl.float32, bitcast=True)
    else:
        v = c.to(tl.float8e4nv, bitcast=True).to(tl.float32)
    if WEIGHT:
        s = tl.load(s_ptr + (pid_m * BLOCK_M // 128) * NKB + pid_k)
        v = v * s
    else:
        v = v * tl.load(s_ptr + rm.to(tl.int64) * NKB + pid_k, mask=rm < M, other=1.0)[:, None]
    store_fp32_bits(out_ptr, offs, v.to(tl.int32, bitcast=True), mask, OUT_KIND)


ROWS_BLOCK_M = 32  # rows per program for the 1 x 128 layout alone
ROWS_WARPS = 4
TRANS_WARPS = 8


def quantize_1x128_triton(x2d: torch.Tensor, transposed: bool = False):
    """x2d [M, K] contiguous, non-empty -> (codes uint8 [M, K], scale fp32 [M, cdiv(K, 128)]) and, if transposed,
    (codes_t uint8 [K, Mp], scale_t fp32 [Mp / 128, K])."""
    m, k = x2d.shape
    dev = x2d.device
    nkb = cdiv(k, BLOCK)
    q = torch.empty((m, k), dtype=torch.uint8, device=dev)
    s = torch.empty((m, nkb), dtype=torch.float32, device=dev)
    exact = triton_interpreting()
    if not transposed:
        _quant_kernel[(cdiv(m, ROWS_BLOCK_M), nkb)](
            bits_view(x2d), q, s, q, s, m, k, m, nkb, IN_KIND=IN_KIND_OF[x2d.dtype], ROWS=True, TRANS=False,
            WEIGHT=False, EXACT=exact, BLOCK_M=ROWS_BLOCK_M, num_warps=ROWS_WARPS)
        return q, s
    mp = cdiv(m, BLOCK) * BLOCK
    qt = torch.empty((k, mp), dtype=torch.uint8, device=dev)
    st = torch.empty((mp // BLOCK, k), dtype=torch.float32, device=dev)
    _quant_kernel[(mp // BLOCK, nkb)](
        bits_view(x2d), q, s, qt, st, m, k, mp, nkb, IN_KIND=IN_KIND_OF[x2d.dtype], ROWS=True, TRANS=True,
        WEIGHT=False, EXACT=exact, BLOCK_M=BLOCK, num_warps=TRANS_WARPS)
    return q, s, qt, st


def quantize_128x128_triton(w: torch.Tensor):
    """w [N, K] contiguous, non-empty -> (codes uint8 [N, K], codes of w^T uint8 [K, N], scale fp32
    [cdiv(N, 128), cdiv(K, 128)])."""
    n, k = w.shape
    nkb = cdiv(k, BLOCK)
    q = torch.empty((n, k), dtype=torch.uint8, device=w.device)
    qt = torch.empty((k, n), dtype=torch.uint8, device=w.device)
    s = torch.empty((cdiv(n, BLOCK), nkb), dtype=torch.float32, device=w.device)
    _quant_kernel[(cdiv(n, BLOCK), nkb)](
        bits_view(w), q, s, qt, s, n, k, n, nkb, IN_KIND=IN_KIND_OF[w.dtype], ROWS=False, TRANS=False,
        WEIGHT=True, EXACT=triton_interpreting(), BLOCK_M=BLOCK, num_warps=TRANS_WARPS)
    return q, qt, s


def dequantize_triton(codes: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype, weight: bool) -> torch.Tensor:
    m, k = codes.shape
    out = torch.empty((m, k), dtype=dtype, device=codes.device)
    bm = BLOCK if weight else ROWS_BLOCK_M
    _dequant_kernel[(cdiv(m, bm), cdiv(k, BLOCK))](
        codes, scale, bits_view(out), m, k, cdiv(k, BLOCK), OUT_KIND=IN_KIND_OF[dtype], WEIGHT=weight,
        EXACT=triton_interpreting(), BLOCK_M=bm, num_warps=ROWS_WARPS if not weight else TRANS_WARPS)
    return out
