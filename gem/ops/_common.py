"""Shared helpers for the op dispatchers: kernel choice and jagged <-> padded layout for references."""

from __future__ import annotations

import contextlib
import os
import threading
import weakref

import torch
import torch.nn.functional as F
from torch.utils.weak import WeakIdKeyDictionary

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


OFFSETS_CACHE_MAX = 16  # entries per offsets tensor and table kind: (pass, block) pairs of the tuned configs

# Per-offsets caches live here, not on the tensors: a tensor's __dict__ travels with pickle / deepcopy (and a
# weak reference cannot be pickled). Entries die with their offsets tensor.
_TABLES: WeakIdKeyDictionary = WeakIdKeyDictionary()
_CHECKED: WeakIdKeyDictionary = WeakIdKeyDictionary()
_EAGER = threading.local()


@contextlib.contextmanager
def eager_tables():
    """Marks an eager autograd call of an op: only there are per-offsets tables cached (offsets_cached). The custom
    ops, which torch.compile graphs and CUDA-graph trees run from private streams and memory pools, rebuild them."""
    prev = getattr(_EAGER, "on", False)
    _EAGER.on = True
    try:
        yield
    finally:
        _EAGER.on = prev


def offsets_cached(attr: str, offsets_a: torch.Tensor, offsets_b: torch.Tensor, key: tuple, build):
    """build(), computed once per pair of offsets tensors (for an op's table kind `attr`).

    Every layer of a model, and its backward, gets the same offsets tensors, so per-batch tables (work orders,
    tile counts) are built once. A hit needs the same two objects at the same _version (an in-place write
    misses) on the same CUDA stream. Cached only in eager calls (eager_tables); not while compiling, during CUDA
    graph capture (a hit would freeze the table into the graph) or for inference tensors (no version). Offsets
    rewritten where the version counter does not see it (through .data) must be passed as a new tensor.
    """
    if not getattr(_EAGER, "on", False) or torch.compiler.is_compiling():
        return build()
    stream = None
    if offsets_a.is_cuda:
        if torch.cuda.is_current_stream_capturing():
            return build()
        stream = torch.cuda.current_stream(offsets_a.device).cuda_stream  # a table is ready on its own stream only
    try:
        versions = (offsets_a._version, offsets_b._version)
    except RuntimeError:
        return build()
    kinds = _TABLES.get(offsets_a)
    if kinds is None:
        kinds = _TABLES[offsets_a] = {}
    cache = kinds.setdefault(attr, {})
    full_key = (id(offsets_b), stream) + tuple(key)
    hit = cache.get(full_key)
    # a weak reference: offsets_b may be offsets_a itself, and a dead one never matches a new tensor of equal id
    if hit is not None and hit[0]() is offsets_b and hit[1] == versions:
        return hit[2]
    value = build()
    cache.pop(full_key, None)
    while len(cache) >= OFFSETS_CACHE_MAX:
        cache.pop(next(iter(cache)))  # oldest first
    cache[full_key] = (weakref.ref(offsets_b), versions, value)
    return value


def cached_tables(offsets: torch.Tensor, attr: str) -> dict:
    """The cache entries of one table kind for an offsets tensor (for tests and debugging)."""
    return _TABLES.get(offsets, {}).get(attr, {})


def check_offsets(name: str, offsets: torch.Tensor, rows: int, max_len: int, device: torch.device | None = None):
    """One clear error for offsets that would make a kernel read out of bounds, leave rows unwritten or silently
    drop work.

    Shape, dtype, contiguity (the kernels read offsets with stride 1) and device are checked on the host. The
    contents (offsets[0] == 0, non-decreasing, offsets[-1] == rows, every length <= max_len) are checked on the
    CPU directly and on the GPU with asynchronous device asserts (no host sync). Done once per offsets tensor,
    version and (rows, max_len): every layer of a model passes the same offsets. (Inference tensors have no
    version: checked every time.)
    """
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
    try:
        version = offsets._version
    except RuntimeError:
        version = None
    key = (version, int(rows), int(max_len))
    seen = _CHECKED.get(offsets) if version is not None else None
    if seen is not None and key in seen:
        return  # checked before: the common case, every layer of a model passes the same offsets
    if os.environ.get("GEM_OFFSETS_CHECK", "1") == "0":
        return  # callers that validate upstream (inference tensors are checked every call)
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
        if seen is None or seen[0][0] != version:  # a new version: the old keys are void
            seen = _CHECKED[offsets] = []
        seen.append(key)
        del seen[:-4]  # a few (rows, max_len) pairs per tensor, e.g. q and k sides
