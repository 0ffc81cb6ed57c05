"""Head dims outside the kernels' tile widths, gdpa's value head dim, jagged_attention's lse: Triton (interpreted on
CPU) against the PyTorch references, forward and backward; the gpu-marked copies run the same checks on CUDA in bf16
(fp32 kernels lower their dots to FMA loops that take ptxas minutes each)."""

from __future__ import annotations

import math

import pytest
import torch

from gem.ops._common import triton_interpreting
from gem.ops.block import block_attention
from gem.ops.gdpa import gdpa, gdpa_reference
from gem.ops.jfa import jagged_attention
from gem.ops.rotary import RopeConfig

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]
HEAD_DIMS = [40, 59, 80, 96, 8]  # FlashAttention's odd widths, and one under the 16-wide tile
TOL = 2e-4  # fp32, relative to the largest reference value (at least 1)
BF16_TOL = 1e-2  # added to twice the bf16 reference's own error (FlashAttention's test rule)


@pytest.fixture
def device(request):
    dev = request.param
    if dev == "cuda":
        if not torch.cuda.is_available():
            pytest.skip("needs CUDA")
        if triton_interpreting():
            pytest.skip("TRITON_INTERPRET=1 is set: run the GPU tests with TRITON_INTERPRET=0")
    return dev


def _offsets(lengths, device):
    return torch.tensor([0] + torch.tensor(lengths).cumsum(0).tolist(), dtype=torch.int64, device=device)


def _randn(g, device, *shape):
    return torch.randn(*shape, generator=g).to(device).requires_grad_()


def _fwd_bwd(fn, q, k, v, seed=1):
    """(out, dq, dk, dv) of fn(q, k, v) for a random upstream gradient (the same for every fn of one shape)."""
    out = fn(q, k, v)
    g = torch.randn(out.shape, generator=torch.Generator().manual_seed(seed)).to(out)
    return (out, *torch.autograd.grad(out, (q, k, v), g))


def _max_err(a, b):
    return (a.double() - b.double()).abs().max().item() if a.numel() else 0.0


def _assert_close(got, want, names=("out", "dq", "dk", "dv"), base=None):
    """got within TOL of want; with base (the reference run in got's low precision), within twice base's error."""
    for i, (name, a, b) in enumerate(zip(names, got, want)):
        assert a.shape == b.shape, f"{name}: shape {tuple(a.shape)} != {tuple(b.shape)}"
        assert torch.isfinite(a).all(), f"{name} has non-finite values"
        scale = max(1.0, b.abs().max().item() if b.numel() else 0.0)
        bound = TOL * scale if base is None else 2 * _max_err(base[i], b) + BF16_TOL * scale
        err = _max_err(a, b)
        assert err <= bound, f"{name}: max error {err:.3e} > {bound:.3e}"


def _triton_vs_reference(op, q, k, v):
    triton = lambda a, b, c: op(a, b, c, kernel="triton")
    reference = lambda a, b, c: op(a, b, c, kernel="reference")
    if q.device.type != "cuda":
        got = _fwd_bwd(triton, q, k, v)
        _assert_close(got, _fwd_bwd(reference, q, k, v))
        return got
    low = [x.detach().bfloat16().requires_grad_() for x in (q, k, v)]
    high = [x.detach().float().requires_grad_() for x in low]
    got = _fwd_bwd(triton, *low)
    _assert_close(got, _fwd_bwd(reference, *high), base=_fwd_bwd(reference, *low))
    return got


# ------------------------------------------------------------------------------------------- head dims


@pytest.mark.parametrize("device", DEVICES, indirect=True)
@pytest.mark.parametrize("d", HEAD_DIMS)
@pytest.mark.parametrize("causal,window", [(False, None), (True, None), (False, (5, 3))])
def test_jagged_attention_any_head_dim(d, causal, window, device):
    g = torch.Generator().manual_seed(d)
    lens_q, lens_k = [5, 0, 17, 1], [9, 3, 20, 1]
    q, k, v = _randn(g, device, 23, 2, d), _randn(g, device, 33, 1, d), _randn(g, device, 33, 1, d)
    oq, ok = _offsets(lens_q, device), _offsets(lens_k, device)
    out, *_ = _triton_vs_reference(
        lambda a, b, c, kernel: jagged_attention(a, b, c, oq, 17, ok, 20, causal=causal, window=window,
                                                 kernel=kernel), q, k, v)
    assert out.shape == (23, 2, d)


