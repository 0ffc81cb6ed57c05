"""GDPA: generalized dot-product attention, a pointwise activation in place of softmax.

    out_i = out_scale * sum_j act(scale * q_i . k_j) v_j      over the visible keys j of q_i's sequence

Jagged layout as everywhere in gem.ops: q/k [Tq|Tk, H|H_kv, D], v [Tk, H_kv, Dv] (H_kv divides H, GQA; the
value head dim Dv may differ from D, both in 1..256), offsets [B+1] starting at 0; the b-th query sequence
attends to the b-th key sequence. Empty sequences are legal (zero output rows / zero gradients). The Triton
kernels take one head width for q, k and v: they run at max(D, Dv, 16) with the narrower tensors zero-padded.

Masking: key j is visible to query i iff (causal) j <= i + (Lk - Lq), i.e. causal is bottom-right aligned
for cross attention (the last query sees every key, as FlashAttention does), and (window=(left, right))
i + (Lk - Lq) - left <= j <= i + (Lk - Lq) + right; a None or -1 side is unbounded; window=w (an int) is the
causal left window (left w, right 0), as in jagged_attention (gem.ops._common.norm_window). Invisible scores
contribute nothing (they are dropped, not set to 0 before the activation).
num_targets / contextual_len / max_attn_len replace causal / window with generative-recommenders' HSTU mask
(gem/ops/hstu_mask.py): self attention, or its cached form when queries are the last Lq < Lk tokens of their key
sequences (bottom-right aligned).

approx="poly6" swaps gelu / gelu_tanh / silu for relu(x) - p(min(|x|, c)), p a degree-6 polynomial with
p(0) = 0 and p'(0) = 1/2 (so act(0) = 0 and the derivative is continuous at 0), fitted minimax to
relu(x) - act(x) = |x| * F(-|x|) on [0, c]. It needs only FMAs (Horner), no exp/erf/tanh. The error bounds
below are measured on a dense grid in float64 and asserted by the tests; the backward uses the derivative of
the polynomial itself (so gradients are exact for the function computed).
"""

from __future__ import annotations

import torch

from gem.ops._common import (
    as_batch,
    check_head_dim,
    check_offsets,
    clamp_window,
    jagged_to_padded,
    norm_window,
    pad_head_dim,
    padded_to_jagged,
    resolve_kernel,
    tile_head_dim,
)
from gem.ops.gdpa_consts import ACTIVATIONS, APPROX, LEAKY_SLOPE, POLY6, Poly6
from gem.ops.hstu_mask import HstuMask, hstu_args, hstu_visible_mask


def poly6(x: torch.Tensor, activation: str) -> torch.Tensor:
    """The FMA-only approximation in PyTorch (reference for the kernel)."""
    p = POLY6[activation]
    t = x.abs().clamp_max(p.clamp)
    h = torch.full_like(t, p.coef[5])
    for c in reversed(p.coef[:5]):
        h = h * t + c
    return torch.relu(x) - h * t


def activation_fn(x: torch.Tensor, activation: str, approx: str | None = None) -> torch.Tensor:
    """act(x) in PyTorch; every listed activation has act(0) == 0."""
    if approx == "poly6":
        return poly6(x, activation)
    if activation == "gelu":
        return torch.nn.functional.gelu(x)
    if activation == "gelu_tanh":
        return torch.nn.functional.gelu(x, approximate="tanh")
    if activation == "silu":
        return torch.nn.functional.silu(x)
    if activation == "relu":
        return torch.relu(x)
    if activation == "relu2":
        return torch.relu(x).square()
    if activation == "leaky_relu":
        return torch.nn.functional.leaky_relu(x, LEAKY_SLOPE)
    if activation == "identity":
        return x
    raise ValueError(f"activation={activation!r}: expected one of {ACTIVATIONS}")


def _out_scale(normalize, max_len_k: int) -> float:
    if normalize is None:
        return 1.0
    if normalize == "max_len_k":
        return 1.0 / max(int(max_len_k), 1)
    if isinstance(normalize, (int, float)) and not isinstance(normalize, bool) and normalize > 0:
        return 1.0 / float(normalize)
    raise ValueError(f"normalize={normalize!r}: expected None, 'max_len_k' or a positive number")


