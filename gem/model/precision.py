"""Low-precision GEMMs for the dense tower: `train.precision` bf16 | fp8 | fp8_block | mxfp8 and the modules it
converts.

`apply_precision(model, precision, device, patterns)` swaps the nn.Linear modules whose names match one of the
fnmatch `patterns` for a Linear of the same shape that shares their parameters (names `weight` / `bias`
unchanged, so checkpoints and FSDP see the same model):

- mxfp8 (any device): every operand of the three GEMMs (forward, input gradient, weight gradient) is MX-quantized
  to E4M3 (gem.ops.mx, blocks of 32 along that GEMM's reduction axis, as MX hardware needs them); the quantization
  passes straight through in the backward. Gradients are E4M3 too: torch's MX GEMM takes E4M3 x E4M3 only, and
  32-element scales leave E5M2's extra range unneeded. On sm_100+ the GEMMs run block-scaled on the tensor cores
  (torch._scaled_mm with E8M0 scales, bf16 out); elsewhere the operands are dequantized and multiplied in the
  compute dtype (emulation for numerics studies: the same values up to accumulation order). Layers whose in or out
  features are not multiples of 32 stay nn.Linear.
- fp8 (CUDA sm_89+): torch._scaled_mm with row-wise scales (per token for activations and gradients, per output
  channel of the weight, amax / fp8 max in fp32), E4M3 throughout, for the forward GEMM and the input-gradient GEMM;
  the weight-gradient GEMM stays bf16 (its operands would need column-wise scales over the tokens: on the H200 that
  pass over both activations cost more than the faster GEMM saved). MoE layers matched by the filter (not by
  default) run their experts with the same recipe through torch._scaled_grouped_mm. Layers whose dims are not
  multiples of 16 stay nn.Linear. The quantization is plain torch ops inside the blocks' compiled regions, so
  Inductor fuses it into the kernels that produce each GEMM input (norms, SwiGLU, their backwards): on the H200
  that beat quantizing the gradients with a one-pass row-wise Triton kernel by 3.5% of the step. Those regions compile
  without Inductor's mix-order reduction (inductor_options).
- fp8_block (any device): block-scaled E4M3 as DeepSeek-V3 trains (gem.ops.fp8_block): activations and gradients
  in 1x128 blocks along each GEMM's reduction axis (the weight gradient's runs over the tokens: both layouts come
  from one pass over the tensor), weights in 128x128 tiles (W and W^T from one pass per forward), power-of-two fp32
  scales, for the forward, input-gradient and weight-gradient GEMMs. On sm_90 the GEMMs are cuBLAS's block-scaled
  torch._scaled_mm (bf16 out); elsewhere emulated (dequantized operands, fp32 products). The backward keeps only
  the FP8 copies of x and W. W's copies are made once per optimizer step (fp8_weights); under FSDP2 each rank
  quantizes its own shard and FSDP2 all-gathers the FP8 codes and scales (BlockFP8ShardWeight). The tower's RMSNorm /
  LayerNorm in front of the QKV and FFN up projections and the SwiGLU in front of the down projection write those
  GEMMs' FP8 input themselves (block_fp8_norm, block_fp8_ffn: gem.ops.fp8_block's fused producers), and the
  SwiGLU backward writes w1's and w3's output gradients straight into FP8 blocks; other inputs (attention output,
  interaction, the other gradients) go through the standalone 1x128 quantizer. Layers whose dims are not multiples of 128 stay nn.Linear; under the default filter the
  interaction's projections are converted too (BLOCK_FILTER). MoE experts named by the filter run fp8's row-wise
  grouped recipe.
- fp8 with `backend="torchao"`: torchao's Float8Linear, row-wise recipe (torchao.float8), where it is installed.
- bf16: nothing changes (autocast decides the GEMM dtype as before).
"""

from __future__ import annotations

import fnmatch
import functools
import logging
from collections.abc import Sequence

import torch
import torch.nn.functional as F
import torch.utils._pytree as pytree
from torch import nn

from gem.config import ConfigError
from gem.ops import fp8_block as fb
from gem.ops import mx

__all__ = [
    "BLOCK_FILTER",
    "DEFAULT_FILTER",
    "PRECISIONS",
    "BlockFP8GatheredWeight",
    "BlockFP8Linear",
    "BlockFP8ShardWeight",
    "FP8Linear",
    "MXFP8Linear",
    "apply_precision",
    "block_fp8_ffn",
    "block_fp8_norm",
    "check_precision_device",
    "fp8_grouped_mm",
    "fp8_kw",
    "fp8_weights",
    "inductor_options",
    "invalidate_fp8_weights",
]

log = logging.getLogger("gem.model")

PRECISIONS = ("bf16", "fp8", "fp8_block", "mxfp8")
# The tower's attention projections and dense FFNs; heads, routers, embedding-side and small layers stay bf16.
# MoE experts are opt-in ("blocks.*.ffn" names the MoE layers, fp8 only): on gpu_base their fp8 GEMMs cost 1.3-1.8%
# eval NE after 200 steps, while fp8 on the dense layers alone stays within 0.4% after 1,000 (docs/PERF.md).
DEFAULT_FILTER = ("blocks.*.attn.qkv", "blocks.*.attn.out", "blocks.*.ffn.w1", "blocks.*.ffn.w2", "blocks.*.ffn.w3")
# fp8_block under the default filter: the interaction's projections too (kv_proj runs over every history token)
BLOCK_FILTER = DEFAULT_FILTER + ("interaction.q_proj", "interaction.kv_proj", "interaction.out")
MX_BLOCK = 32
_FP8_ALIGN = 16  # torch._scaled_mm wants the GEMM dims in multiples of 16


def fp8_supported(device: torch.device) -> bool:
    return device.type == "cuda" and torch.cuda.get_device_capability(device) >= (8, 9)


def check_precision_device(precision: str, device: torch.device) -> None:
    """One-line ConfigError when `precision` cannot run on `device` (fp8 needs FP8 tensor cores)."""
    device = torch.device(device)
    if precision == "fp8" and not fp8_supported(device):
        where = "cpu" if device.type != "cuda" else "sm_{}{}".format(*torch.cuda.get_device_capability(device))
        raise ConfigError(f"train.precision: fp8 needs a GPU with FP8 tensor cores (sm_89+) (got fp8 on {where}); "
                          "use mxfp8 for emulated numerics or bf16")


