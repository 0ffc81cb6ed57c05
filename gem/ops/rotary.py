"""Rotary position embeddings (RoPE) on jagged [T, H, D] tensors: reference, fused Triton kernel, dispatcher.

Positions restart at 0 at each sequence start (position = token index within its sequence).
Layout: NeoX style by default -- the first `rotary_dim` channels are split in two halves (x1, x2) and pair
i rotates (x1[i], x2[i]); `interleaved=True` pairs adjacent channels (x[2i], x[2i+1]) as in GPT-J.
Channels past `rotary_dim` pass through unchanged. Frequencies: theta_i = base ** (-2i / rotary_dim).
The rotation is orthogonal, so the backward of rope is the inverse rotation (sin -> -sin).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from gem.ops._common import (
    as_batch,
    batch_scope,
    cached,
    capturing,
    cdiv,
    check_offsets,
    next_pow2,
    resolve_kernel,
    triton_interpreting,
)
from gem.ops._register import KernelOp
from gem.ops._tune import ConfigTuner, LaunchConfig


@dataclass(frozen=True)
class RopeConfig:
    base: float = 10000.0
    rotary_dim: int | None = None  # None: all of D
    interleaved: bool = False  # False: NeoX halves; True: GPT-J adjacent pairs

    def resolve_dim(self, head_dim: int) -> int:
        """Validated number of rotated channels for heads of size head_dim."""
        rd = head_dim if self.rotary_dim is None else int(self.rotary_dim)
        if rd <= 0 or rd % 2 or rd > head_dim:
            raise ValueError(f"rope rotary_dim={rd}: must be even, > 0 and <= head dim {head_dim}")
        if not self.base > 1.0:
            raise ValueError(f"rope base={self.base}: must be > 1")
        return rd


def positions_of(offsets: torch.Tensor, total: int) -> torch.Tensor:
    """Index of each of `total` tokens within its sequence ([total] int64), computed on device."""
    idx = torch.arange(total, device=offsets.device)
    seq = torch.searchsorted(offsets[1:].to(torch.long), idx, right=True)
    seq = seq.clamp_max(offsets.numel() - 2) if offsets.numel() > 1 else seq
    return idx - offsets.to(torch.long)[seq]


def positions_cached(offsets: torch.Tensor, total: int) -> torch.Tensor:
    """positions_of as int32 for the kernels, kept in the eager call's JaggedBatch per row count
    (gem.ops._common.cached): building it is ~7 small launches, far more than the rope kernel's own memory time at
    64K tokens."""
    return cached("rope_pos", offsets, offsets, (int(total),), lambda: positions_of(offsets, total).to(torch.int32))


_TABLES: dict = {}


def cos_sin_table(length: int, rotary_dim: int, base: float, device) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 cos/sin tables [>= length, rotary_dim // 2]; angles computed in fp64 so long positions stay exact.

    Cached per (device, rotary_dim, base) and grown to the next power of two, so steady training reuses one table.
    """
    key = (str(device), rotary_dim, float(base))
    hit = _TABLES.get(key)
    if hit is not None and hit[0].shape[0] >= length:
        return hit
    n = max(16, next_pow2(max(1, length)))
    inv_freq = float(base) ** (-torch.arange(0, rotary_dim, 2, dtype=torch.float64, device=device) / rotary_dim)
    ang = torch.arange(n, dtype=torch.float64, device=device)[:, None] * inv_freq[None, :]
    table = (ang.cos().float().contiguous(), ang.sin().float().contiguous())
    _TABLES[key] = table
    return table