def _check(q, k, v, offsets_q, offsets_k, activation, approx):
    if activation not in ACTIVATIONS:
        raise ValueError(f"activation={activation!r}: expected one of {ACTIVATIONS}")
    if approx is not None:
        if approx not in APPROX:
            raise ValueError(f"approx={approx!r}: expected None or one of {tuple(APPROX)}")
        if activation not in APPROX[approx]:
            raise ValueError(f"approx={approx!r} supports activations {APPROX[approx]}, not {activation!r}")
    if q.dim() != 3 or k.dim() != 3 or v.dim() != 3:
        raise ValueError(f"q, k, v must be [T, H, D]; got {tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}")
    if k.shape[:2] != v.shape[:2]:
        raise ValueError(f"k and v must have the same rows and heads: {tuple(k.shape)} vs {tuple(v.shape)}")
    if q.shape[2] != k.shape[2]:
        raise ValueError(f"head dim differs: q {q.shape[2]} vs k {k.shape[2]}")
    check_head_dim("q/k", q.shape[2])
    check_head_dim("v", v.shape[2])
    if k.shape[1] == 0 or q.shape[1] % k.shape[1]:
        raise ValueError(f"q heads ({q.shape[1]}) must be a multiple of k/v heads ({k.shape[1]})")
    if q.dtype not in (torch.float32, torch.float16, torch.bfloat16):
        raise ValueError(f"dtype {q.dtype} unsupported: expected float32, float16 or bfloat16")
    if not (q.dtype == k.dtype == v.dtype):
        raise ValueError(f"q, k, v dtypes differ: {q.dtype}, {k.dtype}, {v.dtype}")
    for name, o in (("offsets_q", offsets_q), ("offsets_k", offsets_k)):
        if o.dim() != 1 or o.dtype not in (torch.int32, torch.int64):
            raise ValueError(f"{name} must be a 1-D int32/int64 tensor, got {o.dtype} {tuple(o.shape)}")
    if offsets_q.numel() != offsets_k.numel():
        raise ValueError(
            f"offsets_q and offsets_k give different batch sizes: {offsets_q.numel() - 1} vs {offsets_k.numel() - 1}"
        )
    if offsets_q.numel() < 1:
        raise ValueError("offsets must hold at least one entry (B+1 with B >= 0)")


def gdpa_reference(q, k, v, offsets_q, max_len_q, offsets_k, max_len_k, *, activation="gelu", approx=None,
                   causal=False, window=None, scale=None, normalize=None, num_targets=None, contextual_len=0,
                   max_attn_len=None):
    """Padded fp32 PyTorch with an explicit visibility mask (masked scores are dropped after the activation)."""
    consts = _resolve(q, max_len_k, causal, window, scale, normalize)
    hstu = _hstu(q, offsets_k, causal, window, num_targets, contextual_len, max_attn_len)
    return _reference(q, k, v, offsets_q, max_len_q, offsets_k, max_len_k, activation, approx, *consts, hstu=hstu)


def _hstu(q, offsets_k, causal, window, num_targets, contextual_len, max_attn_len) -> HstuMask | None:
    """The checked HSTU arguments (gem.ops.hstu_mask), or None. Self attention and the cached form (queries the
    last tokens of their key sequences) are one mask, aligned per sequence on the device: nothing to decide here."""
    return hstu_args(num_targets, contextual_len, max_attn_len, offsets=offsets_k, causal=causal, window=window,
                     device=q.device)


def _resolve(q, max_len_k, causal, window, scale, normalize) -> tuple[int, int, float, float]:
    """(left, right, scale, out_scale) from the public options; scale defaults to 1/sqrt(D)."""
    left, right = norm_window(causal, window)
    scale = q.shape[-1] ** -0.5 if scale is None else float(scale)
    return left, right, scale, _out_scale(normalize, max_len_k)


