"""Triton kernels for gem.ops.fp8_block: block-scaled E4M3 quantize / dequantize, and the producers that write
their output straight into 1 x 128 blocks (RMSNorm / LayerNorm, SwiGLU).

Each program owns a [BLOCK_M, 128] tile (BLOCK_M rows of one 128-column block): one contiguous read of the input,
the block amaxes as tile reductions, one write of the codes (and, for the transposed layout, of the tile
transposed, so a second layout costs a write but no read). The fp8 cast is the hardware's (round-to-nearest-even,
saturating) on the GPU; the interpreter has no exact fp8 cast, so there the rounding runs on the bits
(gem.ops.triton_mx.fp8_round), giving the same bytes. The producers compute their output in fp32, round it to
the input's dtype (the value the unfused op stores) and encode that tile with the same code as the quantizer
(_emit_1x128), so their bytes are those of quantizing their own rounded output.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from gem.ops._common import cdiv, next_pow2, triton_interpreting
from gem.ops.triton_mx import (
    IN_KIND_OF,
    bits_view,
    fp8_round,
    load_fp32_bits,
    mx_decode,
    round_bits,
    store_fp32_bits,
)
from gem.ops.triton_utils import num_sms

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
def _emit_1x128(bits, rm, rk, mrow, mcol, pid_m, pid_k, q_ptr, s_ptr, qt_ptr, st_ptr, K, MP, NKB,
                TRANS: tl.constexpr, EXACT: tl.constexpr):
    """A [BLOCK_M, 128] tile of fp32 bit patterns (rows rm, columns rk of one 128-column block, 0 outside the
    tensor) -> its 1 x 128 codes q [M, K] and scales s [M, NKB]; TRANS (BLOCK_M == 128): also its blocks along M,
    written transposed: qt [K, MP], st [MP / 128, K]."""
    x = bits.to(tl.float32, bitcast=True)
    mag = bits & 0x7FFFFFFF  # integer max: NaN bits order above inf's, inf's above every finite value
    s, inv, nf = _pow2_scale(tl.max(mag, axis=1))
    code = _encode(x, inv[:, None], nf[:, None], EXACT)
    tl.store(q_ptr + rm.to(tl.int64)[:, None] * K + rk[None, :], code.to(tl.uint8),
             mask=mrow[:, None] & mcol[None, :])
    tl.store(s_ptr + rm.to(tl.int64) * NKB + pid_k, s, mask=mrow)
    if TRANS:
        s, inv, nf = _pow2_scale(tl.max(mag, axis=0))
        code = tl.trans(_encode(x, inv[None, :], nf[None, :], EXACT).to(tl.uint8))  # [128 (k), BLOCK_M (m)]
        tl.store(qt_ptr + rk.to(tl.int64)[:, None] * MP + rm[None, :], code, mask=mcol[:, None] & (rm < MP)[None, :])
        tl.store(st_ptr + pid_m.to(tl.int64) * K + rk, s, mask=mcol)


@triton.jit
def _tile(M, K, BLOCK_M: tl.constexpr):
    """This program's [BLOCK_M, 128] tile of an [M, K] row-major tensor: (pid_m, pid_k, rows, columns, their
    in-range masks, the tile's mask, its int64 element offsets)."""
    pid_m = tl.program_id(0)
    pid_k = tl.program_id(1)
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rk = pid_k * 128 + tl.arange(0, 128)
    mrow = rm < M
    mcol = rk < K
    mask = mrow[:, None] & mcol[None, :]
    return pid_m, pid_k, rm, rk, mrow, mcol, mask, rm.to(tl.int64)[:, None] * K + rk[None, :]


