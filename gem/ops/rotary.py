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

from gem.ops._common import check_offsets, eager_tables, offsets_cached, resolve_kernel, triton_interpreting


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
    """positions_of as int32 for the kernels, built once per offsets tensor and row count in eager calls
    (gem.ops._common.offsets_cached; GEM_ROPE_POS_CACHE=0 rebuilds every call): building it is ~7 small launches,
    far more than the rope kernel's own memory time at 64K tokens."""
    return offsets_cached("_gem_rope_pos", "GEM_ROPE_POS_CACHE", offsets, offsets, (int(total),),
                          lambda: positions_of(offsets, total).to(torch.int32))


_TABLES: dict = {}


def cos_sin_table(length: int, rotary_dim: int, base: float, device) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 cos/sin tables [>= length, rotary_dim // 2]; angles computed in fp64 so long positions stay exact.

    Cached per (device, rotary_dim, base) and grown to the next power of two, so steady training reuses one table.
    """
    key = (str(device), rotary_dim, float(base))
    hit = _TABLES.get(key)
    if hit is not None and hit[0].shape[0] >= length:
        return hit
    n = max(16, triton.next_power_of_2(max(1, length)))
    inv_freq = float(base) ** (-torch.arange(0, rotary_dim, 2, dtype=torch.float64, device=device) / rotary_dim)
    ang = torch.arange(n, dtype=torch.float64, device=device)[:, None] * inv_freq[None, :]
    table = (ang.cos().float().contiguous(), ang.sin().float().contiguous())
    _TABLES[key] = table
    return table


def _check(x: torch.Tensor, offsets: torch.Tensor, max_len: int) -> None:
    if x.dim() != 3:
        raise ValueError(f"rope expects x of shape [T, H, D], got {tuple(x.shape)}")
    if offsets.dim() != 1 or offsets.numel() < 1 or offsets.dtype not in (torch.int32, torch.int64):
        raise ValueError("offsets must be a 1-D int32/int64 tensor [B+1] starting at 0")
    if max_len < 0:
        raise ValueError(f"max_len={max_len} must be >= 0")
    if x.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        raise ValueError(f"rope supports fp16/bf16/fp32, got {x.dtype}")
    check_offsets("offsets", offsets, x.shape[0], max_len, x.device)


def rope_reference(x: torch.Tensor, offsets: torch.Tensor, max_len: int, config: RopeConfig, *,
                   inverse: bool = False) -> torch.Tensor:
    """Plain PyTorch RoPE in fp32 (differentiable); returns x's dtype."""
    rd = config.resolve_dim(x.shape[-1])
    pos = positions_of(offsets, x.shape[0])
    cos, sin = cos_sin_table(max(max_len, 1), rd, config.base, x.device)
    c = cos[pos][:, None, :]
    s = sin[pos][:, None, :]
    if inverse:
        s = -s
    xf = x.float()
    rot, rest = xf[..., :rd], xf[..., rd:]
    if config.interleaved:
        x1, x2 = rot[..., 0::2], rot[..., 1::2]
    else:
        x1, x2 = rot[..., : rd // 2], rot[..., rd // 2:]
    y1 = x1 * c - x2 * s
    y2 = x2 * c + x1 * s
    if config.interleaved:
        y = torch.stack((y1, y2), dim=-1).flatten(-2)
    else:
        y = torch.cat((y1, y2), dim=-1)
    return torch.cat((y, rest), dim=-1).to(x.dtype)


# ----------------------------------------------------------------------------------------------------------------
# Triton: one program per token tile, looping over heads so each cos/sin row is fetched once per token; positions
# come from a [T] int32 vector built on device (once per offsets tensor in eager calls: positions_cached).


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
def _rope_kernel(x_ptr, y_ptr, pos_ptr, cos_ptr, sin_ptr, T, H: tl.constexpr, D: tl.constexpr, half, rd,
                 BLOCK_T: tl.constexpr, HALF_B: tl.constexpr, PASS_B: tl.constexpr, HAS_PASS: tl.constexpr,
                 INTERLEAVED: tl.constexpr, SIGN: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    ok = rows < T
    pos = tl.load(pos_ptr + rows, mask=ok, other=0)
    i = tl.arange(0, HALF_B)
    m_rot = ok[:, None] & (i < half)[None, :]
    t = pos[:, None] * half + i[None, :]
    # One cos/sin fetch serves every head of the token.
    c = tl.load(cos_ptr + t, mask=m_rot, other=1.0)
    s = tl.load(sin_ptr + t, mask=m_rot, other=0.0) * SIGN
    if INTERLEAVED:
        c1 = 2 * i
        c2 = 2 * i + 1
    else:
        c1 = i
        c2 = i + half
    for h in range(H):
        row_off = rows.to(tl.int64) * (H * D) + h * D
        x1 = tl.load(x_ptr + row_off[:, None] + c1[None, :], mask=m_rot, other=0.0).to(tl.float32)
        x2 = tl.load(x_ptr + row_off[:, None] + c2[None, :], mask=m_rot, other=0.0).to(tl.float32)
        rope_store_halves(y_ptr, row_off, ok, x1 * c - x2 * s, x2 * c + x1 * s, half, HALF_B, INTERLEAVED)
        if HAS_PASS:
            j = tl.arange(0, PASS_B)
            m2 = ok[:, None] & (j < D - rd)[None, :]
            p = row_off[:, None] + rd + j[None, :]
            tl.store(y_ptr + p, tl.load(x_ptr + p, mask=m2), mask=m2)


def _rope_triton(x: torch.Tensor, offsets: torch.Tensor, max_len: int, base: float, rd: int, interleaved: bool,
                 inverse: bool) -> torch.Tensor:
    x = x.contiguous()
    t, h, d = x.shape
    y = torch.empty_like(x)
    if t == 0 or h == 0:
        return y
    pos = positions_cached(offsets, t)
    cos, sin = cos_sin_table(max(max_len, 1), rd, base, x.device)
    half = rd // 2
    block_t = 16 if triton_interpreting() else 32
    grid = (triton.cdiv(t, block_t),)
    _rope_kernel[grid](
        x, y, pos, cos, sin, t, h, d, half, rd,
        BLOCK_T=block_t, HALF_B=max(1, triton.next_power_of_2(half)),
        PASS_B=max(1, triton.next_power_of_2(max(d - rd, 1))), HAS_PASS=d > rd,
        INTERLEAVED=interleaved, SIGN=-1.0 if inverse else 1.0,
        num_warps=4,
    )
    return y


@torch.library.custom_op("gem::rope", mutates_args=())
def _rope_op(x: torch.Tensor, offsets: torch.Tensor, max_len: int, base: float, rotary_dim: int,
             interleaved: bool, inverse: bool) -> torch.Tensor:
    return _rope_triton(x, offsets, max_len, base, rotary_dim, interleaved, inverse)


@_rope_op.register_fake
def _(x, offsets, max_len, base, rotary_dim, interleaved, inverse):
    return torch.empty_like(x.contiguous())


def _rope_setup(ctx, inputs, output):
    _, offsets, max_len, base, rotary_dim, interleaved, inverse = inputs
    ctx.save_for_backward(offsets)
    ctx.args = (max_len, base, rotary_dim, interleaved, inverse)


def _rope_backward(ctx, grad):
    (offsets,) = ctx.saved_tensors
    max_len, base, rotary_dim, interleaved, inverse = ctx.args
    # The rotation is orthogonal: its vector-Jacobian product is the opposite rotation.
    gx = _rope_op(grad.contiguous(), offsets, max_len, base, rotary_dim, interleaved, not inverse)
    return gx, None, None, None, None, None, None


_rope_op.register_autograd(_rope_backward, setup_context=_rope_setup)


class _RopeFn(torch.autograd.Function):
    """Eager path without the custom op's dispatch overhead; same kernel."""

    @staticmethod
    def forward(ctx, x, offsets, max_len, base, rotary_dim, interleaved, inverse):
        ctx.save_for_backward(offsets)
        ctx.args = (max_len, base, rotary_dim, interleaved, inverse)
        with eager_tables():  # positions cached per offsets tensor (the custom op rebuilds them)
            return _rope_triton(x, offsets, max_len, base, rotary_dim, interleaved, inverse)

    @staticmethod
    def backward(ctx, grad):
        (offsets,) = ctx.saved_tensors
        max_len, base, rotary_dim, interleaved, inverse = ctx.args
        with eager_tables():
            gx = _RopeFn.apply(grad.contiguous(), offsets, max_len, base, rotary_dim, interleaved, not inverse)
        return gx, None, None, None, None, None, None


def rope(x: torch.Tensor, offsets: torch.Tensor, max_len: int, *, config: RopeConfig | None = None,
         inverse: bool = False, kernel: str = "auto") -> torch.Tensor:
    """Rotate jagged x [T, H, D] by each token's position within its sequence (see the module docstring).

    `max_len` must be >= the longest sequence; `inverse=True` undoes the rotation. Differentiable.
    """
    config = RopeConfig() if config is None else config
    _check(x, offsets, max_len)
    rd = config.resolve_dim(x.shape[-1])
    if resolve_kernel(kernel, x, offsets) == "reference":
        return rope_reference(x, offsets, max_len, config, inverse=inverse)
    args = (x, offsets, max_len, float(config.base), rd, bool(config.interleaved), bool(inverse))
    if torch.compiler.is_compiling():  # the custom op lets torch.compile trace around the kernel
        return _rope_op(*args)
    return _RopeFn.apply(*args)
