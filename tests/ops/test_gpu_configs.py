"""Every (op, dtype, head dim, mask) launches on the GPU: where the tuned tiles do not fit the device's shared memory
(fp32 at wide heads) the resource estimate picks smaller ones (gem.ops._tune.fitting), and the result still matches
the reference, forward and backward."""

from __future__ import annotations

import pytest
import torch

from gem.ops import block_attention, gdpa, jagged_attention
from gem.ops._common import triton_interpreting

pytestmark = pytest.mark.gpu

DTYPES = (torch.float32, torch.bfloat16, torch.float16)
HEAD_DIMS = (16, 40, 64, 96, 128, 192, 256)
LENGTHS = [256, 1, 0, 77, 200]


def _need_gpu(monkeypatch):
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    if triton_interpreting():
        pytest.skip("TRITON_INTERPRET=1 is set: run the GPU tests with TRITON_INTERPRET=0")
    monkeypatch.setenv("GEM_AUTOTUNE", "0")  # the first config that fits and launches: one compile per key


def _offsets(lengths):
    return torch.nn.functional.pad(torch.tensor(lengths).cumsum(0), (1, 0)).cuda()


def _forms():
    off = _offsets(LENGTHS)
    n = max(LENGTHS)
    cached = [4, 1, 2, 77, 9]
    off_q, nq = _offsets(cached), max(cached)
    targets = torch.tensor([3, 0, 0, 5, 20], device="cuda")
    hstu = {"causal": True, "num_targets": targets, "contextual_len": 2, "max_attn_len": 64}
    gd = {"activation": "silu", "normalize": "max_len_k"}
    return {
        "jfa-causal": (False, lambda q, k, v, kern: jagged_attention(q, k, v, off, n, causal=True, kernel=kern)),
        "jfa-window": (False, lambda q, k, v, kern: jagged_attention(q, k, v, off, n, window=(30, 5), kernel=kern)),
        "jfa-hstu-cached": (True, lambda q, k, v, kern: jagged_attention(q, k, v, off_q, nq, off, n, kernel=kern,
                                                                         **hstu)),
        "gdpa-hstu": (False, lambda q, k, v, kern: gdpa(q, k, v, off, n, off, n, kernel=kern, **gd, **hstu)),
        "gdpa-hstu-tiled": (False, lambda q, k, v, kern: gdpa(q, k, v, off, n, off, n, kernel=kern, short_kv=False,
                                                              **gd, **hstu)),
        "gdpa-hstu-cached": (True, lambda q, k, v, kern: gdpa(q, k, v, off_q, nq, off, n, kernel=kern, **gd,
                                                              **hstu)),
        "gdpa-full": (False, lambda q, k, v, kern: gdpa(q, k, v, off, n, off, n, kernel=kern, activation="gelu")),
        "block": (False, lambda q, k, v, kern: block_attention(q, k, v, off, n, block_size=64, kernel=kern)),
    }, sum(cached)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("d", HEAD_DIMS)
def test_every_form_launches_and_matches(d, dtype, monkeypatch):
    _need_gpu(monkeypatch)
    forms, cached_rows = _forms()
    g = torch.Generator(device="cuda").manual_seed(d)
    failures = []
    for name, (cached, fn) in forms.items():
        rows = cached_rows if cached else sum(LENGTHS)
        q = torch.randn(rows, 2, d, generator=g, device="cuda").to(dtype).requires_grad_()
        k, v = (torch.randn(sum(LENGTHS), 1, d, generator=g, device="cuda").to(dtype).requires_grad_()
                for _ in range(2))
        out = fn(q, k, v, "triton")
        dout = torch.randn(out.shape, generator=g, device="cuda").to(dtype)
        got = (out, *torch.autograd.grad(out, (q, k, v), dout))
        q32, k32, v32 = (x.detach().float().requires_grad_() for x in (q, k, v))
        ref = fn(q32, k32, v32, "reference")
        want = (ref, *torch.autograd.grad(ref, (q32, k32, v32), dout.float()))
        tol = 2e-3 if dtype == torch.float32 else 3e-2
        for what, a, b in zip(("out", "dq", "dk", "dv"), got, want):
            err = (a.float() - b).abs().max().item() if a.numel() else 0.0
            if not err <= tol * max(1.0, b.abs().max().item()):
                failures.append(f"{name} {what}: max error {err:.3e}")
    torch.cuda.synchronize()
    assert not failures, failures
