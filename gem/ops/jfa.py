"""Jagged (varlen) softmax attention with optional causal / sliding-window masks.

Layout follows FlashAttention varlen (cu_seqlens): q [Tq, H, D], k/v [Tk, H_kv, D], offsets [B+1] starting at 0.
Sequence b holds rows offsets[b]:offsets[b+1]. Self attention when offsets_k is None.

Masks, with i the query position and j the key position inside one sequence, and shift = Lk - Lq
(0 for self attention; cross attention masks are bottom-right aligned as in FlashAttention):
  causal:            j <= i + shift
  window=(left, r):  i + shift - left <= j <= i + shift + r   (None or -1 = unbounded on that side)
  window=w (int):    causal left window, same as causal=True, window=(w, 0)
  HSTU (num_targets, contextual_len, max_attn_len): generative-recommenders' target-aware causal mask
                     (gem/ops/hstu_mask.py); with Lq < Lk the queries are their key sequences' last tokens
                     (the cached form: each sees its position's row of the full self-attention mask)
Rows that see no key (empty window, Lk = 0) output 0 and get zero gradient.
Any head dim 1..256 (the Triton path zero-pads heads to its next tile width: 16, 32, 64, 128 or 256).

`max_len_q` / `max_len_k` must be >= every sequence length, and the offsets must start at 0, not decrease and
end at the row count of q / k: checked on the CPU, and on the GPU by asynchronous device asserts (no host sync),
once per JaggedBatch and offsets version (gem.ops._common.check_offsets).
"""

from __future__ import annotations

import functools
import math

import torch

from gem.ops._common import (
    KERNELS,
    as_batch,
    check_head_dim,
    check_offsets,
    clamp_window,
    jagged_to_padded,
    norm_window,
    pad_head_dim,
    padded_rows,
    resolve_kernel,
    tile_head_dim,
)
from gem.ops.dispatch import call_class, choose
from gem.ops.hstu_mask import HstuMask, hstu_args, hstu_visible_mask

