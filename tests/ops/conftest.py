"""Shared pieces of the kernel tests: jagged inputs and the error-bound rule.

Import the helpers (`from tests.ops.conftest import jagged_inputs, offsets, assert_within`).
"""

from __future__ import annotations

import torch


def offsets(lengths, device="cpu", dtype=torch.int32) -> torch.Tensor:
    """[B + 1] offsets of jagged sequences with these lengths (0 first)."""
    out = torch.zeros(len(lengths) + 1, dtype=torch.int64)
    if len(lengths):
        out[1:] = torch.tensor(list(lengths), dtype=torch.int64).cumsum(0)
    return out.to(device=device, dtype=dtype)


def jagged_inputs(lengths, heads, d, dtype=torch.float32, *, seed=0, device="cpu", lengths_k=None,
                  kv_heads=None, grad_out=True):
    """Random q [T, heads, d], k and v [T_k, kv_heads, d] (T_k from `lengths_k`, default the q lengths), an
    upstream gradient like q (None when `grad_out` is false) and the offsets of q's and k's lengths. Drawn in fp32
    from one seeded generator, then cast: the same values at every dtype and device."""
    g = torch.Generator().manual_seed(seed)
    lengths_k = lengths if lengths_k is None else lengths_k
    kv_heads = heads if kv_heads is None else kv_heads

    def draw(t, h):
        return torch.randn(t, h, d, generator=g).to(device=device, dtype=dtype)

    q, k, v = draw(sum(lengths), heads), draw(sum(lengths_k), kv_heads), draw(sum(lengths_k), kv_heads)
    do = draw(sum(lengths), heads) if grad_out else None
    return q, k, v, do, offsets(lengths, device), offsets(lengths_k, device)


def assert_within(got: torch.Tensor, want: torch.Tensor, atol: float, rtol: float, what: str = "") -> None:
    """The error-bound rule of the kernel tests: max |got - want| <= atol + rtol * max |want| (a bound on the
    whole tensor, relative to its largest entry, so near-zero entries do not need their own relative bound)."""
    assert got.shape == want.shape, f"{what}: shape {tuple(got.shape)} != {tuple(want.shape)}"
    assert torch.isfinite(got).all(), f"{what}: non-finite values"
    err = (got.double() - want.double()).abs().max().item() if got.numel() else 0.0
    bound = atol + rtol * (want.double().abs().max().item() if want.numel() else 0.0)
    assert err <= bound, f"{what}: max abs error {err:.3g} > {bound:.3g}"