@triton.jit
def _quant_kernel(x_ptr, q_ptr, s_ptr, qt_ptr, st_ptr, M, K, MP, NKB,
                  IN_KIND: tl.constexpr, TRANS: tl.constexpr, WEIGHT: tl.constexpr, EXACT: tl.constexpr,
                  BLOCK_M: tl.constexpr):
    """1 x 128 blocks (_emit_1x128, TRANS: both layouts) or, WEIGHT (BLOCK_M == 128), one scale per 128 x 128 tile
    s [cdiv(M, 128), NKB] with codes q and (TRANS) q^T (qt [K, M])."""
    pid_m, pid_k, rm, rk, mrow, mcol, mask, offs = _tile(M, K, BLOCK_M)
    bits = load_fp32_bits(x_ptr, offs, mask, IN_KIND)
    if WEIGHT:
        s, inv, nf = _pow2_scale(tl.max(tl.max(bits & 0x7FFFFFFF, axis=1), axis=0))
        code = _encode(bits.to(tl.float32, bitcast=True), inv, nf, EXACT).to(tl.uint8)
        tl.store(q_ptr + offs, code, mask=mask)
        if TRANS:
            tl.store(qt_ptr + rk.to(tl.int64)[:, None] * M + rm[None, :], tl.trans(code),
                     mask=mcol[:, None] & mrow[None, :])
        tl.store(s_ptr + pid_m * NKB + pid_k, s)
    else:
        _emit_1x128(bits, rm, rk, mrow, mcol, pid_m, pid_k, q_ptr, s_ptr, qt_ptr, st_ptr, K, MP, NKB, TRANS, EXACT)


@triton.jit
def _norm_quant_kernel(x_ptr, w_ptr, b_ptr, y_ptr, q_ptr, s_ptr, qt_ptr, st_ptr, mean_ptr, rstd_ptr, M, K, MP, NKB,
                       eps, IN_KIND: tl.constexpr, W_KIND: tl.constexpr, LAYER: tl.constexpr,
                       HAS_BIAS: tl.constexpr, WRITE_Y: tl.constexpr, TRANS: tl.constexpr, EXACT: tl.constexpr,
                       BLOCK_M: tl.constexpr):
    """RMSNorm (LayerNorm: LAYER) of BLOCK_M whole rows, quantized as it is written. The row statistics take one
    pass over the rows (LayerNorm: two, mean then centred squares); the last pass rereads each [BLOCK_M, 128] tile
    (from L2), normalizes it, rounds it to x's dtype (the value the unfused norm stores) and hands it to
    _emit_1x128. WRITE_Y also stores that value as y."""
    pid_m = tl.program_id(0)
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    mrow = rm < M
    rows = rm.to(tl.int64)[:, None] * K
    kf = tl.cast(K, tl.float32)
    mean = tl.zeros([BLOCK_M], dtype=tl.float32)
    if LAYER:
        acc = tl.zeros([BLOCK_M], dtype=tl.float32)
        for kb in range(NKB):
            rk = kb * 128 + tl.arange(0, 128)
            mask = mrow[:, None] & (rk < K)[None, :]
            acc += tl.sum(load_fp32_bits(x_ptr, rows + rk[None, :], mask, IN_KIND).to(tl.float32, bitcast=True), 1)
        mean = tl.div_rn(acc, kf)
        tl.store(mean_ptr + rm, mean, mask=mrow)
    acc = tl.zeros([BLOCK_M], dtype=tl.float32)
    for kb in range(NKB):
        rk = kb * 128 + tl.arange(0, 128)
        mask = mrow[:, None] & (rk < K)[None, :]
        x = load_fp32_bits(x_ptr, rows + rk[None, :], mask, IN_KIND).to(tl.float32, bitcast=True)
        xc = tl.where(mask, x - mean[:, None], 0.0)
        acc += tl.sum(xc * xc, 1)
    rstd = tl.div_rn(1.0, tl.sqrt_rn(tl.div_rn(acc, kf) + eps))
    tl.store(rstd_ptr + rm, rstd, mask=mrow)
    for kb in range(NKB):
        rk = kb * 128 + tl.arange(0, 128)
        mcol = rk < K
        mask = mrow[:, None] & mcol[None, :]
        x = load_fp32_bits(x_ptr, rows + rk[None, :], mask, IN_KIND).to(tl.float32, bitcast=True)
        w = load_fp32_bits(w_ptr, rk, mcol, W_KIND).to(tl.float32, bitcast=True)
        v = (x - mean[:, None]) * rstd[:, None] * w[None, :]
        if HAS_BIAS:
            v += load_fp32_bits(b_ptr, rk, mcol, W_KIND).to(tl.float32, bitcast=True)[None, :]
        vbits = round_bits(tl.where(mask, v, 0.0).to(tl.int32, bitcast=True), IN_KIND)
        if WRITE_Y:
            store_fp32_bits(y_ptr, rows + rk[None, :], vbits, mask, IN_KIND)
        _emit_1x128(vbits, rm, rk, mrow, mcol, pid_m, kb, q_ptr, s_ptr, qt_ptr, st_ptr, K, MP, NKB, TRANS, EXACT)


