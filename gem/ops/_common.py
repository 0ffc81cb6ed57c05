"""Shared helpers for the op dispatchers: kernel choice and jagged <-> padded layout for references."""

from __future__ import annotations

import os

import torch

KERNELS = ("auto", "triton", "reference")


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