def _reference(q, k, v, offsets_q, max_len_q, offsets_k, max_len_k, activation, approx, left, right, scale, out_scale,
               hstu: HstuMask | None = None):
    h, hk = q.shape[1], k.shape[1]
    if max_len_q == 0 or q.shape[0] == 0:
        zero = 0 * (q.sum() + k.sum() + v.sum())  # nothing visible; keeps the graph (zero grads)
        return q.new_zeros(q.shape[:2] + v.shape[2:]) + zero
    qp, mq = jagged_to_padded(q.float(), offsets_q, max_len_q)  # [B, N, H, D]
    kp, mk = jagged_to_padded(k.float(), offsets_k, max(max_len_k, 1))
    vp, _ = jagged_to_padded(v.float(), offsets_k, max(max_len_k, 1))
    if hk != h:
        kp = kp.repeat_interleave(h // hk, dim=2)
        vp = vp.repeat_interleave(h // hk, dim=2)
    s = torch.einsum("bihd,bjhd->bhij", qp, kp) * scale
    lq = mq.sum(1)
    lk = mk.sum(1)
    i = torch.arange(qp.shape[1], device=q.device)[None, :, None]
    j = torch.arange(kp.shape[1], device=q.device)[None, None, :]
    diag = i + (lk - lq)[:, None, None]  # bottom-right aligned diagonal
    vis = mq[:, :, None] & mk[:, None, :]
    if hstu is not None:
        vis = vis & hstu_visible_mask(lk, kp.shape[1], hstu, lq, qp.shape[1])
    else:
        if left >= 0:
            vis = vis & (j >= diag - left)
        if right >= 0:
            vis = vis & (j <= diag + right)
    a = torch.where(vis[:, None], activation_fn(s, activation, approx), 0.0)
    o = torch.einsum("bhij,bjhd->bihd", a, vp) * out_scale
    return padded_to_jagged(o, mq).to(q.dtype)


def gdpa(q, k, v, offsets_q, max_len_q=None, offsets_k=None, max_len_k=None, *, activation="gelu", approx=None, causal=False,
         window=None, scale=None, normalize=None, kernel="auto", ordered=True, short_kv=None, num_targets=None,
         contextual_len=0, max_attn_len=None):
    """Jagged pointwise-activation attention; returns [Tq, H, Dv] (v's head dim) in q's dtype.

    offsets_q / offsets_k: tensors [B+1], or gem.ops.JaggedBatch objects (max_len_q / max_len_k then optional),
    which keep the work tables for every layer given them (plain tensors: each call builds its own). offsets_k
    None: self attention over offsets_q.

    activation: one of ACTIVATIONS; approx: None or "poly6" (gelu / gelu_tanh / silu).
    causal / window: FlashAttention semantics, bottom-right aligned when Lq != Lk (see module doc).
    scale: defaults to 1/sqrt(D), D the q/k head dim. normalize: None, "max_len_k" (divide by max_len_k, as HSTU) or a divisor.
    kernel: "auto" | "triton" | "reference". ordered: Triton work items longest first (load balance);
    short_kv: force (True/False) the short-K/V paths (forward: whole K/V in one tile; backward: one pass per
    sequence when that tile also holds fp32 dK/dV); None picks by max_len_k and D.
    num_targets ([B] int tensor: the last num_targets[b] tokens of sequence b are targets), contextual_len (the
    first tokens of every sequence are contextual) and max_attn_len (None or 0: unbounded) give
    generative-recommenders' HSTU mask (gem/ops/hstu_mask.py): causal=True, no window; self attention, or the
    cached form where each query sequence is the last Lq tokens of its key sequence (row i sees the full mask's row
    Lk - Lq + i; num_targets counts the key sequence's targets). HSTU itself is activation="silu",
    normalize="max_len_k".
    """
    batch_q = as_batch(offsets_q, max_len_q, "max_len_q")
    batch_k = batch_q if offsets_k is None else as_batch(offsets_k, max_len_k, "max_len_k")
    offsets_q, offsets_k = batch_q.offsets, batch_k.offsets
    _check(q, k, v, offsets_q, offsets_k, activation, approx)
    lengths = (batch_q.max_len, batch_k.max_len)
    consts = _resolve(q, lengths[1], causal, window, scale, normalize)
    check_offsets("offsets_q", batch_q, q.shape[0], lengths[0], q.device)
    if batch_k is not batch_q or k.shape[0] != q.shape[0]:
        check_offsets("offsets_k", batch_k, k.shape[0], lengths[1], q.device)
    hstu = _hstu(q, offsets_k, causal, window, num_targets, contextual_len, max_attn_len)
    consts = (*clamp_window(consts[0], consts[1], *lengths), *consts[2:])
    if resolve_kernel(kernel, q, k, v, offsets_q, offsets_k) == "reference":
        return _reference(q, k, v, offsets_q, lengths[0], offsets_k, lengths[1], activation, approx, *consts,
                          hstu=hstu)
    from gem.ops import triton_gdpa

    dv = v.shape[2]
    width = tile_head_dim(max(q.shape[2], dv), pow2=False)  # the kernels mask columns past D, not past 16
    q, k, v = (pad_head_dim(x, width) for x in (q, k, v))
    short = -1 if short_kv is None else int(bool(short_kv))
    out = triton_gdpa.gdpa_op(
        q, k, v, offsets_q, offsets_k, *lengths, activation, approx or "", *consts, bool(ordered), short,
        *triton_gdpa.hstu_launch_args(hstu, offsets_q), batches=(batch_q, batch_k)
    )
    return out if width == dv else out[..., :dv]


__all__ = ["ACTIVATIONS", "APPROX", "LEAKY_SLOPE", "POLY6", "Poly6", "activation_fn", "gdpa", "gdpa_reference",
           "poly6"]