@triton.jit
def _swiglu_quant_kernel(a_ptr, b_ptr, y_ptr, q_ptr, s_ptr, qt_ptr, st_ptr, M, K, MP, NKB, IN_KIND: tl.constexpr,
                         WRITE_Y: tl.constexpr, TRANS: tl.constexpr, EXACT: tl.constexpr, BLOCK_M: tl.constexpr):
    """h = silu(a) * b of one [BLOCK_M, 128] tile in fp32, rounded to a's dtype once (the value the unfused
    SwiGLU stores), quantized by _emit_1x128. WRITE_Y also stores h."""
    pid_m, pid_k, rm, rk, mrow, mcol, mask, offs = _tile(M, K, BLOCK_M)
    a = load_fp32_bits(a_ptr, offs, mask, IN_KIND).to(tl.float32, bitcast=True)
    b = load_fp32_bits(b_ptr, offs, mask, IN_KIND).to(tl.float32, bitcast=True)
    vbits = round_bits((a / (1.0 + tl.exp(-a)) * b).to(tl.int32, bitcast=True), IN_KIND)
    if WRITE_Y:
        store_fp32_bits(y_ptr, offs, vbits, mask, IN_KIND)
    _emit_1x128(vbits, rm, rk, mrow, mcol, pid_m, pid_k, q_ptr, s_ptr, qt_ptr, st_ptr, K, MP, NKB, TRANS, EXACT)


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
def _swiglu_grads(a_ptr, b_ptr, g_ptr, offs, mask, IN_KIND: tl.constexpr):
    """(da, db) fp32 of h = silu(a) * b for the output gradient g, at offsets offs."""
    a = load_fp32_bits(a_ptr, offs, mask, IN_KIND).to(tl.float32, bitcast=True)
    b = load_fp32_bits(b_ptr, offs, mask, IN_KIND).to(tl.float32, bitcast=True)
    g = load_fp32_bits(g_ptr, offs, mask, IN_KIND).to(tl.float32, bitcast=True)
    sig = 1.0 / (1.0 + tl.exp(-a))
    return g * b * sig * (1.0 + a * (1.0 - sig)), g * (a * sig)


