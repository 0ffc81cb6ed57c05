"""Low-precision GEMMs for the dense tower: `train.precision` bf16 | fp8 | mxfp8 and the modules it converts.

`apply_precision(model, precision, device, patterns)` swaps the nn.Linear modules whose names match one of the
fnmatch `patterns` for a Linear of the same shape that shares their parameters (names `weight` / `bias`
unchanged, so checkpoints and FSDP see the same model):

- mxfp8 (emulated, any device): every GEMM operand is MX-quantized (gem.ops.mx, blocks of 32 along that GEMM's
  reduction axis) and dequantized, then multiplied in the compute dtype. Forward: E4M3 input and weight. Backward:
  the quantization passes straight through; the output gradient is quantized to E5M2 and the weight / input to
  E4M3, each along the reduction axis of its backward GEMM, as MX hardware needs them. Layers whose in or out
  features are not multiples of 32 stay nn.Linear.
- fp8 (CUDA sm_89+): torch._scaled_mm with row-wise scales (per token for activations, per output channel for
  weights, amax / fp8 max in fp32), E4M3 forward, E5M2 gradients (their range, not their precision, is what
  row-wise scaling leaves short). Layers whose dims are not multiples of 16 stay nn.Linear.
- bf16: nothing changes (autocast decides the GEMM dtype as before).
"""

from __future__ import annotations

import fnmatch
import logging
from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from gem._config import ConfigError
from gem.ops import mx

__all__ = ["DEFAULT_FILTER", "PRECISIONS", "FP8Linear", "MXFP8Linear", "apply_precision", "check_precision_device"]

log = logging.getLogger("gem.model")

PRECISIONS = ("bf16", "fp8", "mxfp8")
# The tower's attention projections and dense FFNs; heads, routers, embedding-side and small layers stay bf16.
DEFAULT_FILTER = ("blocks.*.attn.qkv", "blocks.*.attn.out", "blocks.*.ffn.w1", "blocks.*.ffn.w2", "blocks.*.ffn.w3")
MX_BLOCK = 32
_FP8_ALIGN = 16  # torch._scaled_mm wants the GEMM dims in multiples of 16


def fp8_supported(device: torch.device) -> bool:
    return device.type == "cuda" and torch.cuda.get_device_capability(device) >= (8, 9)


def check_precision_device(precision: str, device: torch.device) -> None:
    """One-line ConfigError when `precision` cannot run on `device` (fp8 needs FP8 tensor cores)."""
    device = torch.device(device)
    if precision == "fp8" and not fp8_supported(device):
        where = "cpu" if device.type != "cuda" else "sm_%d%d" % torch.cuda.get_device_capability(device)
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


# ---------------------------------------------------------------------------------------------------- mxfp8


def mx_fake_quant(t: torch.Tensor, elem: str, axis: int, dtype: torch.dtype) -> torch.Tensor:
    """t MX-quantized in blocks of 32 along `axis` and dequantized to `dtype` (exact: an fp8 value times a power
    of two fits bf16 / fp32)."""
    kernel = "auto" if t.is_cuda else "reference"  # the Triton interpreter would be far too slow on CPU
    data, scale = mx.quantize(t, block=MX_BLOCK, elem=elem, axis=axis, kernel=kernel)
    return mx.dequantize(data, scale, block=MX_BLOCK, axis=axis, dtype=dtype, kernel=kernel)


class _MXLinearFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, dtype):
        x2 = _flat(x)
        y = mx_fake_quant(x2, "e4m3", -1, dtype) @ mx_fake_quant(weight, "e4m3", 1, dtype).t()
        if bias is not None:
            y = y + bias.to(dtype)
        ctx.save_for_backward(x2, weight)
        ctx.dtype, ctx.x_shape, ctx.x_dtype, ctx.has_bias = dtype, x.shape, x.dtype, bias is not None
        return y.reshape(*x.shape[:-1], weight.shape[0])

    @staticmethod
    def backward(ctx, gy):
        x2, weight = ctx.saved_tensors
        dt = ctx.dtype
        g = _flat(gy)
        dx = dw = db = None
        if ctx.needs_input_grad[0]:  # dx = g @ W, reduction over out_features
            dx = mx_fake_quant(g, "e5m2", -1, dt) @ mx_fake_quant(weight, "e4m3", 0, dt)
            dx = dx.reshape(ctx.x_shape).to(ctx.x_dtype)
        if ctx.needs_input_grad[1]:  # dW = g^T @ x, reduction over tokens
            dw = (mx_fake_quant(g, "e5m2", 0, dt).t() @ mx_fake_quant(x2, "e4m3", 0, dt)).to(weight.dtype)
        if ctx.has_bias and ctx.needs_input_grad[2]:
            db = g.sum(0)
        return dx, dw, db, None