def _check(x: torch.Tensor, batch, max_len: int) -> None:
    offsets = batch.offsets
    if x.dim() != 3:
        raise ValueError(f"rope expects x of shape [T, H, D], got {tuple(x.shape)}")
    if offsets.dim() != 1 or offsets.numel() < 1 or offsets.dtype not in (torch.int32, torch.int64):
        raise ValueError("offsets must be a 1-D int32/int64 tensor [B+1] starting at 0")
    if max_len < 0:
        raise ValueError(f"max_len={max_len} must be >= 0")
    if x.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        raise ValueError(f"rope supports fp16/bf16/fp32, got {x.dtype}")
    check_offsets("offsets", batch, x.shape[0], max_len, x.device)


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleaved: bool = False, *,
           inverse: bool = False) -> torch.Tensor:
    """x [T, H, D] rotated by per-token angle rows cos/sin [T, rotary_dim // 2] (fp32), in fp32; returns x's dtype.

    Plain differentiable torch ops without data-dependent control flow, so torch.compile traces it whole."""
    rd = 2 * cos.shape[-1]
    c = cos[:, None, :]
    s = -sin[:, None, :] if inverse else sin[:, None, :]
    xf = x.float()
    rot, rest = xf[..., :rd], xf[..., rd:]
    if interleaved:
        x1, x2 = rot[..., 0::2], rot[..., 1::2]
    else:
        x1, x2 = rot[..., : rd // 2], rot[..., rd // 2:]
    y1 = x1 * c - x2 * s
    y2 = x2 * c + x1 * s
    if interleaved:
        y = torch.stack((y1, y2), dim=-1).flatten(-2)
    else:
        y = torch.cat((y1, y2), dim=-1)
    return torch.cat((y, rest), dim=-1).to(x.dtype)


def qkv_rope(qkv: torch.Tensor, heads: int, kv_heads: int, head_dim: int, pos: torch.Tensor, cos: torch.Tensor,
             sin: torch.Tensor, interleaved: bool = False, kernel: str = "auto"
             ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A fused projection's output qkv [T, (heads + 2 kv_heads) head_dim] -> q [T, heads, D] and k rotated by the
    table rows cos[pos] / sin[pos] (rope_tables), v [T, kv_heads, D] (contiguous: its gradient then arrives in
    v's own layout, where a strided view of qkv made autograd copy it once more, and qkv is freed after the forward).

    The forward is plain torch ops (torch.compile fuses the rotation into the split); the backward writes the
    gradient of qkv in one buffer: dq and dk rotated back straight into their columns by the Triton kernel, dv
    copied into its own. Autograd's version of that (slice gradients summed, then a concat) takes two passes that
    run at a fraction of memory speed under torch.compile. kernel: the backward's, as gem.ops.rope takes it."""
    return _QkvRope.apply(qkv, heads, kv_heads, head_dim, pos, cos, sin, interleaved, kernel)


class _QkvRope(torch.autograd.Function):
    @staticmethod
    def forward(ctx, qkv, heads, kv_heads, head_dim, pos, cos, sin, interleaved, kernel):
        t = qkv.shape[0]
        q, k, v = qkv.split([heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], dim=-1)
        c, s = cos[pos], sin[pos]
        ctx.save_for_backward(pos, cos, sin)
        ctx.interleaved, ctx.kernel = interleaved, kernel
        return (rotate(q.reshape(t, heads, head_dim), c, s, interleaved),
                rotate(k.reshape(t, kv_heads, head_dim), c, s, interleaved),
                v.reshape(t, kv_heads, head_dim).contiguous())

    @staticmethod
    def backward(ctx, dq, dk, dv):
        pos, cos, sin = ctx.saved_tensors
        return (qkv_rope_grad(dq, dk, dv, pos, cos, sin, ctx.interleaved, ctx.kernel),
                None, None, None, None, None, None, None, None)


@torch.library.custom_op("gem::qkv_rope_grad", mutates_args=())
def qkv_rope_grad(dq: torch.Tensor, dk: torch.Tensor, dv: torch.Tensor, pos: torch.Tensor, cos: torch.Tensor,
                  sin: torch.Tensor, interleaved: bool, kernel: str = "auto") -> torch.Tensor:
    """The gradient of qkv_rope's input, [T, (H + 2 H_kv) D], from the gradients of q, k (rotated back) and v."""
    t, h, d = dq.shape
    hk = dk.shape[1]
    out = dq.new_empty((t, (h + 2 * hk) * d))
    if t == 0:
        return out
    gq = out[:, : h * d].view(t, h, d)  # token stride (H + 2 H_kv) D: the kernels write the columns in place
    gk = out[:, h * d: (h + hk) * d].view(t, hk, d)
    out[:, (h + hk) * d:].view(t, hk, d).copy_(dv)
    rd = 2 * cos.shape[-1]
    if resolve_kernel(kernel, dq) == "reference":
        gq.copy_(rotate(dq, cos[pos], sin[pos], interleaved, inverse=True))
        gk.copy_(rotate(dk, cos[pos], sin[pos], interleaved, inverse=True))
        return out
    for g, y in ((dq.contiguous(), gq), (dk.contiguous(), gk)):
        def launch(cfg, g=g, y=y):  # writes y from g only: idempotent, as the tuner's timing needs
            _rope_launch(cfg, g, y, pos, cos, sin, rd, interleaved, inverse=True)

        key = (g.shape[1], d, rd, g.dtype, interleaved)  # the rope op's key: same kernels, same speed
        launch(_TUNER.pick("rope", key, lambda: rope_configs(rd, interleaved), launch, g.device, outputs=(y,)))
    return out


@qkv_rope_grad.register_fake
def _(dq, dk, dv, pos, cos, sin, interleaved, kernel="auto"):
    return dq.new_empty((dq.shape[0], (dq.shape[1] + 2 * dk.shape[1]) * dq.shape[2]))


def rope_reference(x: torch.Tensor, offsets: torch.Tensor, max_len: int, config: RopeConfig, *,
                   inverse: bool = False) -> torch.Tensor:
    """Plain PyTorch RoPE in fp32 (differentiable); returns x's dtype."""
    rd = config.resolve_dim(x.shape[-1])
    pos = positions_of(offsets, x.shape[0])
    cos, sin = cos_sin_table(max(max_len, 1), rd, config.base, x.device)
    return rotate(x, cos[pos], sin[pos], config.interleaved, inverse=inverse)


def rope_tables(offsets, total: int, max_len: int | None, rotary_dim: int, base: float
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(positions [total] int32, cos table, sin table) for `rotate` of a jagged batch in a caller's own graph:
    cos[positions] are the rows. offsets: a tensor or a JaggedBatch (whose positions are then built once for
    every layer); the tables are built once per length class."""
    batch = as_batch(offsets, max_len)
    check_offsets("offsets", batch, total, batch.max_len)  # the rows gathered by position must exist in the tables
    eager = not (torch.compiler.is_compiling() or capturing(batch.offsets))
    with batch_scope((batch, batch) if eager else None):
        pos = positions_cached(batch.offsets, total)
    cos, sin = cos_sin_table(max(batch.max_len, 1), rotary_dim, base, batch.offsets.device)
    return pos, cos, sin


# ----------------------------------------------------------------------------------------------------------------
# Triton: a program rotates a tile of token rows, for every head (cos/sin fetched once per token) or for one head
# (layouts and launch configs below, picked per shape by the tuner, GEM_AUTOTUNE=0: the first); positions come
# from a [T] int32 vector built on device (once per JaggedBatch in eager calls: positions_cached).


@triton.jit
def _half_cols(half, HALF_B: tl.constexpr, INTERLEAVED: tl.constexpr):
    """Columns of the two rotary halves: (2i, 2i+1) interleaved, else (i, i + half)."""
    i = tl.arange(0, HALF_B)
    if INTERLEAVED:
        return 2 * i, 2 * i + 1
    return i, i + half


@triton.jit
def rope_load_halves(base_ptr, row_off, rows_ok, half, HALF_B: tl.constexpr, INTERLEAVED: tl.constexpr):
    """Load the two rotary halves of a [rows, D] tile unrotated, in the tensor's dtype.

    row_off: [R] element offsets of the rows; the two outputs are [R, HALF_B] (columns >= half are zero).
    """
    c1, c2 = _half_cols(half, HALF_B, INTERLEAVED)
    m2 = rows_ok[:, None] & (tl.arange(0, HALF_B) < half)[None, :]
    x1 = tl.load(base_ptr + row_off[:, None] + c1[None, :], mask=m2, other=0.0)
    x2 = tl.load(base_ptr + row_off[:, None] + c2[None, :], mask=m2, other=0.0)
    return x1, x2


@triton.jit
def rope_load_rotated(base_ptr, row_off, rows_ok, pos, cos_ptr, sin_ptr, half, HALF_B: tl.constexpr,
                      INTERLEAVED: tl.constexpr, SIGN: tl.constexpr):
    """rope_load_halves, rotated by the angles of `pos` (fp32 out). SIGN = 1 rotates forward, -1 inversely."""
    x1, x2 = rope_load_halves(base_ptr, row_off, rows_ok, half, HALF_B, INTERLEAVED)
    return rope_rotate_regs(x1.to(tl.float32), x2.to(tl.float32), pos, rows_ok, cos_ptr, sin_ptr, half, HALF_B,
                            SIGN)


@triton.jit
def rope_rotate_regs(y1, y2, pos, rows_ok, cos_ptr, sin_ptr, half, HALF_B: tl.constexpr, SIGN: tl.constexpr):
    """Rotate two fp32 [R, HALF_B] register tiles (e.g. gradient accumulators) by the angles of `pos`."""
    i = tl.arange(0, HALF_B)
    m2 = rows_ok[:, None] & (i < half)[None, :]
    t = pos[:, None] * half + i[None, :]
    c = tl.load(cos_ptr + t, mask=m2, other=1.0)
    s = tl.load(sin_ptr + t, mask=m2, other=0.0) * SIGN
    return y1 * c - y2 * s, y2 * c + y1 * s


@triton.jit
def rope_store_halves(base_ptr, row_off, rows_ok, y1, y2, half, HALF_B: tl.constexpr, INTERLEAVED: tl.constexpr):
    c1, c2 = _half_cols(half, HALF_B, INTERLEAVED)
    m2 = rows_ok[:, None] & (tl.arange(0, HALF_B) < half)[None, :]
    ty = base_ptr.dtype.element_ty
    tl.store(base_ptr + row_off[:, None] + c1[None, :], y1.to(ty), mask=m2)
    tl.store(base_ptr + row_off[:, None] + c2[None, :], y2.to(ty), mask=m2)


@triton.jit
def _rope_kernel(x_ptr, y_ptr, pos_ptr, cos_ptr, sin_ptr, T, H: tl.constexpr, D: tl.constexpr, half, rd, x_row, y_row,
                 BLOCK_T: tl.constexpr, HALF_B: tl.constexpr, PASS_B: tl.constexpr, HAS_PASS: tl.constexpr,
                 INTERLEAVED: tl.constexpr, SIGN: tl.constexpr, HEADS: tl.constexpr):
    """Layout "halves": BLOCK_T rows x HEADS heads (from head program_id(1) * HEADS); each head's two rotary halves
    are loaded as [BLOCK_T, HALF_B] tiles, the pass-through channels as a third. x_row / y_row: elements per token
    row (H * D when contiguous; wider when y is a slice of a fused q/k/v gradient)."""
    rows = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    ok = rows < T
    pos = tl.load(pos_ptr + rows, mask=ok, other=0)
    i = tl.arange(0, HALF_B)
    m_rot = ok[:, None] & (i < half)[None, :]
    t = pos[:, None] * half + i[None, :]
    # One cos/sin fetch serves every head of the program.
    c = tl.load(cos_ptr + t, mask=m_rot, other=1.0)
    s = tl.load(sin_ptr + t, mask=m_rot, other=0.0) * SIGN
    if INTERLEAVED:
        c1 = 2 * i
        c2 = 2 * i + 1
    else:
        c1 = i
        c2 = i + half
    h0 = tl.program_id(1) * HEADS
    for hh in range(HEADS):
        x_off = rows.to(tl.int64) * x_row + (h0 + hh) * D
        y_off = rows.to(tl.int64) * y_row + (h0 + hh) * D
        x1 = tl.load(x_ptr + x_off[:, None] + c1[None, :], mask=m_rot, other=0.0).to(tl.float32)
        x2 = tl.load(x_ptr + x_off[:, None] + c2[None, :], mask=m_rot, other=0.0).to(tl.float32)
        rope_store_halves(y_ptr, y_off, ok, x1 * c - x2 * s, x2 * c + x1 * s, half, HALF_B, INTERLEAVED)
        if HAS_PASS:
            j = tl.arange(0, PASS_B)
            m2 = ok[:, None] & (j < D - rd)[None, :]
            tl.store(y_ptr + y_off[:, None] + rd + j[None, :],
                     tl.load(x_ptr + x_off[:, None] + rd + j[None, :], mask=m2), mask=m2)


@triton.jit
def _rope_full_kernel(x_ptr, y_ptr, pos_ptr, cos_ptr, sin_ptr, T, H: tl.constexpr, D: tl.constexpr, x_row, y_row,
                      HALF: tl.constexpr, D_B: tl.constexpr, BLOCK_T: tl.constexpr, INTERLEAVED: tl.constexpr,
                      SIGN: tl.constexpr, HEADS: tl.constexpr):
    """Layout "full": each head's rows are one contiguous [BLOCK_T, D_B] load and store; the pairs are split in
    registers (reshape + split, rejoined by join + reshape). Interleaved: the row is D_B // 2 adjacent pairs, the first
    HALF rotate. NeoX (HALF a power of two): the row is D_B // (2 * HALF) chunks of [2, HALF] (halves of rotary_dim),
    chunk 0 rotates. Channels past rotary_dim take x's value unchanged (a select, not a rotation by angle 0)."""
    rows = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    ok = rows < T
    pos = tl.load(pos_ptr + rows, mask=ok, other=0)
    cols = tl.arange(0, D_B)
    m = ok[:, None] & (cols < D)[None, :]
    rot = (cols < 2 * HALF)[None, :]
    if INTERLEAVED:
        p = tl.arange(0, D_B // 2)
        mc = ok[:, None] & (p < HALF)[None, :]
        t = pos[:, None] * HALF + p[None, :]
        c = tl.load(cos_ptr + t, mask=mc, other=1.0)  # [BLOCK_T, D_B // 2]
        s = tl.load(sin_ptr + t, mask=mc, other=0.0) * SIGN
    else:
        i = tl.arange(0, HALF)
        t = pos[:, None] * HALF + i[None, :]
        c = tl.expand_dims(tl.load(cos_ptr + t, mask=ok[:, None], other=1.0), 1)  # [BLOCK_T, 1, HALF]
        s = tl.expand_dims(tl.load(sin_ptr + t, mask=ok[:, None], other=0.0) * SIGN, 1)
    h0 = tl.program_id(1) * HEADS
    for hh in range(HEADS):
        x = tl.load(x_ptr + (rows.to(tl.int64) * x_row + (h0 + hh) * D)[:, None] + cols[None, :], mask=m, other=0.0)
        xf = x.to(tl.float32)
        if INTERLEAVED:
            a, b = tl.split(tl.reshape(xf, (BLOCK_T, D_B // 2, 2)))
            y = tl.reshape(tl.join(a * c - b * s, b * c + a * s), (BLOCK_T, D_B))
        else:
            a, b = tl.split(tl.permute(tl.reshape(xf, (BLOCK_T, D_B // (2 * HALF), 2, HALF)), (0, 1, 3, 2)))
            y = tl.reshape(tl.permute(tl.join(a * c - b * s, b * c + a * s), (0, 1, 3, 2)), (BLOCK_T, D_B))
        y_ptrs = (rows.to(tl.int64) * y_row + (h0 + hh) * D)[:, None] + cols[None, :]
        tl.store(y_ptr + y_ptrs, tl.where(rot, y.to(x.dtype), x), mask=m)


def rope_launch(layout: str, block_t: int, heads: str, num_warps: int) -> LaunchConfig:
    """One launch config of the rope kernels (what the tuner picks between). layout "halves": two half-row loads per
    head (_rope_kernel), "full": one row load (_rope_full_kernel); block_t token rows per program; heads "loop": a
    program loops over every head, cos/sin fetched once, "grid": one head per program."""
    return LaunchConfig.of(num_warps, layout=layout, BLOCK_T=block_t, heads=heads)


LAYOUTS = ("halves", "full")


def full_layout_ok(rd: int, interleaved: bool) -> bool:
    """The "full" layout splits NeoX halves by a reshape, so it needs rotary_dim a power of two (interleaved: any)."""
    return interleaved or rd & (rd - 1) == 0


def gpu_configs(rd: int, interleaved: bool) -> list[LaunchConfig]:
    """Candidates on the GPU; the first is the measured default (the fastest at 64K x 4 x 128 bf16 on the H200)."""
    out = [rope_launch("halves", 32, "loop", 4)]
    # (128 rows, 4 warps) is left out: ptxas spills 144-3288 bytes per thread there
    out += [rope_launch("halves", bt, "loop", w) for bt in (32, 64, 128) for w in (4, 8)
            if (bt, w) not in ((32, 4), (128, 4))]
    # head-parallel: H times the programs, cos/sin re-read per head (from L2)
    out += [rope_launch("halves", 64, "grid", 4), rope_launch("halves", 128, "grid", 4),
            rope_launch("halves", 128, "grid", 8)]
    if full_layout_ok(rd, interleaved):
        out += [rope_launch("full", 32, "loop", 4), rope_launch("full", 64, "loop", 8),
                rope_launch("full", 64, "grid", 4), rope_launch("full", 128, "grid", 8)]
    return out


def rope_configs(rd: int, interleaved: bool) -> list[LaunchConfig]:
    """The tuner's candidates: gpu_configs, or one small config under the interpreter (CPU tests stay fast)."""
    if triton_interpreting():
        return [rope_launch("halves", 16, "loop", 4)]
    return gpu_configs(rd, interleaved)


_TUNER = ConfigTuner("gem.ops.rope")


def _rope_launch(cfg: LaunchConfig, x: torch.Tensor, y: torch.Tensor, pos: torch.Tensor, cos: torch.Tensor,
                 sin: torch.Tensor, rd: int, interleaved: bool, inverse: bool) -> None:
    """Write y = rope(x) ([T, H, D] each, T > 0; heads adjacent and the head dim dense, any token stride) with launch
    config cfg; pos [T] int32, cos/sin tables."""
    t, h, d = x.shape
    layout, block_t = cfg.tile("layout"), cfg.tile("BLOCK_T")
    heads = {"loop": h, "grid": 1}[cfg.tile("heads")]
    grid = (cdiv(t, block_t), h // heads)
    sign = -1.0 if inverse else 1.0
    half = rd // 2
    if layout == "halves":
        _rope_kernel[grid](
            x, y, pos, cos, sin, t, h, d, half, rd, x.stride(0), y.stride(0),
            BLOCK_T=block_t, HALF_B=max(1, next_pow2(half)),
            PASS_B=max(1, next_pow2(max(d - rd, 1))), HAS_PASS=d > rd,
            INTERLEAVED=interleaved, SIGN=sign, HEADS=heads, num_warps=cfg.num_warps,
        )
    elif layout == "full":
        if not full_layout_ok(rd, interleaved):
            raise ValueError(f"rope layout 'full' needs a power-of-two rotary_dim for NeoX halves, got {rd}")
        _rope_full_kernel[grid](
            x, y, pos, cos, sin, t, h, d, x.stride(0), y.stride(0), HALF=half, D_B=next_pow2(d), BLOCK_T=block_t,
            INTERLEAVED=interleaved, SIGN=sign, HEADS=heads, num_warps=cfg.num_warps,
        )
    else:
        raise ValueError(f"rope layout {layout!r}: expected one of {LAYOUTS}")


def _rope_triton(x: torch.Tensor, offsets: torch.Tensor, max_len: int, base: float, rd: int, interleaved: bool,
                 inverse: bool, pos: torch.Tensor | None = None) -> torch.Tensor:
    """pos: the int32 token positions when the caller already holds them (positions_cached otherwise)."""
    x = x.contiguous()
    t, h, d = x.shape
    y = torch.empty_like(x)
    if t == 0 or h == 0:
        return y
    if pos is None:
        pos = positions_cached(offsets, t)
    cos, sin = cos_sin_table(max(max_len, 1), rd, base, x.device)

    def launch(cfg):  # writes y from x only: idempotent, as the tuner's timing needs
        _rope_launch(cfg, x, y, pos, cos, sin, rd, interleaved, inverse)

    # Not T (a new batch size must not re-tune), nor the direction (the sign is a constant: same speed).
    key = (h, d, rd, x.dtype, interleaved)
    launch(_TUNER.pick("rope", key, lambda: rope_configs(rd, interleaved), launch, x.device, outputs=(y,)))
    return y


def _rope_entry(x: torch.Tensor, offsets: torch.Tensor, max_len: int, base: float, rotary_dim: int,
                interleaved: bool, inverse: bool) -> torch.Tensor:
    return _rope_triton(x, offsets, max_len, base, rotary_dim, interleaved, inverse)


def _rope_fake(x, *rest):
    return torch.empty_like(x.contiguous())


def _rope_backward(grad, offsets, max_len, base, rotary_dim, interleaved, inverse):
    """The rotation is orthogonal: its vector-Jacobian product is the opposite rotation (through the op itself, so
    it stays differentiable)."""
    return rope_op(grad.contiguous(), offsets, max_len, base, rotary_dim, interleaved, not inverse)


# inputs (x, offsets, *constants) -> rotated x; positions kept in the JaggedBatch in eager calls
rope_op = KernelOp("rope", _rope_entry, _rope_backward, fake=_rope_fake, n_tensors=2, save=lambda i, o: (i[1],))


def rope(x: torch.Tensor, offsets, max_len: int | None = None, *, config: RopeConfig | None = None,
         inverse: bool = False, kernel: str = "auto") -> torch.Tensor:
    """Rotate jagged x [T, H, D] by each token's position within its sequence (see the module docstring).

    offsets: a tensor [B+1], or a gem.ops.JaggedBatch (max_len then optional; its positions are built once for every
    layer). `max_len` must be >= the longest sequence; `inverse=True` undoes the rotation. Differentiable.
    """
    config = RopeConfig() if config is None else config
    batch = as_batch(offsets, max_len)
    offsets, max_len = batch.offsets, batch.max_len
    _check(x, batch, max_len)
    rd = config.resolve_dim(x.shape[-1])
    if resolve_kernel(kernel, x, offsets) == "reference":
        return rope_reference(x, offsets, max_len, config, inverse=inverse)
    args = (x, offsets, max_len, float(config.base), rd, bool(config.interleaved), bool(inverse))
    return rope_op(*args, batches=(batch, batch))