def _compute_dtype(x: torch.Tensor) -> torch.dtype:
    """The dtype nn.Linear would multiply in: autocast's where it is on, else the input's."""
    dev = x.device.type
    if torch.is_autocast_enabled(dev):
        return torch.get_autocast_dtype(dev)
    return x.dtype


def _flat(x: torch.Tensor) -> torch.Tensor:
    return x.reshape(-1, x.shape[-1])


class _LowPrecisionLinearFn(torch.autograd.Function):
    """y = x W^T + b with the three GEMMs of `gemms` (forward, grad of the input, grad of the weight), each taking
    the full-precision operands and quantizing them its own way; the quantization passes straight through."""

    @staticmethod
    def forward(ctx, x, weight, bias, dtype, gemms):
        x2 = _flat(x)
        y = gemms.forward(x2, weight, dtype)
        if bias is not None:
            y = y + bias.to(dtype)
        ctx.save_for_backward(x2, weight)
        ctx.gemms, ctx.dtype, ctx.x_shape, ctx.x_dtype, ctx.has_bias = gemms, dtype, x.shape, x.dtype, bias is not None
        return y.reshape(*x.shape[:-1], weight.shape[0])

    @staticmethod
    def backward(ctx, gy):
        x2, weight = ctx.saved_tensors
        g = _flat(gy)
        dx = dw = db = None
        if ctx.needs_input_grad[0]:
            dx = ctx.gemms.grad_input(g, weight, ctx.dtype).reshape(ctx.x_shape).to(ctx.x_dtype)
        if ctx.needs_input_grad[1]:
            dw = ctx.gemms.grad_weight(g, x2, ctx.dtype).to(weight.dtype)
        if ctx.has_bias and ctx.needs_input_grad[2]:
            db = g.sum(0)
        return dx, dw, db, None, None


class _LowPrecisionLinear(nn.Linear):
    gemms: type
    align: int  # in and out features must be multiples of this

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gemms = self.gemms.on(x.device)
        dtype = gemms.compute_dtype(_compute_dtype(x))
        with torch.autocast(x.device.type, enabled=False):
            y = _LowPrecisionLinearFn.apply(x, self.weight, self.bias, dtype, gemms)
        return y if torch.is_autocast_enabled(x.device.type) else y.to(x.dtype)


# ---------------------------------------------------------------------------------------------------- mxfp8


# eager inside compiled regions: traced through this Function, dynamo failed (torch 2.13 CPU) or trained to NaN
@torch.compiler.disable
def mx_fake_quant(t: torch.Tensor, elem: str, axis: int, dtype: torch.dtype) -> torch.Tensor:
    """t MX-quantized in blocks of 32 along `axis` and dequantized to `dtype` (exact: an fp8 value times a power
    of two fits bf16 / fp32)."""
    kernel = "auto" if t.is_cuda else "reference"  # the Triton interpreter would be far too slow on CPU
    data, scale = mx.quantize(t, block=MX_BLOCK, elem=elem, axis=axis, kernel=kernel)
    return mx.dequantize(data, scale, block=MX_BLOCK, axis=axis, dtype=dtype, kernel=kernel)


@functools.cache
def _mx_gemm_on(device: torch.device) -> bool:
    return (device.type == "cuda" and torch.cuda.get_device_capability(device) >= (10, 0)
            and hasattr(torch, "float8_e8m0fnu"))


def mx_gemm_supported(device: torch.device) -> bool:
    """Block-scaled MX GEMMs in hardware: CUDA sm_100+ (torch._scaled_mm with E8M0 scales)."""
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    return _mx_gemm_on(device)


def _block_scaled_mm(qa, qb, sa, sb, dt):
    """qa [M, K] @ qb [N, K]^T, E4M3 with E8M0 scales per 32 along K in the GEMM's tiled layout."""
    return torch._scaled_mm(qa, qb.t(), scale_a=sa, scale_b=sb, out_dtype=dt)


class _MXGemms:
    """Emulated MX GEMMs. Each GEMM is a [M, K] @ b_t [N, K]^T with both operands MX-quantized (E4M3, blocks of 32
    along K, its reduction axis) and dequantized, multiplied in `dt`."""

    @staticmethod
    def on(device: torch.device) -> type:
        return _MXBlockScaledGemms if mx_gemm_supported(device) else _MXGemms

    @staticmethod
    def compute_dtype(dt: torch.dtype) -> torch.dtype:
        return dt

    @staticmethod
    @torch.compiler.disable
    def mm(a: torch.Tensor, b_t: torch.Tensor, dt: torch.dtype) -> torch.Tensor:
        return mx_fake_quant(a, "e4m3", -1, dt) @ mx_fake_quant(b_t, "e4m3", -1, dt).t()

    @classmethod
    def forward(cls, x, w, dt):  # x [M, K] @ W [N, K]^T: reduction over in_features
        return cls.mm(x, w, dt)

    @classmethod
    def grad_input(cls, g, w, dt):  # g [M, N] @ W [N, K]: reduction over out_features
        return cls.mm(g, w.t(), dt)

    @classmethod
    def grad_weight(cls, g, x, dt):  # g^T [N, M] @ x [M, K]: reduction over tokens
        return cls.mm(g.t(), x.t(), dt)


class _MXBlockScaledGemms(_MXGemms):
    """The same GEMMs on MX tensor cores (sm_100+): E4M3 data and E8M0 scales straight into torch._scaled_mm, so
    the result is the emulation's up to the GEMM's accumulation order. Writes bf16."""

    @staticmethod
    def compute_dtype(dt: torch.dtype) -> torch.dtype:
        return torch.bfloat16

    @staticmethod
    @torch.compiler.disable
    def mm(a: torch.Tensor, b_t: torch.Tensor, dt: torch.dtype) -> torch.Tensor:
        if 0 in (a.shape[0], a.shape[1], b_t.shape[0]):  # an empty batch: no GEMM to launch
            return a.new_zeros((a.shape[0], b_t.shape[0]), dtype=dt)
        pad = -a.shape[1] % MX_BLOCK  # whole blocks along K (the tokens, for the weight gradient): zeros add nothing
        if pad:
            a, b_t = F.pad(a, (0, pad)), F.pad(b_t, (0, pad))
        qa, sa = mx.quantize(a, block=MX_BLOCK, elem="e4m3", axis=-1)
        qb, sb = mx.quantize(b_t, block=MX_BLOCK, elem="e4m3", axis=-1)
        return _block_scaled_mm(qa, qb, mx.blocked_scales(sa), mx.blocked_scales(sb), dt)