class MXFP8Linear(nn.Linear):
    """nn.Linear with emulated MXFP8 GEMMs (see the module docstring); same parameters, same state dict."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = _compute_dtype(x)
        with torch.autocast(x.device.type, enabled=False):
            return _MXLinearFn.apply(x, self.weight, self.bias, dtype)


# ---------------------------------------------------------------------------------------------------- fp8


def _fp8_rows(t: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Row-wise fp8: (t / s as dtype, s [rows, 1] fp32) with s = amax(row) / fp8 max."""
    fmax = torch.finfo(dtype).max
    s = t.abs().amax(-1, keepdim=True).float().clamp_min(1e-12) / fmax
    return (t.float() / s).clamp(-fmax, fmax).to(dtype).contiguous(), s


def _scaled_mm(a: torch.Tensor, a_dtype, b_t: torch.Tensor, b_dtype, out_dtype) -> torch.Tensor:
    """a [M, K] @ b_t [N, K]^T with both operands row-wise scaled along K (row-wise scaling writes bf16)."""
    qa, sa = _fp8_rows(a, a_dtype)
    qb, sb = _fp8_rows(b_t, b_dtype)
    return torch._scaled_mm(qa, qb.t(), scale_a=sa, scale_b=sb.reshape(1, -1), out_dtype=out_dtype)


class _FP8LinearFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, dtype):
        x2 = _flat(x)
        y = _scaled_mm(x2, torch.float8_e4m3fn, weight, torch.float8_e4m3fn, dtype)
        if bias is not None:
            y = y + bias.to(dtype)
        ctx.save_for_backward(x2, weight)
        ctx.dtype, ctx.x_shape, ctx.x_dtype, ctx.has_bias = dtype, x.shape, x.dtype, bias is not None
        return y.reshape(*x.shape[:-1], weight.shape[0])

    @staticmethod
    def backward(ctx, gy):
        x2, weight = ctx.saved_tensors
        g = _flat(gy)
        dx = dw = db = None
        if ctx.needs_input_grad[0]:  # g [M, N] @ W [N, K]: scales per token of g, per input channel of W
            dx = _scaled_mm(g, torch.float8_e5m2, weight.t(), torch.float8_e4m3fn, ctx.dtype)
            dx = dx.reshape(ctx.x_shape).to(ctx.x_dtype)
        if ctx.needs_input_grad[1]:  # g^T [N, M] @ x [M, K]; tokens padded to a multiple of 16 (zeros add 0)
            pad = -g.shape[0] % _FP8_ALIGN
            gt, xt = F.pad(g, (0, 0, 0, pad)).t(), F.pad(x2, (0, 0, 0, pad)).t()
            dw = _scaled_mm(gt, torch.float8_e5m2, xt, torch.float8_e4m3fn, ctx.dtype).to(weight.dtype)
        if ctx.has_bias and ctx.needs_input_grad[2]:
            db = g.sum(0)
        return dx, dw, db, None


class FP8Linear(nn.Linear):
    """nn.Linear with row-wise scaled FP8 GEMMs through torch._scaled_mm (CUDA sm_89+); same parameters."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = _compute_dtype(x)
        if dtype == torch.float32:
            dtype = torch.bfloat16  # row-wise _scaled_mm writes bf16
        with torch.autocast(x.device.type, enabled=False):
            y = _FP8LinearFn.apply(x, self.weight, self.bias, dtype)
        return y if torch.is_autocast_enabled(x.device.type) else y.to(x.dtype)


# ---------------------------------------------------------------------------------------------------- conversion

_CLASSES = {"mxfp8": (MXFP8Linear, MX_BLOCK), "fp8": (FP8Linear, _FP8_ALIGN)}


def apply_precision(model: nn.Module, precision: str, device: torch.device | str,
                    patterns: Sequence[str] = DEFAULT_FILTER) -> list[str]:
    """Convert the nn.Linear modules of `model` named by `patterns` to `precision`'s Linear, in place, sharing
    their parameters; returns the converted names. Call it after construction, before parallelize."""
    if precision not in PRECISIONS:
        raise ConfigError("train.precision", f"must be one of {', '.join(PRECISIONS)}", precision)
    check_precision_device(precision, torch.device(device))
    if precision == "bf16":
        return []
    cls, align = _CLASSES[precision]
    matched, converted, kept = [], [], []
    for name, mod in list(model.named_modules()):
        if type(mod) is not nn.Linear or not any(fnmatch.fnmatchcase(name, p) for p in patterns):
            continue
        matched.append(name)
        if mod.in_features % align or mod.out_features % align:
            kept.append(f"{name} ({mod.in_features}->{mod.out_features})")
            continue
        new = cls.__new__(cls)
        new.__dict__ = dict(mod.__dict__)  # the same parameters, hooks and flags: only forward changes
        parent_name, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent_name) if parent_name else model, child, new)
        converted.append(name)
    if not matched:
        raise ConfigError("train.precision_filter", "matches no nn.Linear of the model", list(patterns))
    if kept:
        log.warning(f"train.precision={precision}: dims not multiples of {align}, these stay bf16: {', '.join(kept)}")
    return converted
