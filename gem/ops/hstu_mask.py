"""HSTU masks (generative-recommenders' target-aware, contextual and max-attention-length mask) for jagged self
attention, shared by gem.ops.jagged_attention and gem.ops.gdpa.

For one sequence of n tokens with t targets (its last t tokens), c contextual tokens (its first c) and a maximum
attention length m (0 or None: unbounded), each position p gets an id:

    cs = max(c - 1, 0);   last = n - t - cs;   id(p) = min(max(p - cs, 0), last)

so the c contextual tokens share id 0 and every target shares the first target's id. Key j is visible to query i
(both < n) when

    i == j,  or  0 < id(i) - id(j) <= m  (no upper bound when m is unbounded),
    or  (c > 0 and id(i) == 0 and id(j) < last)        (contextual rows see every non-target token).

The mask is causal: a query sees earlier ids only (and itself). Targets see the history and themselves, not each
other; a window counts from the first target's id; the contextual block acts as one position that later tokens see
while it lies within m of them.

Cached form (generative-recommenders' cached / "delta" HSTU attention): when the query sequence is shorter than its
key sequence (Lq < Lk), query row i is the token at position i + Lk - Lq of the key sequence (bottom-right aligned,
as FlashAttention aligns causal cross attention) and sees exactly that position's row of the full mask above, with
n = Lk and num_targets counting the key sequence's last tokens. Self attention is the case Lq = Lk. Rows at a
negative position (Lq > Lk) see no key.
"""

from __future__ import annotations

import weakref
from typing import NamedTuple

import torch
from torch.utils.weak import WeakIdKeyDictionary


class HstuMask(NamedTuple):
    """The normalised HSTU arguments of one call: num_targets an int tensor [B] on the values' device (zeros when
    none were given), contextual_len and max_attn (0 = unbounded) Python ints."""

    num_targets: torch.Tensor
    contextual_len: int
    max_attn: int


def hstu_args(num_targets, contextual_len, max_attn_len, *, offsets: torch.Tensor, causal: bool, window,
              device: torch.device) -> HstuMask | None:
    """None when no HSTU argument is given, else the checked HstuMask. offsets: the key sequences' offsets (the
    targets are their last tokens). One clear error for combinations that do not make sense: the HSTU mask is
    generative-recommenders' causal mask, so it needs causal=True and no window (max_attn_len is its window).
    Queries may be the last tokens of their key sequences (the cached form, module doc)."""
    if num_targets is None and not contextual_len and max_attn_len is None:
        return None
    if isinstance(contextual_len, bool) or not isinstance(contextual_len, int) or contextual_len < 0:
        raise ValueError(f"contextual_len must be an int >= 0 (got {contextual_len!r})")
    if max_attn_len is not None and (isinstance(max_attn_len, bool) or not isinstance(max_attn_len, int)
                                     or max_attn_len < 0):
        raise ValueError(f"max_attn_len must be None or an int >= 0, 0 = unbounded (got {max_attn_len!r})")
    if not causal:
        raise ValueError("num_targets / contextual_len / max_attn_len give the causal HSTU mask: pass causal=True "
                         "(got causal=False)")
    if window is not None:
        raise ValueError(f"window does not combine with the HSTU mask: use max_attn_len (got window={window!r})")
    nb = offsets.numel() - 1
    if num_targets is None:
        targets = torch.zeros(nb, dtype=torch.int32, device=device)
    else:
        if (not isinstance(num_targets, torch.Tensor) or num_targets.dim() != 1 or num_targets.numel() != nb
                or num_targets.dtype not in (torch.int32, torch.int64)):
            raise ValueError(f"num_targets must be an int32/int64 tensor [B] with B = {nb} sequences (got "
                             f"{getattr(num_targets, 'dtype', type(num_targets))} "
                             f"{tuple(getattr(num_targets, 'shape', ()))})")
        if num_targets.device != device:
            raise ValueError(f"num_targets is on {num_targets.device} but the values are on {device}")
        targets = num_targets.contiguous()
        if nb and not _checked_before(num_targets, offsets):
            _check_targets(targets, offsets)
            _remember(num_targets, offsets)
    return HstuMask(targets, int(contextual_len), int(max_attn_len or 0))


# num_targets tensors checked against an offsets tensor, at both versions: every layer of a model passes the same
# pair, so the check (a few kernels and an assert on the GPU) runs once per batch
_CHECKED: WeakIdKeyDictionary = WeakIdKeyDictionary()


def _versions(num_targets: torch.Tensor, offsets: torch.Tensor) -> tuple[int, int] | None:
    if torch.compiler.is_compiling():
        return None
    try:
        return num_targets._version, offsets._version
    except RuntimeError:  # inference tensors: no version, checked every call
        return None


def _checked_before(num_targets: torch.Tensor, offsets: torch.Tensor) -> bool:
    versions = _versions(num_targets, offsets)
    seen = _CHECKED.get(num_targets) if versions is not None else None
    return seen is not None and seen[0]() is offsets and seen[1] == versions


def _remember(num_targets: torch.Tensor, offsets: torch.Tensor) -> None:
    versions = _versions(num_targets, offsets)
    if versions is not None:
        _CHECKED[num_targets] = (weakref.ref(offsets), versions)


def _check_targets(targets: torch.Tensor, offsets: torch.Tensor) -> None:
    """num_targets within [0, the key sequence's length]: a ValueError on the CPU, an asynchronous device assert
    (invalid data only, no host sync) on the GPU."""
    lengths = offsets[1:] - offsets[:-1]
    if targets.device.type == "cpu" and not torch.compiler.is_compiling():
        bad = (targets < 0) | (targets > lengths)
        if bool(bad.any()):
            b = int(bad.nonzero()[0, 0])
            raise ValueError(f"num_targets[{b}] must lie in [0, length {int(lengths[b])}] (got {int(targets[b])})")
    else:
        torch._assert_async(((targets >= 0) & (targets <= lengths)).all(),
                            "num_targets must lie in [0, the key sequence's length]")


def hstu_visible_mask(lengths: torch.Tensor, max_len: int, hstu: HstuMask, lengths_q: torch.Tensor | None = None,
                      max_len_q: int | None = None) -> torch.Tensor:
    """[B, max_len_q, max_len] bool: key j visible to query row i under the HSTU mask (in-sequence positions only).
    lengths: the key sequences' lengths; lengths_q (default: lengths, self attention): the query sequences', whose
    row i sits at position i + Lk - Lq (the cached form); max_len_q defaults to max_len."""
    dev = lengths.device
    n = lengths.long()[:, None, None]
    nq = n if lengths_q is None else lengths_q.long().to(dev)[:, None, None]
    cs = max(hstu.contextual_len - 1, 0)
    last = n - hstu.num_targets.long().to(dev)[:, None, None] - cs
    row = torch.arange(max_len if max_len_q is None else max_len_q, device=dev)[None, :, None]
    i = row + (n - nq)  # the query row's position in its key sequence
    j = torch.arange(max_len, device=dev)[None, None, :]
    id_i = torch.minimum((i - cs).clamp_min(0), last)
    id_j = torch.minimum((j - cs).clamp_min(0), last)
    dist = id_i - id_j
    near = dist > 0
    if hstu.max_attn > 0:
        near = near & (dist <= hstu.max_attn)
    vis = (i == j) | near
    if hstu.contextual_len > 0:
        vis = vis | ((id_i == 0) & (id_j < last))
    return vis & (row < nq) & (i >= 0) & (j < n)
