"""Shared helpers for the op dispatchers: kernel choice and jagged <-> padded layout for references."""

from __future__ import annotations

import operator
import os
import threading

import torch
import torch.nn.functional as F

KERNELS = ("auto", "triton", "reference")
MAX_HEAD_DIM = 256  # the widest head the kernels' tiles hold
MIN_TILE_D = 16  # tl.dot needs every operand dimension >= 16 on the GPU


# Host-side integer helpers: triton.cdiv / triton.next_power_of_2 are constexpr functions that cost ~10 us a call
# on the host, and a launch path calls them several times.
def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def next_pow2(n: int) -> int:
    """Smallest power of two >= n, as triton.next_power_of_2 (0 for n <= 0)."""
    return 0 if n <= 0 else 1 << (n - 1).bit_length()


def check_head_dim(name: str, d: int) -> None:
    """One clear error for a head dim no kernel (nor, for one behaviour on every device, the references) takes."""
    if not 1 <= d <= MAX_HEAD_DIM:
        raise ValueError(f"{name} head dim must be 1..{MAX_HEAD_DIM} (got {d})")


def tile_head_dim(d: int, pow2: bool) -> int:
    """The head dim a kernel runs heads of d channels at: d itself for kernels that mask their columns (pow2=False),
    else the next power of two; at least MIN_TILE_D."""
    return max(MIN_TILE_D, next_pow2(d) if pow2 else d)


def pad_head_dim(x: torch.Tensor, width: int) -> torch.Tensor:
    """x zero-padded along its last dim to `width` channels (differentiable; x itself when already that wide).

    Zero channels in q and k leave every score q.k unchanged, zero channels in v give zero output channels that the
    caller slices off, and the padding's backward drops their gradients. The caller keeps the softmax scale of the
    real head dim."""
    return x if x.shape[-1] == width else F.pad(x, (0, width - x.shape[-1]))


def norm_window(causal: bool, window) -> tuple[int, int]:
    """The window argument of jagged_attention and gdpa -> (left, right), -1 meaning unbounded; causal folds into
    right <= 0. window: None (unbounded), an int w >= 0 (a causal left window: keys i - w .. i, right side 0) or a
    (left, right) pair whose sides are ints >= 0, or None / -1 for unbounded (other negatives raise)."""
    if window is None:
        left, right = -1, -1
    elif isinstance(window, bool):
        raise TypeError(f"window must be an int or a (left, right) pair, got {window!r}")
    elif isinstance(window, int):
        if window < 0:
            raise ValueError(f"window={window}: an int window must be >= 0")
        left, right = window, 0
    elif isinstance(window, (tuple, list)) and len(window) == 2:
        left, right = (-1 if w is None else w for w in window)
        if not all(isinstance(w, int) and not isinstance(w, bool) and w >= -1 for w in (left, right)):
            raise ValueError(f"window={window!r}: sides must be ints >= 0, or None / -1 for unbounded")
    else:
        raise TypeError(f"window must be an int or a (left, right) pair, got {window!r}")
    if causal:
        right = 0 if right < 0 else min(right, 0)
    return left, right


def clamp_window(left: int, right: int, max_len_q: int, max_len_k: int) -> tuple[int, int]:
    """Window sides cut to the widest that can bind: key j is visible to query i when i + Lk - Lq - left <= j <=
    i + Lk - Lq + right, so left >= Lk - 1 or right >= Lq - 1 never masks anything. The kernels' int32 index
    arithmetic then stays far from overflow for any window a user passes (2^31 - 1 as "unbounded" included)."""
    if left > max_len_k:
        left = max(max_len_k, 0)
    if right > max_len_q:
        right = max(max_len_q, 0)
    return left, right


def triton_interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def resolve_kernel(kernel: str, *tensors: torch.Tensor) -> str:
    """"auto" -> Triton on CUDA (or on CPU under TRITON_INTERPRET=1), else the PyTorch reference."""
    if kernel not in KERNELS:
        raise ValueError(f"kernel={kernel!r}: expected one of {KERNELS}")
    if kernel != "auto":
        if kernel == "triton" and not (all(t.is_cuda for t in tensors) or triton_interpreting()):
            raise ValueError("kernel='triton' needs CUDA tensors (or TRITON_INTERPRET=1 on CPU)")
        return kernel
    if all(t.is_cuda for t in tensors) or triton_interpreting():
        return "triton"
    return "reference"


def lengths_from_offsets(offsets: torch.Tensor) -> torch.Tensor:
    return offsets[1:] - offsets[:-1]