class MXFP8Linear(_LowPrecisionLinear):
    """nn.Linear with MXFP8 GEMMs (see the module docstring): block-scaled on sm_100+, emulated elsewhere; same
    parameters, same state dict."""

    gemms, align = _MXGemms, MX_BLOCK


# ---------------------------------------------------------------------------------------------------- fp8


def _fp8_rows(t: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Row-wise fp8: (t / s as dtype, s [rows, 1] fp32) with s = amax(row) / fp8 max."""
    fmax = torch.finfo(dtype).max
    s = t.abs().amax(-1, keepdim=True).float().clamp_min(1e-12) / fmax
    return (t.float() / s).clamp(-fmax, fmax).to(dtype).contiguous(), s


def _scaled_mm(a: torch.Tensor, a_dtype, b_t: torch.Tensor, b_dtype, out_dtype) -> torch.Tensor:
    """a [M, K] @ b_t [N, K]^T with both operands row-wise scaled along K."""
    qa, sa = _fp8_rows(a, a_dtype)
    qb, sb = _fp8_rows(b_t, b_dtype)
    return torch._scaled_mm(qa, qb.t(), scale_a=sa, scale_b=sb.reshape(1, -1), out_dtype=out_dtype)


_E4M3 = torch.float8_e4m3fn


class _FP8Gemms:
    """Row-wise scaled torch._scaled_mm, E4M3: forward and input gradient in fp8, weight gradient in bf16."""

    @staticmethod
    def on(device: torch.device) -> type:
        return _FP8Gemms

    @staticmethod
    def compute_dtype(dt: torch.dtype) -> torch.dtype:
        return torch.bfloat16  # row-wise scaled _scaled_mm writes bf16 only

    @staticmethod
    def forward(x, w, dt):  # scales per token of x, per output channel of W
        return _scaled_mm(x, _E4M3, w, _E4M3, dt)

    @staticmethod
    def grad_input(g, w, dt):  # scales per token of g, per input channel of W
        return _scaled_mm(g, _E4M3, w.t(), _E4M3, dt)

    @staticmethod
    def grad_weight(g, x, dt):
        return g.t().to(dt) @ x.to(dt)


class _FP8GroupedMM(torch.autograd.Function):
    """a [M, K] @ w[e] [K, N] per group of rows (int32 end offsets `offs`) with the fp8 recipe of _FP8Gemms:
    torch._scaled_grouped_mm forward and input gradient, bf16 torch._grouped_mm for the weight gradient."""

    @staticmethod
    def forward(ctx, a, w, offs):
        qa, sa = _fp8_rows(a, _E4M3)
        qw, sw = _fp8_rows(w.transpose(-2, -1), _E4M3)  # [E, N, K]: one scale per expert and output channel
        ctx.save_for_backward(a, w, offs)
        return torch._scaled_grouped_mm(qa, qw.transpose(-2, -1), sa.squeeze(-1), sw.squeeze(-1), offs=offs,
                                        out_dtype=torch.bfloat16, use_fast_accum=True)

    @staticmethod
    def backward(ctx, g):
        a, w, offs = ctx.saved_tensors
        da = dw = None
        if ctx.needs_input_grad[0]:
            qg, sg = _fp8_rows(g, _E4M3)
            qw, sw = _fp8_rows(w, _E4M3)  # [E, K, N]: one scale per expert and input channel
            da = torch._scaled_grouped_mm(qg, qw.transpose(-2, -1), sg.squeeze(-1), sw.squeeze(-1), offs=offs,
                                          out_dtype=torch.bfloat16, use_fast_accum=True)
        if ctx.needs_input_grad[1]:
            dw = torch._grouped_mm(a.t(), g.to(a.dtype), offs=offs)  # [E, K, N], groups along the rows
        return da, dw, None


def fp8_grouped_mm(a: torch.Tensor, w: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """torch._grouped_mm(a, w, offs=offs) (a bf16 [M, K], w bf16 [E, K, N]) with row-wise fp8 GEMMs."""
    return _FP8GroupedMM.apply(a, w, offs)


class FP8Linear(_LowPrecisionLinear):
    """nn.Linear with row-wise scaled FP8 GEMMs through torch._scaled_mm (CUDA sm_89+); same parameters."""

    gemms, align = _FP8Gemms, _FP8_ALIGN


# ---------------------------------------------------------------------------------------------------- fp8_block


def block_gemm_supported(device: torch.device) -> bool:
    """Block-scaled FP8 GEMMs (1x128 / 128x128 fp32 scales) in cuBLAS through torch._scaled_mm: CUDA sm_90."""
    device = torch.device(device)
    return device.type == "cuda" and torch.cuda.get_device_capability(device) == (9, 0)


def _cublas_block_scales(sa: torch.Tensor, sb: torch.Tensor, b_tiles: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """sa [M, K / 128], sb [N / 128, K / 128] (b_tiles) or [N, K / 128] -> the strides cuBLAS's block-wise recipes
    read: 1x128 scales outer-dim-major (scale_a [M, Kb] with M contiguous, scale_b [Kb, N] with N contiguous),
    128x128 scale_b [Kb, N / 128] with Kb contiguous and a leading stride padded to 4 (16 bytes)."""
    scale_a = sa if sa.stride(0) == 1 else sa.t().contiguous().t()
    if not b_tiles:
        return scale_a, sb.t().contiguous()
    nb, kb = sb.shape
    l4 = -(-kb // 4) * 4
    if sb.stride() != (l4, 1) and not (l4 == kb and sb.is_contiguous()):
        buf = sb.new_zeros((nb, l4))
        buf[:, :kb] = sb
        sb = buf
    return scale_a, sb.t()[:kb]


def block_mm(qa, sa, qb, sb, b_tiles: bool, dt: torch.dtype) -> torch.Tensor:
    """qa [M, K] @ qb [N, K]^T, both E4M3, blocks along K: sa [M, K / 128]; sb [N / 128, K / 128] (b_tiles:
    128x128) or [N, K / 128] (1x128). cuBLAS on sm_90; elsewhere the dequantized operands multiplied in fp32 (the
    same products, another accumulation order). One opaque op under torch.compile: Inductor's own lowering of
    block-scaled _scaled_mm rejects symbolic scale shapes (dynamic token counts), so it runs as torch's kernel."""
    return torch.ops.gem.fp8_block_mm(qa, sa, qb, sb, b_tiles, dt)


@torch.library.custom_op("gem::fp8_block_mm", mutates_args=())
def _block_mm(qa: torch.Tensor, sa: torch.Tensor, qb: torch.Tensor, sb: torch.Tensor, b_tiles: bool,
              dt: torch.dtype) -> torch.Tensor:
    qa, qb = qa.contiguous(), qb.contiguous()  # row-major operands whatever layout a compiled graph hands in
    if 0 in qa.shape or 0 in qb.shape:
        return qa.new_zeros((qa.shape[0], qb.shape[0]), dtype=dt)
    if qa.is_cuda and block_gemm_supported(qa.device):
        m = qa.shape[0]
        if m % 4:  # torch wants 1x128 scales [M, Kb] with stride (1, M); cuBLAS wants M * 4 bytes 16-byte aligned
            pad = 4 - m % 4
            qa = torch.cat([qa, qa.new_zeros((pad, qa.shape[1]))])
            sa = torch.cat([sa, sa.new_ones((pad, sa.shape[1]))])
        scale_a, scale_b = _cublas_block_scales(sa, sb, b_tiles)
        return torch._scaled_mm(qa, qb.t(), scale_a=scale_a, scale_b=scale_b, out_dtype=dt)[:m]
    kernel = "auto" if qa.is_cuda else "reference"  # the Triton interpreter would be far too slow on CPU
    a = fb.dequantize_1x128(qa, sa, torch.float32, kernel=kernel)
    b = (fb.dequantize_128x128 if b_tiles else fb.dequantize_1x128)(qb, sb, torch.float32, kernel=kernel)
    return (a @ b.t()).to(dt)


@_block_mm.register_fake
def _block_mm_fake(qa, sa, qb, sb, b_tiles, dt):
    return qa.new_empty((qa.shape[0], qb.shape[0]), dtype=dt)


# The weights' FP8 copies (W and W^T codes, 128x128 scales), made once per optimizer step: kept on the weight
# tensor the layer multiplies by, keyed on (generation, the tensor's version counter, its data pointer). In-place
# updates bump the version counter; FSDP2 all-gathers into its unsharded parameter without bumping it
# (torch.autograd._unsafe_preserve_version_counter), so the generation is bumped after every optimizer step (a global
# torch.optim post-step hook) and every state-dict load into a BlockFP8Linear. Under gradient accumulation the
# micro-batches of one step share the copy. Anything else that rewrites the weights in place without bumping their
# version must call invalidate_fp8_weights(). Memory: 2 bytes a parameter of the converted layers (unsharded). Weights
# FSDP2 all-gathers in FP8 (below) skip this cache: their shards keep the key and the gathered parameter the copies.
# The lookup runs in eager code: a compiled region gets the copies as arguments (fp8_weights, called by the module
# that owns the region before entering it), never as outputs of an op inside the graph, whose buffers Inductor may
# reuse. A BlockFP8Linear called inside a compiled region without them quantizes its weight in the graph, per call.
_generation = 0
_hook = None
_CACHE_ATTR = "_gem_fp8_block_weight"


def invalidate_fp8_weights() -> None:
    """Drop every BlockFP8Linear's cached FP8 weight: the next forward quantizes the weight again."""
    global _generation
    _generation += 1


def _install_step_hook() -> None:
    global _hook
    if _hook is None:
        from torch.optim.optimizer import register_optimizer_step_post_hook

        _hook = register_optimizer_step_post_hook(lambda *_: invalidate_fp8_weights())


@torch.compiler.disable
def _cached_weight(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """quantize_128x128(w) from the copy kept on w while it is current (see above); callers only read it."""
    if isinstance(w, BlockFP8GatheredWeight):  # FSDP2 all-gathered it in FP8 (below)
        return w.fp8()
    _install_step_hook()
    if w.is_inference():  # no version counter to key on
        return torch.ops.gem.fp8_block_quantize_weight(w.detach())
    key = (_generation, w._version, w.data_ptr())
    hit = getattr(w, _CACHE_ATTR, None)
    if hit is not None and hit[0] == key:
        return hit[1]
    out = torch.ops.gem.fp8_block_quantize_weight(w.detach())
    setattr(w, _CACHE_ATTR, (key, out))
    return out


def fp8_weights(*layers: nn.Module) -> tuple | None:
    """The current FP8 copies (qw, qwt, sw) of each layer's weight, None for a layer that is not a
    BlockFP8Linear; None when none is. Eager: call it outside a compiled region and hand the result in."""
    if not any(type(m) is BlockFP8Linear for m in layers):
        return None
    return tuple(_cached_weight(m.weight) if type(m) is BlockFP8Linear else None for m in layers)


def _weight_fp8(w: torch.Tensor, w8) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    if w8 is not None:
        return w8
    if isinstance(w, BlockFP8GatheredWeight):
        return w.fp8()
    if torch.compiler.is_compiling():
        return torch.ops.gem.fp8_block_quantize_weight(w.detach())
    return _cached_weight(w)


# ---------------------------------------------------------------------------------------------------- FP8 all-gather
# Under FSDP2, a BlockFP8Linear weight whose row shards are whole 128-row tiles is all-gathered in FP8 through FSDP2's
# tensor-subclass hooks (fsdp_pre_all_gather / fsdp_post_all_gather, as torchao's float8 weights do): each rank
# quantizes its own shard into 128x128 tiles once per optimizer step (the cache key above, kept on the shard), FSDP2
# gathers the E4M3 codes and the fp32 tile scales (1 + 4 / 128^2 bytes a parameter, against 2 or 4 for the weight in
# param_dtype), and the unsharded parameter is a BlockFP8GatheredWeight: the gathered codes and scales plus W^T's codes
# (transposed after each all-gather), exactly the bytes quantize_128x128 gives the full weight in param_dtype, since a
# tile never straddles two shards. The GEMMs read them; gradients reach the unsharded parameter and FSDP2
# reduce-scatters them into the master shards as before. gem.parallel.fsdp decides which weights qualify.

_aten = torch.ops.aten
# what FSDP2 applies to a parameter while sharding it (chunk, pad, narrow, view, detach): the results stay wrapped
_SHARD_OPS = frozenset({_aten.split.Tensor, _aten.split_with_sizes.default, _aten.new_zeros.default,
                        _aten.slice.Tensor, _aten.view.default, _aten.as_strided.default, _aten.detach.default,
                        _aten.alias.default, _aten.empty_like.default})


class BlockFP8ShardWeight(torch.Tensor):
    """A BlockFP8Linear weight (before fully_shard) or its FSDP2 shard (after) that FSDP2 all-gathers as 128x128-tile
    FP8. It wraps the plain tensor, and every op runs on that tensor (in-place ones update it: optimizer steps,
    state-dict loads), so it trains and saves as the plain weight."""

    @staticmethod
    def __new__(cls, t: torch.Tensor):
        return torch.Tensor._make_wrapper_subclass(cls, t.shape, strides=t.stride(), storage_offset=t.storage_offset(),
                                                   dtype=t.dtype, layout=t.layout, device=t.device,
                                                   requires_grad=t.requires_grad)

    def __init__(self, t: torch.Tensor):
        self._t = t
        self._fp8 = None  # (cache key, (codes, scale)) of the latest quantization

    __torch_function__ = torch._C._disabled_torch_function_impl

    def __repr__(self) -> str:
        return f"BlockFP8ShardWeight({self._t!r})"

    def plain(self) -> torch.Tensor:
        """The tensor it wraps (the same storage)."""
        return self._t

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        plain_args, plain_kwargs = pytree.tree_map_only(cls, lambda t: t._t, (args, kwargs or {}))
        out = func(*plain_args, **plain_kwargs)
        if func in _SHARD_OPS:
            return pytree.tree_map_only(torch.Tensor, cls, out)
        first = func._schema.arguments[0].alias_info if func._schema.arguments else None
        if first is not None and first.is_write and isinstance(args[0], cls):
            return args[0]  # in place: the wrapper itself, updated through the tensor it wraps
        return out

    @torch.no_grad()
    def fp8_codes(self, dtype: torch.dtype | None) -> tuple[torch.Tensor, torch.Tensor]:
        """(codes E4M3, scale fp32) of quantize_128x128(self cast to dtype), cached until the next optimizer step or
        in-place change."""
        _install_step_hook()
        t = self._t
        key = (_generation, t._version, t.data_ptr(), dtype)
        if self._fp8 is not None and self._fp8[0] == key:
            return self._fp8[1]
        src = t if dtype is None or dtype == t.dtype else t.to(dtype)
        codes, _, scale = fb.quantize_128x128(src, kernel="auto" if t.is_cuda else "reference", transposed=False)
        self._fp8 = (key, (codes, scale))
        return codes, scale

    def fsdp_pre_all_gather(self, mesh, outer_size, outer_stride, module, mp_policy):
        return self.fp8_codes(mp_policy.param_dtype), None

    def fsdp_post_all_gather(self, all_gather_outputs, metadata, param_dtype, *, out=None):
        codes, scale = all_gather_outputs
        if out is not None:  # FSDP2 refilled the codes and scales in place (the same storage): W^T's codes follow
            out.transpose_codes()
            return None
        codes_t = codes.new_empty((codes.shape[1], codes.shape[0]))
        w = BlockFP8GatheredWeight(codes, codes_t, scale, param_dtype)
        w.transpose_codes()
        return w, (codes, scale, codes_t)  # FSDP2 frees and re-allocates these between all-gathers


class BlockFP8GatheredWeight(torch.Tensor):
    """The unsharded parameter FSDP2 builds from BlockFP8ShardWeight's all-gather: the weight's shape and dtype,
    holding its 128x128-tile E4M3 codes [N, K], W^T's codes [K, N] and the fp32 tile scales, which BlockFP8Linear
    multiplies by. Other ops that read it (a norm for logging, a copy) see the dequantized weight, the values the
    GEMMs use; ops that write into it raise (the written values would not reach the codes)."""

    @staticmethod
    def __new__(cls, codes, codes_t, scale, dtype, requires_grad=False):
        return torch.Tensor._make_wrapper_subclass(cls, codes.shape, dtype=dtype, device=codes.device,
                                                   requires_grad=requires_grad)

    def __init__(self, codes, codes_t, scale, dtype, requires_grad=False):
        self._codes, self._codes_t, self._scale = codes, codes_t, scale

    __torch_function__ = torch._C._disabled_torch_function_impl

    def __repr__(self) -> str:
        return f"BlockFP8GatheredWeight(shape={tuple(self.shape)}, dtype={self.dtype})"

    def fp8(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(codes, codes of W^T, scale): what _cached_weight gives for the full weight."""
        return self._codes, self._codes_t, self._scale

    def transpose_codes(self) -> None:
        """W^T's codes from the (re)gathered codes. Autograd may hold them saved from the forward: their version
        stays, as FSDP2 keeps its all-gather outputs' version."""
        dst, src = self._codes_t.view(torch.uint8), self._codes.view(torch.uint8).t()
        if dst.is_inference():
            dst.copy_(src)
            return
        with torch.no_grad(), torch.autograd._unsafe_preserve_version_counter(self._codes_t):
            dst.copy_(src)

    def __tensor_flatten__(self):
        return ["_codes", "_codes_t", "_scale"], self.dtype

    @staticmethod
    def __tensor_unflatten__(inner, dtype, outer_size, outer_stride):
        return BlockFP8GatheredWeight(inner["_codes"], inner["_codes_t"], inner["_scale"], dtype)

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        w = args[0] if args else None
        if isinstance(w, cls):
            if func in (_aten.detach.default, _aten.alias.default) or (
                    func in (_aten.as_strided.default, _aten.view.default) and tuple(args[1]) == tuple(w.shape)):
                return cls(*w.fp8(), w.dtype)  # FSDP2's as_strided, nn.Parameter's detach: the same tensors
            if func in (_aten.zeros_like.default, _aten.empty_like.default):  # a zero gradient for an unused weight
                return torch.zeros(w.shape, dtype=kwargs.get("dtype") or w.dtype, device=w.device)
        params = func._schema.arguments
        passed = [args[i] if i < len(args) else kwargs.get(a.name) for i, a in enumerate(params)]
        if any(a.is_write and isinstance(v, cls) for a, v in zip(params, passed)):
            raise RuntimeError(f"{func}: a BlockFP8Linear weight all-gathered in FP8 holds FP8 codes; writing into "
                               "it would not change them (write the sharded parameter instead)")
        return func(*pytree.tree_map_only(cls, cls.dense, args), **pytree.tree_map_only(cls, cls.dense, kwargs))

    def dense(self) -> torch.Tensor:
        """The weight the codes stand for, in this tensor's dtype (what BlockFP8Linear's GEMMs multiply by)."""
        kernel = "auto" if self._codes.is_cuda else "reference"
        return fb.dequantize_128x128(self._codes, self._scale, self.dtype, kernel=kernel)


class _BlockFP8LinearFn(torch.autograd.Function):
    """y = x W^T + b with the three GEMMs block-scaled: x and the output gradient in 1x128 blocks along each GEMM's
    reduction axis (features for the forward and input gradient, tokens for the weight gradient, both layouts from
    one pass over the tensor), W in 128x128 tiles (W and W^T from one pass, once per optimizer step). x arrives
    quantized already (qx, sx, qxt, sxt: a fused producer's fp8_block.BlockFP8Act, x its gradient carrier) or is
    quantized here. The backward keeps only FP8 copies of x and W."""

    @staticmethod
    def forward(ctx, x, weight, bias, dtype, qx, sx, qxt, sxt, qw, qwt, sw):
        x2 = _flat(x)
        need_w = ctx.needs_input_grad[1]
        if qx is None:
            qx, sx, qxt, sxt = torch.ops.gem.fp8_block_quantize_act(x2, need_w)  # from x's own dtype
        y = block_mm(qx, sx, qw, sw, True, dtype)
        if bias is not None:
            y = y + bias.to(dtype)
        ctx.save_for_backward(qxt, sxt, qwt, sw)
        ctx.dtype, ctx.x_shape, ctx.x_dtype, ctx.w_dtype = dtype, x.shape, x.dtype, weight.dtype
        ctx.has_bias = bias is not None
        return y.reshape(*x.shape[:-1], weight.shape[0])

    @staticmethod
    def backward(ctx, gy):
        qxt, sxt, qwt, sw = ctx.saved_tensors
        g = _flat(gy)
        dx = dw = db = None
        need_x, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        if need_x or need_w:
            qg, sg, qgt, sgt = torch.ops.gem.fp8_block_quantize_act(g, need_w)
            if need_x:  # g [M, N] @ W [N, K]: W^T's tiles are W's, transposed
                dx = block_mm(qg, sg, qwt, sw.t(), True, ctx.dtype).reshape(ctx.x_shape).to(ctx.x_dtype)
            if need_w:  # g^T [N, Mp] @ x [Mp, K], blocks along the (zero-padded) tokens
                dw = block_mm(qgt, sgt.t(), qxt, sxt.t(), False, ctx.dtype).to(ctx.w_dtype)
        if ctx.has_bias and ctx.needs_input_grad[2]:
            db = g.float().sum(0).to(ctx.w_dtype)
        return dx, dw, db, None, None, None, None, None, None, None, None


class BlockFP8Linear(nn.Linear):
    """nn.Linear with block-scaled FP8 GEMMs (forward, input gradient and weight gradient; see the module
    docstring): cuBLAS on sm_90, emulated elsewhere; same parameters, same state dict. Takes a tensor, or an
    fp8_block.BlockFP8Act that a fused producer (block_fp8_norm, or a SwiGLU's block_fp8_ffn) wrote for it."""

    align = fb.BLOCK

    def forward(self, x: torch.Tensor | fb.BlockFP8Act, w8: tuple | None = None) -> torch.Tensor:
        """w8: this layer's fp8_weights() entry, looked up outside the compiled region the call runs in."""
        dtype = torch.bfloat16  # block-scaled _scaled_mm writes bf16
        if isinstance(x, fb.BlockFP8Act):
            act, x = x, x.out
            if act.data_t is None and self.weight.requires_grad and torch.is_grad_enabled():
                raise ValueError("BlockFP8Linear: the weight gradient needs the input's token-blocked layout "
                                 "(produce it with transposed=True)")
            pre = (act.data, act.scale, act.data_t, act.scale_t)
        else:
            pre = (None,) * 4
        with torch.autocast(x.device.type, enabled=False):
            y = _BlockFP8LinearFn.apply(x, self.weight, self.bias, dtype, *pre, *_weight_fp8(self.weight, w8))
        return y if torch.is_autocast_enabled(x.device.type) else y.to(x.dtype)

    def _load_from_state_dict(self, *args, **kwargs):
        super()._load_from_state_dict(*args, **kwargs)
        invalidate_fp8_weights()  # the load may have written an FSDP shard, not the tensor the cache keys on


def _block_fp8_consumers(consumers) -> bool:
    return bool(consumers) and all(type(c) is BlockFP8Linear for c in consumers)


def _wgrad(consumers) -> bool:
    return torch.is_grad_enabled() and any(c.weight.requires_grad for c in consumers)


def block_fp8_norm(norm: nn.Module, x: torch.Tensor, *consumers: nn.Module) -> torch.Tensor | fb.BlockFP8Act:
    """norm(x) for `consumers` (the modules that take it): an RMSNorm or LayerNorm over the last axis feeding only
    BlockFP8Linear layers writes its output straight into their 1x128 blocks (fp8_block.rms_norm_1x128 /
    layer_norm_1x128); any other norm or consumer gets norm(x) as before."""
    if not _block_fp8_consumers(consumers):
        return norm(x)
    if isinstance(norm, nn.RMSNorm) and len(norm.normalized_shape) == 1:
        eps = norm.eps if norm.eps is not None else torch.finfo(x.dtype).eps
        return fb.rms_norm_1x128(x, norm.weight, eps, transposed=_wgrad(consumers))
    if isinstance(norm, nn.LayerNorm) and len(norm.normalized_shape) == 1:
        return fb.layer_norm_1x128(x, norm.weight, norm.bias, norm.eps, transposed=_wgrad(consumers))
    return norm(x)


class _BlockFP8SwiGLUFn(torch.autograd.Function):
    """w2(silu(w1 x) * w3 x) with BlockFP8Linear's GEMMs, where the SwiGLU between them writes FP8 both ways: its
    forward writes h only as w2's 1x128 blocks (fp8_block.swiglu_1x128's kernel), its backward da and db only as
    w1's and w3's gradient blocks (no bf16 h, da or db, no quantization pass over them). x arrives quantized
    (qx, sx, qxt, sxt from block_fp8_norm) or is quantized here once for w1 and w3. a = w1 x and b = w3 x are kept
    for the backward in `act_dtype` (what the layers return: bf16 under autocast, else x's dtype); the GEMMs write
    bf16, so gradients reach every GEMM in bf16 as they reach a layer. The same bytes, so the same results, as the three
    layers called one after the other with swiglu_1x128 between them."""

    @staticmethod
    def forward(ctx, x, w1, w3, w2, act_dtype, qx, sx, qxt, sxt, impl, q1, q1t, s1, q3, q3t, s3, q2, q2t, s2):
        x2 = _flat(x)
        need_w = any(ctx.needs_input_grad[1:4])
        if qx is None:
            qx, sx, qxt, sxt = torch.ops.gem.fp8_block_quantize_act(x2, need_w)
        bf16 = torch.bfloat16
        a = block_mm(qx, sx, q1, s1, True, bf16).to(act_dtype)
        b = block_mm(qx, sx, q3, s3, True, bf16).to(act_dtype)
        _, qh, sh, qht, sht = torch.ops.gem.fp8_block_swiglu_fwd(a, b, need_w, False, impl)
        y = block_mm(qh, sh, q2, s2, True, bf16)
        ctx.save_for_backward(a, b, qxt, sxt, qht, sht, q1t, s1, q3t, s3, q2t, s2)
        ctx.x_shape, ctx.x_dtype, ctx.impl = x.shape, x.dtype, impl
        ctx.w_dtypes = (w1.dtype, w3.dtype, w2.dtype)
        return y.reshape(*x.shape[:-1], w2.shape[0])

    @staticmethod
    def backward(ctx, gy):
        a, b, qxt, sxt, qht, sht, q1t, s1, q3t, s3, q2t, s2 = ctx.saved_tensors
        need_x, need_w1, need_w3, need_w2 = ctx.needs_input_grad[:4]
        bf16 = torch.bfloat16
        dx = dw1 = dw3 = dw2 = None
        qg, sg, qgt, sgt = torch.ops.gem.fp8_block_quantize_act(_flat(gy), need_w2)
        if need_w2:
            dw2 = block_mm(qgt, sgt.t(), qht, sht.t(), False, bf16).to(ctx.w_dtypes[2])
        if need_x or need_w1 or need_w3:
            dh = block_mm(qg, sg, q2t, s2.t(), True, bf16).to(a.dtype)
            need_t = need_w1 or need_w3
            qa, sa, qat, sat, qb, sb, qbt, sbt = torch.ops.gem.fp8_block_swiglu_bwd_quant(a, b, dh, need_t, ctx.impl)
            if need_x:  # autograd's sum of the two layers' input gradients, in x's dtype
                dx = (block_mm(qa, sa, q1t, s1.t(), True, bf16).to(ctx.x_dtype)
                      + block_mm(qb, sb, q3t, s3.t(), True, bf16).to(ctx.x_dtype)).reshape(ctx.x_shape)
            if need_w1:
                dw1 = block_mm(qat, sat.t(), qxt, sxt.t(), False, bf16).to(ctx.w_dtypes[0])
            if need_w3:
                dw3 = block_mm(qbt, sbt.t(), qxt, sxt.t(), False, bf16).to(ctx.w_dtypes[1])
        return (dx, dw1, dw3, dw2) + (None,) * 15


def block_fp8_ffn(x, w1: nn.Module, w3: nn.Module, w2: nn.Module, w8: tuple | None = None) -> torch.Tensor:
    """w2(silu(w1(x)) * w3(x)). When the three are bias-free BlockFP8Linear layers, one op whose SwiGLU writes its
    FP8 output and, in the backward, its FP8 gradients (_BlockFP8SwiGLUFn); x may then be block_fp8_norm's
    BlockFP8Act. Otherwise the three layers as they are. w8: fp8_weights(w1, w3, w2), looked up outside the
    compiled region the call runs in."""
    layers = (w1, w3, w2)
    w8 = w8 or (None,) * 3
    if not _block_fp8_consumers(layers) or any(m.bias is not None for m in layers):
        return w2(F.silu(w1(x, **fp8_kw(w8[0]))) * w3(x, **fp8_kw(w8[1])), **fp8_kw(w8[2]))
    if isinstance(x, fb.BlockFP8Act):
        act, x = x, x.out
        if act.data_t is None and _wgrad((w1, w3)):
            raise ValueError("block_fp8_ffn: the weight gradient needs the input's token-blocked layout "
                             "(produce it with transposed=True)")
        pre = (act.data, act.scale, act.data_t, act.scale_t)
    else:
        pre = (None,) * 4
    dev = x.device.type
    act_dtype = torch.bfloat16 if torch.is_autocast_enabled(dev) else x.dtype  # what three BlockFP8Linear give
    impl = "triton" if x.is_cuda else "reference"
    with torch.autocast(dev, enabled=False):  # the GEMMs write bf16: the output gradient arrives in bf16, as a layer's
        weights = (t for m, c in zip(layers, w8) for t in _weight_fp8(m.weight, c))
        return _BlockFP8SwiGLUFn.apply(x, w1.weight, w3.weight, w2.weight, act_dtype, *pre, impl,
                                       *weights).to(act_dtype)


def fp8_kw(w8: tuple | None) -> dict:
    """The keyword arguments that hand a BlockFP8Linear its looked-up FP8 weight copies: `layer(x, **fp8_kw(w8))`
    (none when w8 is None, so any layer takes them; the call stays in the caller's frame for profiles)."""
    return {} if w8 is None else {"w8": w8}


def inductor_options(model: nn.Module) -> dict:
    """Inductor options for compiling `model`'s regions under its precision ({} when none are needed).

    With gem's fp8 GEMMs the backward's RMSNorm kernels also quantize the gradient they produce: a second row
    reduction after the norm's own. Inductor's mix-order reduction (the norm's row reduction and its weight
    gradient's column reduction in one kernel) then takes 0.86 ms per [65K, 1024] call on the H200, where the bf16
    step's norm-backward kernels take 0.16-0.25 ms; fp8 models compile without it (docs/PERF.md)."""
    import torch._inductor.config as inductor_config

    fp8 = any(isinstance(m, FP8Linear) or getattr(m, "fp8_experts", False) for m in model.modules())
    if fp8 and hasattr(inductor_config.triton, "mix_order_reduction"):
        return {"triton.mix_order_reduction": False}
    return {}


# ---------------------------------------------------------------------------------------------------- conversion

_CLASSES = {"mxfp8": MXFP8Linear, "fp8": FP8Linear, "fp8_block": BlockFP8Linear}
FP8_BACKENDS = ("gem", "torchao")


def _torchao_fp8(model: nn.Module, names: list[str]) -> None:
    try:
        from torchao.float8 import Float8LinearConfig, convert_to_float8_training
    except ImportError as e:
        raise ConfigError("train.fp8_backend", "torchao is not installed (pip install torchao), or use gem",
                          "torchao") from e
    wanted = set(names)
    # rowwise_with_gw_hp: fp8 forward and input gradient, bf16 weight gradient, the recipe gem's fp8 uses
    convert_to_float8_training(model, module_filter_fn=lambda _m, fqn: fqn in wanted,
                               config=Float8LinearConfig.from_recipe_name("rowwise_with_gw_hp"))
    for name in names:
        mod = model.get_submodule(name)
        mod.__class__ = _rows16(type(mod))


_ROWS16: dict[type, type] = {}


def _rows16(cls: type) -> type:
    """`cls` whose forward pads the token rows to a multiple of 16 (torchao's fp8 GEMMs need it; jagged batches
    have any token count) and drops them after."""
    if cls not in _ROWS16:
        def forward(self, x):
            x2 = _flat(x)
            pad = -x2.shape[0] % _FP8_ALIGN
            y = cls.forward(self, F.pad(x2, (0, 0, 0, pad)) if pad else x2)
            return y[:x2.shape[0]].reshape(*x.shape[:-1], y.shape[-1])
        _ROWS16[cls] = type(cls.__name__, (cls,), {"forward": forward})
    return _ROWS16[cls]


def precision_patterns(precision: str, patterns: Sequence[str] = DEFAULT_FILTER) -> tuple[str, ...]:
    """The module-name patterns `precision` converts: fp8_block's own default (BLOCK_FILTER) for the default."""
    patterns = tuple(patterns)
    return BLOCK_FILTER if precision == "fp8_block" and patterns == DEFAULT_FILTER else patterns


def linear_targets(model: nn.Module, precision: str, patterns: Sequence[str] = DEFAULT_FILTER
                   ) -> tuple[list[str], list[str], list[str]]:
    """The nn.Linear modules apply_precision converts to `precision` (not bf16): (the names `patterns` match, those
    converted: dims multiples of the format's alignment, 'name (in->out)' of the matched ones kept as nn.Linear)."""
    align = _CLASSES[precision].align
    patterns = precision_patterns(precision, patterns)
    matched, converted, kept = [], [], []
    for name, mod in model.named_modules():
        if type(mod) is not nn.Linear or not any(fnmatch.fnmatchcase(name, p) for p in patterns):
            continue
        matched.append(name)
        if mod.in_features % align or mod.out_features % align:
            kept.append(f"{name} ({mod.in_features}->{mod.out_features})")
        else:
            converted.append(name)
    return matched, converted, kept


def apply_precision(model: nn.Module, precision: str, device: torch.device | str,
                    patterns: Sequence[str] = DEFAULT_FILTER, backend: str = "gem") -> list[str]:
    """Convert the nn.Linear modules of `model` named by `patterns` to `precision`'s Linear, in place, sharing
    their parameters; returns the converted names. Call it after construction, before parallelize."""
    if precision not in PRECISIONS:
        raise ConfigError("train.precision", f"must be one of {', '.join(PRECISIONS)}", precision)
    if backend not in FP8_BACKENDS:
        raise ConfigError("train.fp8_backend", f"must be one of {', '.join(FP8_BACKENDS)}", backend)
    check_precision_device(precision, torch.device(device))
    if precision == "bf16":
        return []
    if precision == "fp8_block" and not block_gemm_supported(torch.device(device)):
        log.warning("train.precision=fp8_block: no block-scaled FP8 GEMM on %s (cuBLAS's needs sm_90); the GEMMs "
                    "are emulated (dequantized operands, fp32 products)", device)
    cls = _CLASSES[precision]
    patterns = precision_patterns(precision, patterns)
    matched, linears, kept = linear_targets(model, precision, patterns)
    converted, torchao_names = [], []
    for name, mod in list(model.named_modules()):
        if hasattr(mod, "set_gemm_precision"):  # an MoE layer (moe imports this module): its experts pick a format
            if any(fnmatch.fnmatchcase(name, p) for p in patterns) and mod.set_gemm_precision(precision):
                converted.append(name)
            continue
        if name not in linears:
            continue
        converted.append(name)
        if precision == "fp8" and backend == "torchao":
            torchao_names.append(name)
            continue
        new = cls.__new__(cls)
        new.__dict__ = dict(mod.__dict__)  # the same parameters, hooks and flags: only forward changes
        parent_name, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent_name) if parent_name else model, child, new)
    if not matched and not converted:
        raise ConfigError("train.precision_filter", "matches no nn.Linear of the model", list(patterns))
    if torchao_names:
        _torchao_fp8(model, torchao_names)
    if kept:
        log.warning(f"train.precision={precision}: dims not multiples of {cls.align}, these stay nn.Linear: "
                    f"{', '.join(kept)}")
    return converted