_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def _validate(q, k, v, batch_q, max_len_q, batch_k, max_len_k, scale):
    offsets_q, offsets_k = batch_q.offsets, None if batch_k is None else batch_k.offsets
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor) or t.dim() != 3:
            raise ValueError(f"{name} must be a 3-D tensor [T, heads, D], got {getattr(t, 'shape', type(t))}")
    if q.dtype not in _DTYPES:
        raise TypeError(f"q dtype {q.dtype} not supported: use bfloat16, float16 or float32")
    if k.dtype != q.dtype or v.dtype != q.dtype:
        raise TypeError(f"q, k, v must share one dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    if k.shape != v.shape:
        raise ValueError(f"k {tuple(k.shape)} and v {tuple(v.shape)} must have the same shape")
    if q.shape[2] != k.shape[2]:
        raise ValueError(f"head dim of q ({q.shape[2]}) and k ({k.shape[2]}) differ")
    check_head_dim("q/k/v", q.shape[2])
    if k.shape[1] == 0 or q.shape[1] % k.shape[1] != 0:
        raise ValueError(f"query heads ({q.shape[1]}) must be a multiple of key/value heads ({k.shape[1]})")
    if k.device != q.device or v.device != q.device:
        raise ValueError("q, k, v must be on one device")
    if not isinstance(max_len_q, int) or max_len_q < 0:
        raise ValueError(f"max_len_q must be an int >= 0, got {max_len_q!r}")
    check_offsets("offsets_q", batch_q, q.shape[0], max_len_q, q.device)
    if offsets_k is not None:
        if not isinstance(max_len_k, int) or max_len_k < 0:
            raise ValueError(f"max_len_k must be an int >= 0 for cross attention, got {max_len_k!r}")
        check_offsets("offsets_k", batch_k, k.shape[0], max_len_k, q.device)
        if offsets_k.numel() != offsets_q.numel():
            raise ValueError(f"offsets_q has {offsets_q.numel() - 1} sequences, offsets_k {offsets_k.numel() - 1}")
    elif k.shape[0] != q.shape[0]:
        raise ValueError(f"self attention needs as many k rows as q rows ({k.shape[0]} vs {q.shape[0]})")
    if scale is not None and not isinstance(scale, (int, float)):
        raise TypeError(f"scale must be a float, got {type(scale)}")
    if scale is not None and not (math.isfinite(scale) and scale > 0):  # the kernels scale row maxima by it
        raise ValueError(f"scale must be a finite float > 0, got {scale}")


def jagged_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    offsets_q,
    max_len_q: int | None = None,
    offsets_k=None,
    max_len_k: int | None = None,
    *,
    causal: bool = False,
    window=None,
    scale: float | None = None,
    kernel: str = "auto",
    mask_mode: str = "auto",
    num_targets: torch.Tensor | None = None,
    contextual_len: int = 0,
    max_attn_len: int | None = None,
    return_lse: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Softmax attention over jagged sequences -> [Tq, H, D] in q's dtype, or (out, lse) with return_lse.

    return_lse=True also returns each row's softmax log-sum-exp, lse[h, i] = log(sum_j exp(scale * q_i.k_j)) over
    the keys row i sees: [H, Tq] (FlashAttention varlen's layout), fp32, natural log, -inf for rows that see no key
    (FlashAttention writes +inf there). lse carries no gradient; gradients flow through out only.

    kernel: "auto" (Triton on CUDA or under TRITON_INTERPRET=1, else reference; on CUDA a torch alternative instead
    for the classes where one measured faster on this GPU, gem/ops/dispatch.py), "triton", "reference", or an
    alternative by name: "varlen" (torch's FlashAttention varlen_attn; CUDA, bf16/fp16) or "sdpa" (padded
    scaled_dot_product_attention). The alternatives take no HSTU mask and no return_lse.
    mask_mode (Triton only): "sub" loads out-of-sequence keys as zeros and subtracts their share of the softmax
    denominator (falls back to "inf" per tile when that would cancel); "inf" masks them with -inf; "auto" (the
    default) takes "inf" for sliding windows (a left window bound) and "sub" otherwise, the faster of the two on the
    H200 for each. The Triton forward loads K/V through TMA descriptors where the tensors allow it; the backward
    computes delta in a preprocessing kernel for long rows (max_len_q >= 16384) without a left window, else fuses
    it into its dQ pass (gem.ops.triton_jfa._bwd_form). The
    per-sequence work tables are kept in the call's gem.ops.JaggedBatch: pass one (offsets_q / offsets_k may be
    JaggedBatch objects, max_len_q / max_len_k then optional) to every layer of a model and they are built once
    per batch; with plain offsets tensors every call builds its own.

    num_targets ([B] int tensor: the last num_targets[b] tokens of sequence b are targets), contextual_len (the
    first tokens of every sequence are contextual) and max_attn_len (None or 0: unbounded) give
    generative-recommenders' HSTU mask (gem/ops/hstu_mask.py): causal=True and no window. With offsets_k the
    queries are the last Lq tokens of each key sequence (generative-recommenders' cached form: row i sees the full
    self-attention mask's row Lk - Lq + i; num_targets counts the key sequence's targets).
    """
    batch_q = as_batch(offsets_q, max_len_q, "max_len_q")
    batch_k = None if offsets_k is None else as_batch(offsets_k, max_len_k, "max_len_k")
    offsets_q, max_len_q = batch_q.offsets, batch_q.max_len
    if batch_k is not None:
        offsets_k, max_len_k = batch_k.offsets, batch_k.max_len
    _validate(q, k, v, batch_q, max_len_q, batch_k, max_len_k, scale)
    hstu = hstu_args(num_targets, contextual_len, max_attn_len, offsets=offsets_q if offsets_k is None else offsets_k,
                     causal=causal, window=window, device=q.device)
    if mask_mode not in ("auto", "sub", "inf"):
        raise ValueError(f"mask_mode={mask_mode!r}: expected 'auto', 'sub' or 'inf'")
    left, right = norm_window(causal, window)
    if mask_mode == "auto":
        mask_mode = "inf" if left >= 0 else "sub"
    if offsets_k is None:
        batch_k, offsets_k, max_len_k = batch_q, offsets_q, max_len_q
    left, right = clamp_window(left, right, int(max_len_q), int(max_len_k))
    default_scale = scale is None or float(scale) == 1.0 / math.sqrt(q.shape[2])
    scale = 1.0 / math.sqrt(q.shape[2]) if scale is None else float(scale)
    if kernel not in KERNELS and kernel not in _ALTERNATIVES:
        raise ValueError(f"kernel={kernel!r}: expected one of {KERNELS + tuple(_ALTERNATIVES)}")
    if kernel in _ALTERNATIVES:
        why = _unusable(kernel, q, k, hstu, return_lse, default_scale)
        if why:
            raise ValueError(f"kernel={kernel!r}: {why}")
        which = kernel
    else:
        which = resolve_kernel(kernel, q, k, v)
        if kernel == "auto" and which == "triton":
            alt = choose("jfa", q.device, lambda: call_class(left, right, max_len_q, q.shape[2], q.dtype))
            if alt != "triton" and not _unusable(alt, q, k, hstu, return_lse, default_scale):
                which = alt
    if which in _ALTERNATIVES:
        return _ALTERNATIVES[which](q, k, v, offsets_q, offsets_k, max_len_q, max_len_k, left, right, scale)
    if which == "reference":
        out = jagged_attention_reference(q, k, v, offsets_q, max_len_q, offsets_k, max_len_k,
                                         left=left, right=right, scale=scale, hstu=hstu, return_lse=return_lse)
        return (out[0], out[1].detach()) if return_lse else out
    if hstu is not None:  # the HSTU mask holds causality (and its own window)
        left, right = -1, -1
    from gem.ops.triton_jfa import jfa_triton, jfa_triton_with_lse

    d = q.shape[2]
    width = tile_head_dim(d, pow2=True)
    q, k, v = (pad_head_dim(x, width) for x in (q, k, v))
    args = (q, k, v, offsets_q, offsets_k, max_len_q, max_len_k, scale, left, right, mask_mode == "inf")
    extra = {"batches": (batch_q, batch_k)} if hstu is None else {"hstu": hstu, "batches": (batch_q, batch_k)}
    if not return_lse:
        out = jfa_triton(*args, **extra)
        return out if width == d else out[..., :d]
    out, lse = jfa_triton_with_lse(*args, **extra)
    lse = lse.masked_fill(lse == math.inf, -math.inf)  # the kernels mark rows without keys with +inf
    return out if width == d else out[..., :d], lse


# ------------------------------------------------------------------------------------ torch alternatives


def _unusable(kernel: str, q: torch.Tensor, k: torch.Tensor, hstu, return_lse: bool,
              default_scale: bool = True) -> str:
    """Why an alternative cannot run this call ("" when it can)."""
    if hstu is not None or return_lse:
        return "no HSTU mask and no return_lse here; use kernel='triton'"
    if kernel == "varlen":
        if not q.is_cuda:
            return "torch's varlen_attn needs CUDA tensors"
        if q.dtype not in (torch.bfloat16, torch.float16):
            return f"torch's varlen_attn takes bfloat16 or float16, not {q.dtype}"
        if q.shape[2] % 8:
            return f"torch's varlen_attn needs a head dim divisible by 8 (got {q.shape[2]})"
        params = _varlen_params()
        if params is None:
            return "this torch has no torch.nn.attention.varlen.varlen_attn"
        if "window_size" not in params:
            return "this torch's varlen_attn has no window_size"
        if k.shape[1] != q.shape[1] and "enable_gqa" not in params:
            return "this torch's varlen_attn has no enable_gqa (fewer key/value heads than query heads)"
        if "scale" not in params and not default_scale:
            return "this torch's varlen_attn takes no scale (only 1/sqrt(head dim))"
    return ""


@functools.cache
def _varlen_params():
    """The parameter names of this torch's varlen_attn (None without one)."""
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return None
    import inspect

    return frozenset(inspect.signature(varlen_attn).parameters)


def _varlen(q, k, v, offsets_q, offsets_k, max_len_q, max_len_k, left, right, scale):
    from torch.nn.attention.varlen import varlen_attn

    kw = {"enable_gqa": True} if k.shape[1] != q.shape[1] else {}
    if "scale" in _varlen_params():  # else _unusable made sure the scale is varlen_attn's default
        kw["scale"] = scale
    return varlen_attn(q, k, v, offsets_q.to(torch.int32), offsets_k.to(torch.int32), max_len_q, max_len_k,
                       window_size=(left, right), **kw)


def _padded_sdpa(q, k, v, offsets_q, offsets_k, max_len_q, max_len_k, left, right, scale):
    """scaled_dot_product_attention on zero-padded [B, H, N, D] tensors; rows that see no key give 0. Padding and
    unpadding index without host syncs."""
    b = offsets_q.numel() - 1
    rows_q = padded_rows(offsets_q, max_len_q, q.shape[0])
    rows_k = rows_q if offsets_k is offsets_q else padded_rows(offsets_k, max_len_k, k.shape[0])

    def pad(x, rows, n):
        return x.new_zeros((b * n,) + x.shape[1:]).index_copy(0, rows, x).view(b, n, *x.shape[1:]).transpose(1, 2)

    qp, kp, vp = pad(q, rows_q, max_len_q), pad(k, rows_k, max_len_k), pad(v, rows_k, max_len_k)
    kw = {"scale": scale, "enable_gqa": k.shape[1] != q.shape[1]}
    if offsets_k is offsets_q and left < 0 and right == 0:
        # self attention, right padding: real queries reach only real keys, so is_causal is exact (flash backend)
        out = torch.nn.functional.scaled_dot_product_attention(qp, kp, vp, is_causal=True, **kw)
    else:
        lq, lk = offsets_q[1:] - offsets_q[:-1], offsets_k[1:] - offsets_k[:-1]
        vis = visible_mask(lq, lk, max_len_q, max_len_k, left, right)[:, None]
        seen = vis.any(-1, keepdim=True)
        out = torch.nn.functional.scaled_dot_product_attention(qp, kp, vp, attn_mask=vis | ~seen, **kw)
        out = out * seen  # keyless rows attended everywhere above: zero them (and their gradients)
    return out.transpose(1, 2).reshape(b * max_len_q, *q.shape[1:]).index_select(0, rows_q)


_ALTERNATIVES = {"varlen": _varlen, "sdpa": _padded_sdpa}


def visible_mask(lq: torch.Tensor, lk: torch.Tensor, max_q: int, max_k: int, left: int, right: int) -> torch.Tensor:
    """[B, max_q, max_k] bool: key j visible to query i (bottom-right aligned windows, in-sequence only)."""
    i = torch.arange(max_q, device=lq.device)[None, :, None]
    j = torch.arange(max_k, device=lq.device)[None, None, :]
    lq = lq.long()[:, None, None]
    lk = lk.long()[:, None, None]
    ii = i + (lk - lq)
    vis = (i < lq) & (j < lk)
    if left >= 0:
        vis = vis & (j >= ii - left)
    if right >= 0:
        vis = vis & (j <= ii + right)
    return vis


def jagged_attention_reference(q, k, v, offsets_q, max_len_q, offsets_k, max_len_k, *, left=-1, right=-1,
                               scale=None, hstu: HstuMask | None = None, return_lse=False):
    """Padded PyTorch attention in fp32 (fp64 if given fp64), differentiable; output in q's dtype. hstu: the HSTU
    mask (self or cached form) in place of left / right.

    return_lse: also the rows' log-sum-exp, [H, Tq] in the compute dtype, -inf for rows that see no key."""
    scale = 1.0 / math.sqrt(q.shape[2]) if scale is None else scale
    cdt = torch.float64 if q.dtype == torch.float64 else torch.float32
    h, h_kv = q.shape[1], k.shape[1]
    lq = offsets_q[1:] - offsets_q[:-1]
    lk = offsets_k[1:] - offsets_k[:-1]
    mq = max(max_len_q, int(lq.max()) if lq.numel() else 0)
    mk = max(max_len_k, int(lk.max()) if lk.numel() else 0)
    qp, qmask = jagged_to_padded(q.to(cdt), offsets_q, mq)  # [B, Nq, H, D]
    kp, _ = jagged_to_padded(k.to(cdt), offsets_k, mk)
    vp, _ = jagged_to_padded(v.to(cdt), offsets_k, mk)
    if h_kv != h:
        kp = kp.repeat_interleave(h // h_kv, dim=2)
        vp = vp.repeat_interleave(h // h_kv, dim=2)
    s = torch.einsum("bihd,bjhd->bhij", qp, kp) * scale
    if hstu is not None:
        vis = hstu_visible_mask(lk, mk, hstu, lq, mq)[:, None]
    else:
        vis = visible_mask(lq, lk, mq, mk, left, right)[:, None]
    s = s.masked_fill(~vis, float("-inf"))
    lse = torch.logsumexp(s, dim=-1).transpose(1, 2)[qmask].T.contiguous() if return_lse else None  # [H, Tq]
    s = s.masked_fill(~vis.any(-1, keepdim=True), 0.0)
    p = torch.softmax(s, dim=-1).masked_fill(~vis, 0.0)  # rows with no visible key -> 0
    out = torch.einsum("bhij,bjhd->bihd", p, vp)[qmask].to(q.dtype)
    return (out, lse) if return_lse else out
