"""BlockAttention: softmax attention restricted to fixed-size blocks of each jagged sequence, optional fused RoPE.

Token i of a sequence attends to tokens j of the same sequence with i // block_size == j // block_size (blocks
restart at each sequence start; the last block may be partial), and j <= i when causal. Cost is O(L * block_size).
With `rope`, q and k are rotated by their position within the sequence (see gem.ops.rotary, NeoX halves by
default); the Triton forward rotates its stationary q tile in registers on load, the tiles the kernels stream come
from a rotated copy that one rope pass writes just before the launch (a temporary, never saved: see
gem.ops.triton_block for why), the backward reads both operands from such copies and inversely rotates dq/dk
before the store. The kernels rotate by the position within the block instead: the same scores, as a RoPE score
depends only on j - i.
"""

from __future__ import annotations

import dataclasses
import math

import torch

from gem.ops._common import (
    as_batch,
    check_head_dim,
    check_offsets,
    jagged_to_padded,
    pad_head_dim,
    padded_to_jagged,
    resolve_kernel,
    tile_head_dim,
)
from gem.ops.rotary import RopeConfig, rope_reference


def _validate(q, k, v, batch, max_len, block_size, rope, scale):
    offsets = batch.offsets
    if q.dim() != 3 or k.dim() != 3 or v.dim() != 3:
        raise ValueError(f"q, k, v must be [T, H, D]; got {tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}")
    t, h, d = q.shape
    if k.shape != v.shape or k.shape[0] != t or k.shape[2] != d:
        raise ValueError(f"k and v must be [T, H_kv, D] matching q {tuple(q.shape)}; got {tuple(k.shape)}, "
                         f"{tuple(v.shape)}")
    check_head_dim("q/k/v", d)
    if k.shape[1] == 0 or h % k.shape[1]:
        raise ValueError(f"q heads ({h}) must be a multiple of k/v heads ({k.shape[1]})")
    if not (q.dtype == k.dtype == v.dtype) or q.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        raise ValueError(f"q, k, v must share one dtype among fp16/bf16/fp32; got {q.dtype}, {k.dtype}, {v.dtype}")
    if offsets.dim() != 1 or offsets.numel() < 1 or offsets.dtype not in (torch.int32, torch.int64):
        raise ValueError("offsets must be a 1-D int32/int64 tensor [B+1] starting at 0")
    if not isinstance(block_size, int) or isinstance(block_size, bool) or block_size <= 0:
        raise ValueError(f"block_size={block_size!r} must be a positive int")
    if max_len < 0:
        raise ValueError(f"max_len={max_len} must be >= 0")
    check_offsets("offsets", batch, t, max_len, q.device)
    if rope is not None:
        if not isinstance(rope, RopeConfig):
            raise TypeError(f"rope must be a RopeConfig or None, got {type(rope).__name__}")
        rope.resolve_dim(d)
    if scale is not None and not (scale > 0 and math.isfinite(scale)):
        raise ValueError(f"scale={scale} must be a positive finite number")


def block_mask(lengths: torch.Tensor, max_len: int, block_size: int, causal: bool) -> torch.Tensor:
    """[B, N, N] bool: query i may attend key j (same block, j <= i if causal, j valid).

    Padded query rows attend to everything so the reference softmax stays finite (their outputs are dropped).
    """
    pos = torch.arange(max_len, device=lengths.device)
    blk = pos // block_size
    allowed = blk[:, None] == blk[None, :]
    if causal:
        allowed = allowed & (pos[None, :] <= pos[:, None])
    valid = pos[None, :] < lengths[:, None]  # [B, N]
    allowed = allowed[None] & valid[:, None, :]
    return allowed | ~valid[:, :, None]


def block_attention_reference(q, k, v, offsets, max_len, *, block_size, causal=True, rope=None, scale=None):
    """Padded [B, H, N, N] PyTorch reference in fp32 with separate RoPE; differentiable, returns q's dtype."""
    t, h, d = q.shape
    scale = 1.0 / math.sqrt(d) if scale is None else scale
    if rope is not None:
        q = rope_reference(q, offsets, max_len, rope)
        k = rope_reference(k, offsets, max_len, rope)
    group = h // k.shape[1]
    if group > 1:
        k = k.repeat_interleave(group, dim=1)
        v = v.repeat_interleave(group, dim=1)
    qp, valid = jagged_to_padded(q.float(), offsets, max_len)  # [B, N, H, D]
    kp, _ = jagged_to_padded(k.float(), offsets, max_len)
    vp, _ = jagged_to_padded(v.float(), offsets, max_len)
    qp, kp, vp = (x.transpose(1, 2) for x in (qp, kp, vp))  # [B, H, N, D]
    s = torch.matmul(qp, kp.transpose(-1, -2)) * scale
    allowed = block_mask(valid.sum(1), max_len, block_size, causal)
    s = s.masked_fill(~allowed[:, None], float("-inf"))
    o = torch.matmul(torch.softmax(s, dim=-1), vp).transpose(1, 2)  # [B, N, H, D]
    out = padded_to_jagged(o, valid)
    if out.shape[0] < t:  # tokens past offsets[-1] belong to no sequence
        out = torch.cat((out, out.new_zeros((t - out.shape[0],) + tuple(out.shape[1:]))))
    return out.to(q.dtype)


def block_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, offsets, max_len: int | None = None, *,
                    block_size: int, causal: bool = True, rope: RopeConfig | None = None,
                    scale: float | None = None, kernel: str = "auto") -> torch.Tensor:
    """Jagged block(-causal) attention; q [T, H, D], k/v [T, H_kv, D] with H_kv | H; returns [T, H, D].

    `offsets` [B+1] (offsets[-1] == T), or a gem.ops.JaggedBatch (max_len then optional; its tables are shared by
    every layer given it), `max_len` >= the longest sequence. `rope`: RopeConfig to rotate q and k
    by their position within the sequence (fused into the Triton kernel); rotary_dim must be even (rotary_dim=None
    rotates all of D, so D must then be even). `scale` defaults to 1/sqrt(D). Any D in 1..256 (the Triton kernels
    mask their columns; heads under 16 channels are zero-padded to 16 for the tile shapes).
    """
    batch = as_batch(offsets, max_len)
    offsets, max_len = batch.offsets, batch.max_len
    _validate(q, k, v, batch, max_len, block_size, rope, scale)
    if resolve_kernel(kernel, q, k, v, offsets) == "reference":
        return block_attention_reference(q, k, v, offsets, max_len, block_size=block_size, causal=causal,
                                         rope=rope, scale=scale)
    from gem.ops.triton_block import block_attention_triton

    d = q.shape[2]
    width = tile_head_dim(d, pow2=False)
    if width != d:
        # the real head's scale and rotated channels; the zero channels pass through the rotation
        scale = 1.0 / math.sqrt(d) if scale is None else scale
        rope = None if rope is None else dataclasses.replace(rope, rotary_dim=rope.resolve_dim(d))
        q, k, v = (pad_head_dim(x, width) for x in (q, k, v))
    out = block_attention_triton(q, k, v, batch, block_size=block_size, causal=causal, rope=rope, scale=scale)
    return out if width == d else out[..., :d]