@pytest.mark.parametrize("device", DEVICES, indirect=True)
@pytest.mark.parametrize("d,rope", [
    (40, RopeConfig()),  # NeoX halves over all 40 channels
    (59, None),
    (80, RopeConfig(rotary_dim=32, interleaved=True)),
    (96, None),
    (10, RopeConfig(interleaved=True)),  # zero-padded to 16: the rotation stays on the 10 real channels
    (12, RopeConfig(rotary_dim=8)),  # padded, with pass-through channels before the padding
    (7, None),
])
def test_block_attention_any_head_dim(d, rope, device):
    g = torch.Generator().manual_seed(d)
    lens = [13, 0, 22]
    q, k, v = _randn(g, device, 35, 2, d), _randn(g, device, 35, 1, d), _randn(g, device, 35, 1, d)
    off = _offsets(lens, device)
    _triton_vs_reference(
        lambda a, b, c, kernel: block_attention(a, b, c, off, 22, block_size=8, rope=rope, kernel=kernel), q, k, v)


@pytest.mark.parametrize("device", DEVICES, indirect=True)
@pytest.mark.parametrize("d", HEAD_DIMS)
def test_gdpa_any_head_dim(d, device):
    g = torch.Generator().manual_seed(d)
    lens_q, lens_k = [6, 0, 17], [9, 4, 20]
    q, k, v = _randn(g, device, 23, 2, d), _randn(g, device, 33, 1, d), _randn(g, device, 33, 1, d)
    oq, ok = _offsets(lens_q, device), _offsets(lens_k, device)
    _triton_vs_reference(
        lambda a, b, c, kernel: gdpa(a, b, c, oq, 17, ok, 20, causal=True, kernel=kernel), q, k, v)


# ------------------------------------------------------------------------------------------- gdpa value head dim


@pytest.mark.parametrize("device", DEVICES, indirect=True)
@pytest.mark.parametrize("d,dv,short_kv", [(32, 48, None), (64, 24, False), (40, 8, True), (16, 59, True)])
def test_gdpa_value_head_dim(d, dv, short_kv, device):
    g = torch.Generator().manual_seed(d + dv)
    lens_q, lens_k = [6, 0, 17], [9, 4, 20]
    q, k, v = _randn(g, device, 23, 2, d), _randn(g, device, 33, 1, d), _randn(g, device, 33, 1, dv)
    oq, ok = _offsets(lens_q, device), _offsets(lens_k, device)
    kw = {"activation": "silu", "window": (6, 2), "normalize": "max_len_k"}
    out, *grads = _triton_vs_reference(
        lambda a, b, c, kernel: gdpa(a, b, c, oq, 17, ok, 20, kernel=kernel,
                                     **({"short_kv": short_kv} if kernel == "triton" else {}), **kw), q, k, v)
    assert out.shape == (23, 2, dv) and [x.shape for x in grads] == [q.shape, k.shape, v.shape]
    # the reference itself: the output is linear in v, so each group of d value channels gives the output of an
    # equal-dims call on those channels alone
    ref = gdpa_reference(q, k, v, oq, 17, ok, 20, **kw)
    for c in range(0, dv, d):
        part = gdpa_reference(q, k, v[..., c:c + d], oq, 17, ok, 20, **kw)
        torch.testing.assert_close(ref[..., c:c + d], part)


# ------------------------------------------------------------------------------------------- lse