@triton.jit
def _swiglu_bwd_kernel(a_ptr, b_ptr, g_ptr, da_ptr, db_ptr, total, IN_KIND: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    valid = offs < total
    da, db = _swiglu_grads(a_ptr, b_ptr, g_ptr, offs, valid, IN_KIND)
    store_fp32_bits(da_ptr, offs, da.to(tl.int32, bitcast=True), valid, IN_KIND)
    store_fp32_bits(db_ptr, offs, db.to(tl.int32, bitcast=True), valid, IN_KIND)


@triton.jit
def _swiglu_bwd_quant_kernel(a_ptr, b_ptr, g_ptr, qa_ptr, sa_ptr, qat_ptr, sat_ptr, qb_ptr, sb_ptr, qbt_ptr, sbt_ptr,
                             M, K, MP, NKB, IN_KIND: tl.constexpr, TRANS: tl.constexpr, EXACT: tl.constexpr,
                             BLOCK_M: tl.constexpr):
    """SwiGLU's backward of one [BLOCK_M, 128] tile (_swiglu_bwd_kernel's arithmetic), da and db rounded to bf16
    (the dtype a BlockFP8Linear receives its output gradient in) and written only as their 1 x 128 blocks."""
    pid_m, pid_k, rm, rk, mrow, mcol, mask, offs = _tile(M, K, BLOCK_M)
    da, db = _swiglu_grads(a_ptr, b_ptr, g_ptr, offs, mask, IN_KIND)
    _emit_1x128(round_bits(da.to(tl.int32, bitcast=True), 1), rm, rk, mrow, mcol, pid_m, pid_k, qa_ptr, sa_ptr,
                qat_ptr, sat_ptr, K, MP, NKB, TRANS, EXACT)
    _emit_1x128(round_bits(db.to(tl.int32, bitcast=True), 1), rm, rk, mrow, mcol, pid_m, pid_k, qb_ptr, sb_ptr,
                qbt_ptr, sbt_ptr, K, MP, NKB, TRANS, EXACT)


@triton.jit
def _dequant_kernel(q_ptr, s_ptr, out_ptr, M, K, NKB, OUT_KIND: tl.constexpr, WEIGHT: tl.constexpr,
                    EXACT: tl.constexpr, BLOCK_M: tl.constexpr):
    pid_m, pid_k, rm, _, mrow, _, mask, offs = _tile(M, K, BLOCK_M)
    c = tl.load(q_ptr + offs, mask=mask, other=0)
    if EXACT:
        v = mx_decode(c.to(tl.int32), 127, 3, 7, False).to(tl.float32, bitcast=True)
    else:
        v = c.to(tl.float8e4nv, bitcast=True).to(tl.float32)
    if WEIGHT:
        s = tl.load(s_ptr + (pid_m * BLOCK_M // 128) * NKB + pid_k)
        v = v * s
    else:
        v = v * tl.load(s_ptr + rm.to(tl.int64) * NKB + pid_k, mask=mrow, other=1.0)[:, None]
    store_fp32_bits(out_ptr, offs, v.to(tl.int32, bitcast=True), mask, OUT_KIND)


ROWS_BLOCK_M = 32  # rows per program for the 1 x 128 layout alone
ROWS_WARPS = 4
TRANS_WARPS = 8
NORM_WARPS = 8


def _outputs(m: int, k: int, transposed: bool, dev: torch.device):
    """(q, s, qt, st, mp) for a [m, k] tensor; without transposed, qt / st are q / s (never written)."""
    nkb = cdiv(k, BLOCK)
    q = torch.empty((m, k), dtype=torch.uint8, device=dev)
    s = torch.empty((m, nkb), dtype=torch.float32, device=dev)
    if not transposed:
        return q, s, q, s, m
    mp = cdiv(m, BLOCK) * BLOCK
    qt = torch.empty((k, mp), dtype=torch.uint8, device=dev)
    st = torch.empty((mp // BLOCK, k), dtype=torch.float32, device=dev)
    return q, s, qt, st, mp


def _result(q, s, qt, st, transposed):
    return (q, s, qt, st) if transposed else (q, s)


def quantize_1x128_triton(x2d: torch.Tensor, transposed: bool = False):
    """x2d [M, K] contiguous, non-empty -> (codes uint8 [M, K], scale fp32 [M, cdiv(K, 128)]) and, if transposed,
    (codes_t uint8 [K, Mp], scale_t fp32 [Mp / 128, K])."""
    m, k = x2d.shape
    q, s, qt, st, mp = _outputs(m, k, transposed, x2d.device)
    bm = BLOCK if transposed else ROWS_BLOCK_M
    _quant_kernel[(cdiv(mp, bm), cdiv(k, BLOCK))](
        bits_view(x2d), q, s, qt, st, m, k, mp, cdiv(k, BLOCK), IN_KIND=IN_KIND_OF[x2d.dtype], TRANS=transposed,
        WEIGHT=False, EXACT=triton_interpreting(), BLOCK_M=bm, num_warps=TRANS_WARPS if transposed else ROWS_WARPS)
    return _result(q, s, qt, st, transposed)


def quantize_128x128_triton(w: torch.Tensor, transposed: bool = True):
    """w [N, K] contiguous, non-empty -> (codes uint8 [N, K], codes of w^T uint8 [K, N] (None unless transposed),
    scale fp32 [cdiv(N, 128), cdiv(K, 128)])."""
    n, k = w.shape
    nkb = cdiv(k, BLOCK)
    q = torch.empty((n, k), dtype=torch.uint8, device=w.device)
    qt = torch.empty((k, n) if transposed else (0,), dtype=torch.uint8, device=w.device)
    s = torch.empty((cdiv(n, BLOCK), nkb), dtype=torch.float32, device=w.device)
    _quant_kernel[(cdiv(n, BLOCK), nkb)](
        bits_view(w), q, s, qt, s, n, k, n, nkb, IN_KIND=IN_KIND_OF[w.dtype], TRANS=transposed, WEIGHT=True,
        EXACT=triton_interpreting(), BLOCK_M=BLOCK, num_warps=TRANS_WARPS)
    return q, qt if transposed else None, s


def swiglu_bwd_quant_triton(a2d: torch.Tensor, b2d: torch.Tensor, g2d: torch.Tensor, transposed: bool):
    """SwiGLU's backward from a, b and the gradient of h (all [M, K] contiguous, non-empty, one dtype), da and db
    written only in 1 x 128 blocks -> ((q, s, qt, st) of da, (q, s, qt, st) of db; qt / st None without
    transposed)."""
    m, k = a2d.shape
    qa, sa, qat, sat, mp = _outputs(m, k, transposed, a2d.device)
    qb, sb, qbt, sbt, _ = _outputs(m, k, transposed, a2d.device)
    bm = BLOCK if transposed else ROWS_BLOCK_M
    _swiglu_bwd_quant_kernel[(cdiv(mp, bm), cdiv(k, BLOCK))](
        bits_view(a2d), bits_view(b2d), bits_view(g2d), qa, sa, qat, sat, qb, sb, qbt, sbt, m, k, mp, cdiv(k, BLOCK),
        IN_KIND=IN_KIND_OF[a2d.dtype], TRANS=transposed, EXACT=triton_interpreting(), BLOCK_M=bm,
        num_warps=TRANS_WARPS if transposed else ROWS_WARPS)
    none = (None, None)
    return (qa, sa, *((qat, sat) if transposed else none)), (qb, sb, *((qbt, sbt) if transposed else none))


def norm_quant_triton(x2d: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, eps: float, layer: bool,
                      transposed: bool, write_y: bool):
    """RMSNorm / LayerNorm of x2d [M, K] (contiguous, non-empty; weight / bias [K] contiguous) emitting its output
    in 1 x 128 blocks -> (y or None, q, s, qt, st (None without transposed), mean (None for RMSNorm), rstd)."""
    m, k = x2d.shape
    dev = x2d.device
    q, s, qt, st, mp = _outputs(m, k, transposed, dev)
    y = torch.empty_like(x2d) if write_y else None
    rstd = torch.empty(m, dtype=torch.float32, device=dev)
    mean = torch.empty(m, dtype=torch.float32, device=dev) if layer else None
    xv = bits_view(x2d)
    _norm_quant_kernel[(cdiv(mp, BLOCK),)](
        xv, bits_view(weight), bits_view(weight if bias is None else bias), xv if y is None else bits_view(y),
        q, s, qt, st, rstd if mean is None else mean, rstd, m, k, mp, cdiv(k, BLOCK), float(eps),
        IN_KIND=IN_KIND_OF[x2d.dtype], W_KIND=IN_KIND_OF[weight.dtype], LAYER=layer, HAS_BIAS=bias is not None,
        WRITE_Y=write_y, TRANS=transposed, EXACT=triton_interpreting(), BLOCK_M=BLOCK, num_warps=NORM_WARPS)
    return (y, q, s, *((qt, st) if transposed else (None, None)), mean, rstd)


def swiglu_quant_triton(a2d: torch.Tensor, b2d: torch.Tensor, transposed: bool, write_y: bool):
    """h = silu(a) * b of a2d, b2d [M, K] (contiguous, non-empty, same dtype) emitting h in 1 x 128 blocks ->
    (h or None, q, s, qt, st (None without transposed))."""
    m, k = a2d.shape
    q, s, qt, st, mp = _outputs(m, k, transposed, a2d.device)
    y = torch.empty_like(a2d) if write_y else None
    bm = BLOCK if transposed else ROWS_BLOCK_M
    av = bits_view(a2d)
    _swiglu_quant_kernel[(cdiv(mp, bm), cdiv(k, BLOCK))](
        av, bits_view(b2d), av if y is None else bits_view(y), q, s, qt, st, m, k, mp, cdiv(k, BLOCK),
        IN_KIND=IN_KIND_OF[a2d.dtype], WRITE_Y=write_y, TRANS=transposed, EXACT=triton_interpreting(), BLOCK_M=bm,
        num_warps=TRANS_WARPS if transposed else ROWS_WARPS)
    return (y, q, s, *((qt, st) if transposed else (None, None)))


def dequantize_triton(codes: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype, weight: bool) -> torch.Tensor:
    m, k = codes.shape
    out = torch.empty((m, k), dtype=dtype, device=codes.device)
    bm = BLOCK if weight else ROWS_BLOCK_M
    _dequant_kernel[(cdiv(m, bm), cdiv(k, BLOCK))](
        codes, scale, bits_view(out), m, k, cdiv(k, BLOCK), OUT_KIND=IN_KIND_OF[dtype], WEIGHT=weight,
        EXACT=triton_interpreting(), BLOCK_M=bm, num_warps=ROWS_WARPS if not weight else TRANS_WARPS)
    return out


def _warps(width: int) -> int:
    return min(16, max(4, width // 512))


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