def jagged_to_padded(values: torch.Tensor, offsets: torch.Tensor, max_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    """[T, *rest] jagged -> ([B, max_len, *rest] zero padded, [B, max_len] bool valid mask)."""
    b = offsets.numel() - 1
    lengths = lengths_from_offsets(offsets).to(torch.long)
    pos = torch.arange(max_len, device=values.device)
    mask = pos[None, :] < lengths[:, None]
    padded = values.new_zeros((b, max_len) + tuple(values.shape[1:]))
    padded[mask] = values[: int(offsets[-1])] if values.shape[0] else values
    return padded, mask


def padded_to_jagged(padded: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return padded[mask]


def padded_rows(offsets: torch.Tensor, max_len: int, rows: int) -> torch.Tensor:
    """[rows] int64: row t of a jagged tensor sits at flat row b * max_len + (t - offsets[b]) of its
    [B * max_len] padding. Built without a host sync (unlike boolean-mask indexing), for padding on a hot path."""
    t = torch.arange(rows, device=offsets.device)
    b = torch.searchsorted(offsets[1:].to(torch.int64), t, right=True)
    return b * max_len + (t - offsets.to(torch.int64)[b])


class JaggedBatch:
    """One batch of jagged sequences: offsets [B+1] (int32 / int64, from 0) and max_len (>= every length), with the
    tables the kernels derive from them (work orders, token positions), built on first use and kept as long as the
    batch object lives.

    Build one per batch and pass it to every layer in place of the offsets tensor: the layers, and their backward,
    share its tables and its validation. A plain offsets tensor passed to an op gets the batch of its previous calls
    (kept on the tensor), so a loop over one tensor builds its tables once. Tables are dropped when the offsets (or a cross-attention partner's) are written in place (their version
    counter moves); offsets rewritten through .data, where that counter does not see it, need a new batch. A batch
    is used on one CUDA stream (its tables are ready on the stream that built them). Not cached: calls under
    torch.compile (the custom ops rebuild their tables) and during CUDA graph capture (the tables are then built
    inside the graph, so a replay rebuilds them from the offsets' new values)."""

    __slots__ = ("_checked", "_tables", "max_len", "offsets")

    def __init__(self, offsets: torch.Tensor, max_len: int):
        if isinstance(offsets, JaggedBatch):
            raise TypeError("offsets is a JaggedBatch already")
        try:
            n = operator.index(max_len)
        except TypeError:
            n = -1
        if isinstance(max_len, bool) or n < 0:
            raise ValueError(f"max_len={max_len!r}: must be an int >= 0")
        self.offsets, self.max_len = offsets, n
        self._tables: dict = {}  # partner batch (None: self) -> (partner, versions, {key: table})
        self._checked: tuple = (None, ())  # (version, ((rows, max_len), ...)) validated

    def __repr__(self) -> str:
        return f"JaggedBatch(B={self.offsets.numel() - 1}, max_len={self.max_len})"

    def tables(self, partner: JaggedBatch | None = None) -> dict | None:
        """The tables of this batch with `partner` (cross attention's other side; None or self: this batch alone),
        emptied when either side's offsets changed in place; None for tensors without a version (inference)."""
        other = None if partner is None or partner is self else partner
        try:
            versions = (self.offsets._version, other.offsets._version if other is not None else -1)
        except RuntimeError:
            return None
        hit = self._tables.get(id(other))
        if hit is None or hit[0] is not other or hit[1] != versions:
            hit = self._tables[id(other)] = (other, versions, {})
        return hit[2]


TABLES_MAX = 32  # tables kept per batch pair: (pass, tile) pairs of the tuned configs, a few masks


def as_batch(offsets, max_len, name: str = "max_len") -> JaggedBatch:
    """offsets as a JaggedBatch: itself (max_len None or the batch's), or a batch for this call made of a tensor.
    `name`: the caller's argument for max_len, in the errors."""
    if isinstance(offsets, JaggedBatch):
        if max_len is not None and max_len != offsets.max_len:
            raise ValueError(f"{name}={max_len!r} differs from the JaggedBatch's max_len={offsets.max_len}")
        return offsets
    if max_len is None:
        raise ValueError(f"{name} is needed with an offsets tensor (or pass a JaggedBatch)")
    if type(offsets) is not torch.Tensor or torch.compiler.is_compiling():
        return _new_batch(offsets, max_len, name)
    # The same offsets tensor passed call after call (a user's loop, each layer of a model) shares one batch: its
    # tables and checks follow the tensor's version counter, as a JaggedBatch the caller keeps would. Kept on the
    # tensor itself, so it goes with the tensor (a reference cycle, freed by the garbage collector).
    kept = offsets.__dict__.get("_gem_batches")
    if kept is None:
        kept = offsets.__dict__["_gem_batches"] = {}
    batch = kept.get(max_len)
    if batch is None:
        batch = kept[max_len] = _new_batch(offsets, max_len, name)
    return batch


def _new_batch(offsets, max_len, name: str) -> JaggedBatch:
    try:
        return JaggedBatch(offsets, max_len)
    except ValueError:
        raise ValueError(f"{name}={max_len!r}: must be an int >= 0") from None




# The batches of the op call running on this thread (set by gem.ops._register.KernelOp around its eager forward
# and backward): where cached() keeps what it builds.
_SCOPE = threading.local()


def cached(attr: str, offsets_a: torch.Tensor, offsets_b: torch.Tensor, key: tuple, build):
    """build() for a table kind `attr` over offsets_a (tiled side) and offsets_b (partner side), kept in the running
    call's JaggedBatch (the query side's, per key-side partner) when the call has one, so the layers of a model and
    their backward build it once. Without one (custom ops, graph capture) it is built every time."""
    pair = getattr(_SCOPE, "pair", None)
    if pair is None:
        return build()
    bq, bk = pair
    sides = []
    for t in (offsets_a, offsets_b):
        if t is bq.offsets:
            sides.append(0)
        elif t is bk.offsets:
            sides.append(1)
        else:
            return build()  # not this call's offsets (e.g. a converted copy)
    tables = bq.tables(bk)
    if tables is None:
        return build()
    full_key = (attr, *sides, *key)
    hit = tables.get(full_key)
    if hit is None:
        hit = build()
        while len(tables) >= TABLES_MAX:
            tables.pop(next(iter(tables)))  # oldest first
        tables[full_key] = hit
    return hit


def capturing(t: torch.Tensor) -> bool:
    """Whether a CUDA graph is being captured on t's device's current stream (False for CPU tensors)."""
    return t.is_cuda and torch.cuda.is_current_stream_capturing()


class batch_scope:
    """Marks the ops' eager calls with their batches (see cached); none (None) while a CUDA graph is captured."""

    __slots__ = ("pair", "prev")

    def __init__(self, pair):
        self.pair = pair

    def __enter__(self):
        self.prev = getattr(_SCOPE, "pair", None)
        _SCOPE.pair = self.pair

    def __exit__(self, *exc):
        _SCOPE.pair = self.prev


def check_offsets(name: str, offsets, rows: int, max_len: int, device: torch.device | None = None):
    """One clear error for offsets that would make a kernel read out of bounds, leave rows unwritten or silently
    drop work. offsets: a tensor, or a JaggedBatch (then checked once per version and (rows, max_len): every layer of
    a model passes the same batch).

    Shape, dtype, contiguity (the kernels read offsets with stride 1) and device are checked on the host. The
    contents (offsets[0] == 0, non-decreasing, offsets[-1] == rows, every length <= max_len) are checked on the
    CPU directly and on the GPU with asynchronous device asserts (no host sync).
    """
    batch = offsets if isinstance(offsets, JaggedBatch) else None
    if batch is not None:
        offsets = batch.offsets
    if not isinstance(offsets, torch.Tensor) or offsets.dim() != 1 or offsets.numel() < 1:
        raise ValueError(f"{name} must be a 1-D tensor [B+1]")
    if offsets.dtype not in (torch.int32, torch.int64):
        raise TypeError(f"{name} must be int32 or int64, got {offsets.dtype}")
    if offsets.numel() > 1 and offsets.stride(0) != 1:
        raise ValueError(f"{name} must be contiguous (stride {offsets.stride(0)}): the kernels read it with stride 1")
    if device is not None and offsets.device != device:
        raise ValueError(f"{name} is on {offsets.device} but the values are on {device}")
    if torch.compiler.is_compiling():
        return
    version, key = None, (int(rows), int(max_len))
    if batch is not None:
        try:
            version = offsets._version
        except RuntimeError:
            version = None
        if version is not None and batch._checked[0] == version and key in batch._checked[1]:
            return  # checked before: the common case, every layer of a model passes the same batch
    if os.environ.get("GEM_OFFSETS_CHECK", "1") == "0":
        return  # callers that validate upstream
    lengths = offsets[1:] - offsets[:-1]
    if offsets.device.type == "cpu":
        if int(offsets[0]) != 0:
            raise ValueError(f"{name} must start at 0, got {int(offsets[0])}")
        if lengths.numel() and int(lengths.min()) < 0:
            raise ValueError(f"{name} must be non-decreasing (sequence {int(lengths.argmin())} has a negative length)")
        if int(offsets[-1]) != rows:
            raise ValueError(f"{name} ends at {int(offsets[-1])} but the values have {rows} rows (offsets[-1] == T)")
        if lengths.numel() and int(lengths.max()) > max_len:
            raise ValueError(f"a sequence of {name} has {int(lengths.max())} rows, more than max_len={max_len}")
    else:  # no host sync on the GPU: the asserts fire asynchronously
        torch._assert_async(offsets[0] == 0, f"{name} must start at 0")
        torch._assert_async(offsets[-1] == rows, f"{name} must end at the {rows} rows of the values")
        if lengths.numel():
            torch._assert_async(lengths.min() >= 0, f"{name} must be non-decreasing")
            torch._assert_async(lengths.max() <= max_len, f"a sequence of {name} is longer than max_len={max_len}")
    if version is not None:
        seen = batch._checked[1] if batch._checked[0] == version else ()  # a new version: the old keys are void
        batch._checked = (version, (*seen[-3:], key))  # a few (rows, max_len) pairs, e.g. q and k sides