def _lse_want(q, k, offsets_q, offsets_k, scale, causal, window):
    """[H, Tq] float64 log-sum-exp over each row's visible keys, written out per row (-inf with none visible)."""
    h, group = q.shape[1], q.shape[1] // k.shape[1]
    want = torch.full((h, q.shape[0]), -math.inf, dtype=torch.float64)
    q64, k64 = q.detach().double().cpu(), k.detach().double().cpu()
    for b in range(offsets_q.numel() - 1):
        q0, k0 = int(offsets_q[b]), int(offsets_k[b])
        lq, lk = int(offsets_q[b + 1]) - q0, int(offsets_k[b + 1]) - k0
        for i in range(lq):
            diag = i + lk - lq  # bottom-right aligned
            lo = 0 if window is None or window[0] is None else max(diag - window[0], 0)
            hi = lk - 1
            if causal:
                hi = min(hi, diag)
            if window is not None and window[1] is not None:
                hi = min(hi, diag + window[1])
            if hi < lo:
                continue
            for hd in range(h):
                s = k64[k0 + lo:k0 + hi + 1, hd // group] @ q64[q0 + i, hd] * scale
                want[hd, q0 + i] = torch.logsumexp(s, 0)
    return want


@pytest.mark.parametrize("kernel,device", [("triton", "cpu"), ("reference", "cpu"),
                                           pytest.param("triton", "cuda", marks=pytest.mark.gpu)], indirect=["device"])
@pytest.mark.parametrize("d,causal,window", [(16, True, None), (40, False, (4, 2)), (64, False, None)])
def test_return_lse(kernel, d, causal, window, device):
    g = torch.Generator().manual_seed(d)
    # an empty query sequence, one with no keys, and (causal, Lk < Lq) leading rows that see no key
    lens_q, lens_k = [4, 0, 6, 17], [0, 3, 3, 20]
    q, k, v = _randn(g, device, 27, 4, d), _randn(g, device, 26, 2, d), _randn(g, device, 26, 2, d)
    if device == "cuda":  # bf16 inputs (see the module docstring); products of bf16 are exact in the fp32 scores
        q, k, v = (x.detach().bfloat16().requires_grad_() for x in (q, k, v))
    tol = 1e-5 if q.dtype == torch.float32 else 1e-3
    oq, ok = _offsets(lens_q, device), _offsets(lens_k, device)
    kw = {"causal": causal, "window": window, "kernel": kernel}
    _, lse = jagged_attention(q, k, v, oq, 17, ok, 20, return_lse=True, **kw)
    assert lse.shape == (4, 27) and lse.dtype == torch.float32 and not lse.requires_grad
    want = _lse_want(q, k, oq, ok, 1 / math.sqrt(d), causal, window)
    empty = want == -math.inf
    assert empty[:, :4].all() and (not causal or empty[:, 4:7].all())  # the rows the shapes were chosen for
    assert torch.equal(lse.cpu() == -math.inf, empty)
    torch.testing.assert_close(lse.cpu().double()[~empty], want[~empty], atol=tol, rtol=tol)
    # out and its gradients are those of the plain call
    plain = _fwd_bwd(lambda a, b, c: jagged_attention(a, b, c, oq, 17, ok, 20, **kw), q, k, v)
    with_lse = _fwd_bwd(lambda a, b, c: jagged_attention(a, b, c, oq, 17, ok, 20, return_lse=True, **kw)[0], q, k, v)
    for a, b in zip(plain, with_lse):
        torch.testing.assert_close(a, b, atol=0, rtol=0)


def test_return_lse_self_attention_without_sequences():
    q = torch.zeros(0, 2, 16)
    for kernel in ("triton", "reference"):
        out, lse = jagged_attention(q, q, q, torch.zeros(1, dtype=torch.int64), 0, return_lse=True, kernel=kernel)
        assert out.shape == (0, 2, 16) and lse.shape == (2, 0) and lse.dtype == torch.float32


# ------------------------------------------------------------------------------------------- bad head dims


@pytest.mark.parametrize("kernel", ["triton", "reference"])
@pytest.mark.parametrize("d", [0, 257, 300])
def test_bad_head_dims_raise(d, kernel):
    off = torch.tensor([0, 3])
    x = torch.zeros(3, 2, d)
    with pytest.raises(ValueError, match=rf"head dim must be 1\.\.256 \(got {d}\)"):
        jagged_attention(x, x, x, off, 3, kernel=kernel)
    with pytest.raises(ValueError, match=rf"head dim must be 1\.\.256 \(got {d}\)"):
        block_attention(x, x, x, off, 3, block_size=2, kernel=kernel)
    with pytest.raises(ValueError, match=rf"q/k head dim must be 1\.\.256 \(got {d}\)"):
        gdpa(x, x, torch.zeros(3, 2, 16), off, 3, off, 3, kernel=kernel)
    with pytest.raises(ValueError, match=rf"v head dim must be 1\.\.256 \(got {d}\)"):
        gdpa(torch.zeros(3, 2, 16), torch.zeros(3, 2, 16), x, off, 3, off, 3, kernel=kernel)


def test_rope_over_an_odd_head_dim_raises():
    x = torch.zeros(3, 2, 59)
    with pytest.raises(ValueError, match="rotary_dim=59: must be even"):
        block_attention(x, x, x, torch.tensor([0, 3]), 3, block_size=2, rope=RopeConfig(), kernel="triton")


def test_jagged_attention_still_needs_equal_value_head_dim():
    x = torch.zeros(3, 2, 16)
    with pytest.raises(ValueError, match="same shape"):
        jagged_attention(x, x, torch.zeros(3, 2, 24), torch.tensor([0, 3]), 3, kernel="triton")
