"""Pre-norm transformer blocks over jagged sequences [T, d_model] (offsets [B+1], no padding).

Attention kinds: "jfa" (causal softmax, optional RoPE through gem.ops.rope), "swa" (causal with a left window),
"block" (block-diagonal causal, RoPE fused into gem.ops.block_attention). GQA through num_kv_heads < num_heads
(the ops take k/v with H_kv heads). The FFN is SwiGLU or a `gem.model.moe.MoE`.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from gem import ops
from gem.model.moe import MoE
from gem.model.precision import block_fp8_ffn, block_fp8_norm, fp8_kw, fp8_weights
from gem.ops.rotary import RopeConfig, cos_sin_table, qkv_rope, rope_tables


class Targets(NamedTuple):
    """Target tokens at the end of each tower sequence (generative-recommenders' HSTU targets): they see their
    sequence's history and themselves, not each other, and all sit at the first target's position, so a target's
    output does not depend on how many targets share its sequence or in which order."""

    num_targets: torch.Tensor  # [B] int: the last num_targets[b] tokens of sequence b
    positions: torch.Tensor  # [T] int32: each token's RoPE position (a target's: its history length)


class RMSNorm(nn.RMSNorm):
    """nn.RMSNorm with its weight in the input's dtype: a bf16 input (autocast) with an fp32 weight otherwise
    misses the fused kernel on CUDA."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w = None if self.weight is None else self.weight.to(x.dtype)
        return F.rms_norm(x, self.normalized_shape, w, self.eps)


def make_norm(kind: str, dim: int) -> nn.Module:
    return RMSNorm(dim, eps=1e-6) if kind == "rmsnorm" else nn.LayerNorm(dim)


class SwiGLU(nn.Module):
    def __init__(self, d_model: int, d_ff: int):
        super().__init__()
        self.w1 = nn.Linear(d_model, d_ff, bias=False)
        self.w3 = nn.Linear(d_model, d_ff, bias=False)
        self.w2 = nn.Linear(d_ff, d_model, bias=False)

    def forward(self, x, w8: tuple | None = None) -> torch.Tensor:
        """x: a tensor, or (fp8_block) its 1x128 blocks for w1 and w3 (`block_fp8_norm`); w8: fp8_weights(w1, w3,
        w2) when the call runs in a compiled region."""
        return block_fp8_ffn(x, self.w1, self.w3, self.w2, w8)


class JaggedSelfAttention(nn.Module):
    """QKV projection -> jagged attention op -> output projection, on [T, d_model]."""

    def __init__(self, d_model: int, num_heads: int, num_kv_heads: int, head_dim: int, *, kind: str = "jfa",
                 window: int | None = None, block_size: int | None = None, rope: RopeConfig | None = None,
                 kernel: str = "auto"):
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.kind, self.window, self.block_size, self.rope, self.kernel = kind, window, block_size, rope, kernel
        self.qkv = nn.Linear(d_model, (num_heads + 2 * num_kv_heads) * head_dim, bias=False)
        self.out = nn.Linear(num_heads * head_dim, d_model, bias=False)

    def project(self, x, w8: tuple | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x [T, d_model] (or, fp8_block, its 1x128 blocks from `block_fp8_norm`) -> q [T, H, D], k, v [T, H_kv, D].
        w8: fp8_weights(qkv) when the call runs in a compiled region."""
        qkv = self.qkv(x, **fp8_kw(w8))
        t = qkv.shape[0]
        h, hk, d = self.num_heads, self.num_kv_heads, self.head_dim
        q, k, v = qkv.split([h * d, hk * d, hk * d], dim=-1)
        return q.reshape(t, h, d), k.reshape(t, hk, d), v.reshape(t, hk, d)

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, offsets: torch.Tensor, max_len: int, *,
               roped: bool = False, num_targets: torch.Tensor | None = None) -> torch.Tensor:
        """The attention op (RoPE included unless `roped`: q and k already rotated) -> [T, H * D]. `num_targets`:
        the HSTU target mask (q and k must then be rotated already; swa's window becomes its max_attn_len)."""
        if num_targets is not None:
            if self.kind == "block" or (self.rope is not None and not roped):
                raise ValueError("target tokens need jfa or swa attention with q and k rotated at their positions")
            window = self.window if self.kind == "swa" else None
            o = ops.jagged_attention(q, k, v, offsets, max_len, causal=True, num_targets=num_targets,
                                     max_attn_len=window, kernel=self.kernel)
        elif self.kind == "block":
            o = ops.block_attention(q, k, v, offsets, max_len, block_size=self.block_size, causal=True,
                                    rope=self.rope, kernel=self.kernel)
        else:
            if self.rope is not None and not roped:
                q = ops.rope(q, offsets, max_len, config=self.rope, kernel=self.kernel)
                k = ops.rope(k, offsets, max_len, config=self.rope, kernel=self.kernel)
            window = self.window if self.kind == "swa" else None
            o = ops.jagged_attention(q, k, v, offsets, max_len, causal=True, window=window, kernel=self.kernel)
        return o.reshape(o.shape[0], self.num_heads * self.head_dim)

    def forward(self, x: torch.Tensor, offsets: torch.Tensor, max_len: int) -> torch.Tensor:
        return self.out(self.attend(*self.project(x), offsets, max_len))


class TransformerBlock(nn.Module):
    """x + attn(norm(x)); x + ffn(norm(x)). forward -> (x, aux_loss); one FSDP unit.

    The block runs in three parts: `_qkv` (norm + QKV projection), the attention kernels, `_finish` (output
    projection, residual, norm, FFN or MoE, residual). `compile_regions` compiles the two dense parts, so the
    elementwise chains around the GEMMs fuse while the attention stays on its own Triton kernels; RoPE (jfa/swa)
    then runs in `_qkv` as plain ops instead of gem.ops.rope.
    """

    def __init__(self, d_model: int, attn: JaggedSelfAttention, ffn: nn.Module, norm: str = "rmsnorm"):
        super().__init__()
        self.attn_norm = make_norm(norm, d_model)
        self.attn = attn
        self.ffn_norm = make_norm(norm, d_model)
        self.ffn = ffn
        self._rope_in_qkv = False  # set by compile_regions

    def _qkv(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
             w8: tuple | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """norm + QKV projection; with `rope` = (positions, cos table, sin table) q and k rotated too. w8: the QKV
        layer's fp8_weights entry (fp8_block)."""
        a = self.attn
        h = block_fp8_norm(self.attn_norm, x, a.qkv)  # fp8_block: the norm writes the QKV GEMM's FP8 input
        if rope is None:
            return a.project(h, w8)
        return qkv_rope(a.qkv(h, **fp8_kw(w8)), a.num_heads, a.num_kv_heads, a.head_dim, *rope, a.rope.interleaved,
                        a.kernel)

    def _finish(self, x: torch.Tensor, o: torch.Tensor, w8: tuple | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """w8: (the output projection's, the SwiGLU's) fp8_weights entries (fp8_block)."""
        w_out, w_ffn = w8 if w8 is not None else (None, None)
        x = x + self.attn.out(o, **fp8_kw(w_out))
        if isinstance(self.ffn, MoE):
            y, aux = self.ffn(self.ffn_norm(x))
        else:  # fp8_block: the norm writes the up projections' FP8 input (one pass for w1 and w3)
            h = block_fp8_norm(self.ffn_norm, x, self.ffn.w1, self.ffn.w3)
            y, aux = self.ffn(h, w_ffn), x.new_zeros((), dtype=torch.float32)
        return x + y, aux

    def _fp8_weights(self) -> tuple[tuple | None, tuple | None]:
        """fp8_block: the block's FP8 weight copies for `_qkv` and `_finish`, looked up here in eager code (after
        FSDP's all-gather) and handed to the compiled regions as arguments; (None, None) otherwise."""
        a = self.attn
        ffn = () if isinstance(self.ffn, MoE) else (self.ffn.w1, self.ffn.w3, self.ffn.w2)
        w8 = fp8_weights(a.qkv, a.out, *ffn)
        if w8 is None:
            return None, None
        return w8[0], (w8[1], w8[2:] if ffn and any(t is not None for t in w8[2:]) else None)

    def forward(self, x: torch.Tensor, offsets: torch.Tensor, max_len: int, targets: Targets | None = None
                ) -> tuple[torch.Tensor, torch.Tensor]:
        a, rope = self.attn, None
        if targets is not None and a.rope is not None:  # targets share a position: RoPE from explicit positions
            cos, sin = cos_sin_table(max(max_len, 1), a.rope.resolve_dim(a.head_dim), a.rope.base, x.device)
            rope = (targets.positions, cos, sin)
        elif self._rope_in_qkv:
            rope = rope_tables(offsets, x.shape[0], max_len, a.rope.resolve_dim(a.head_dim), a.rope.base)
        w_qkv, w_finish = self._fp8_weights()
        q, k, v = self._qkv(x, rope, w_qkv)
        return self._finish(x, a.attend(q, k, v, offsets, max_len, roped=rope is not None,
                                        num_targets=None if targets is None else targets.num_targets), w_finish)

    def compile_regions(self, **compile_kwargs) -> None:
        """torch.compile `_qkv` and `_finish` (the token count varies per batch: dynamic after the first)."""
        self._qkv = torch.compile(self._qkv, **compile_kwargs)
        self._finish = torch.compile(self._finish, **compile_kwargs)
        # RoPE as plain ops in `_qkv`: Inductor fuses it into the q/k/v split (and its backward into the dqkv concat)
        self._rope_in_qkv = self.attn.rope is not None and self.attn.kind != "block"


def build_blocks(cfg, tower=None) -> nn.ModuleList:
    """One tower's blocks from a ModelConfig (every `moe_every`-th block gets an MoE FFN); `tower`: a resolved
    TowerConfig (ModelConfig.tower_for), default the default tower."""
    t = tower or cfg.tower_for()
    rope = RopeConfig(base=t.rope_base) if t.rope else None
    blocks = []
    for i in range(t.num_blocks):
        attn = JaggedSelfAttention(cfg.d_model, t.num_heads, t.num_kv_heads, t.head_dim,
                                   kind=t.attention, window=t.window, block_size=t.block_size, rope=rope,
                                   kernel=cfg.kernel)
        if cfg.is_moe_block(i, t):
            m = cfg.moe
            ffn = MoE(cfg.d_model, cfg.moe_d_ff_for(t), m.num_experts, m.top_k, capacity_factor=m.capacity_factor,
                      aux_loss_coef=m.aux_loss_coef)
            ffn.use_grouped_mm = m.grouped_mm
        else:
            ffn = SwiGLU(cfg.d_model, t.d_ff)
        blocks.append(TransformerBlock(cfg.d_model, attn, ffn, norm=t.norm))
    return nn.ModuleList(blocks)
