"""Standalone fused RoPE: Triton kernel (interpreter on CPU) against an independent complex-number formulation."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from gem.ops.rotary import RopeConfig, positions_of, rope, rope_reference


def _offsets(lengths):
    return torch.tensor([0] + torch.tensor(lengths).cumsum(0).tolist(), dtype=torch.int64)


def _complex_rope(x, lengths, cfg, inverse=False):
    """RoPE as multiplication by e^{i * pos * theta_j} in float64, written independently of gem.ops.rotary."""
    d = x.shape[-1]
    rd = cfg.rotary_dim or d
    pos = torch.cat([torch.arange(n, dtype=torch.float64) for n in lengths]) if lengths else torch.zeros(0)
    theta = cfg.base ** (-torch.arange(0, rd, 2, dtype=torch.float64) / rd)
    z = torch.polar(torch.ones(pos.numel(), rd // 2, dtype=torch.float64), pos[:, None] * theta[None, :])
    if inverse:
        z = z.conj()
    xr = x.double()[..., :rd]
    if cfg.interleaved:
        pairs = torch.complex(xr[..., 0::2], xr[..., 1::2])
    else:
        pairs = torch.complex(xr[..., : rd // 2], xr[..., rd // 2:])
    y = pairs * z[:, None, :]
    if cfg.interleaved:
        rot = torch.stack((y.real, y.imag), -1).flatten(-2)
    else:
        rot = torch.cat((y.real, y.imag), -1)
    return torch.cat((rot, x.double()[..., rd:]), -1)


CONFIGS = [
    RopeConfig(),
    RopeConfig(rotary_dim=16),
    RopeConfig(interleaved=True),
    RopeConfig(rotary_dim=10, interleaved=True, base=500.0),
]


@pytest.mark.parametrize("cfg", CONFIGS)
@pytest.mark.parametrize("kernel", ["triton", "reference"])
def test_forward_backward_match_complex_rotation(cfg, kernel):
    lengths = [17, 0, 1, 40]
    g = torch.Generator().manual_seed(0)
    x = torch.randn(sum(lengths), 3, 32, generator=g, requires_grad=True)
    gy = torch.randn(sum(lengths), 3, 32, generator=g)
    y = rope(x, _offsets(lengths), 40, config=cfg, kernel=kernel)
    y.backward(gy)
    torch.testing.assert_close(y.double(), _complex_rope(x.detach(), lengths, cfg), atol=1e-5, rtol=1e-5)
    # The Jacobian is the rotation, so the gradient is the inverse rotation of gy.
    torch.testing.assert_close(x.grad.double(), _complex_rope(gy, lengths, cfg, inverse=True), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_matches_reference(dtype):
    lengths = [33, 2]
    x = torch.randn(35, 2, 64).to(dtype)
    off = _offsets(lengths)
    got = rope(x, off, 33, config=RopeConfig(rotary_dim=48), kernel="triton")
    ref = rope_reference(x, off, 33, RopeConfig(rotary_dim=48))
    assert got.dtype == dtype
    # Both rotate in fp32 and round once; allow one ulp.
    torch.testing.assert_close(got.float(), ref.float(), atol=1e-2, rtol=1e-2)


@pytest.mark.parametrize("cfg", CONFIGS[:3])
def test_inverse_undoes_rotation(cfg):
    lengths = [25, 7]
    x = torch.randn(32, 2, 32, dtype=torch.float32)
    off = _offsets(lengths)
    y = rope(x, off, 25, config=cfg, kernel="triton")
    assert not torch.allclose(y[1:25], x[1:25])  # a real rotation happened past position 0
    torch.testing.assert_close(y[0], x[0])  # position 0 is the identity
    back = rope(y, off, 25, config=cfg, inverse=True, kernel="triton")
    torch.testing.assert_close(back, x, atol=1e-5, rtol=1e-5)


def test_long_positions_are_exact():
    # Angles come from an fp64 table: position 60000 must still rotate accurately.
    n = 60001
    x = torch.zeros(n, 1, 8)
    x[-1, 0, :] = torch.arange(1.0, 9.0)
    cfg = RopeConfig()
    got = rope(x, torch.tensor([0, n]), n, config=cfg, kernel="reference")[-1:]
    torch.testing.assert_close(got.double(), _complex_rope(x, [n], cfg)[-1:], atol=2e-5, rtol=1e-5)


@settings(max_examples=6, deadline=None)
@given(
    lengths=st.lists(st.integers(0, 30), min_size=1, max_size=4),
    h=st.integers(1, 3),
    d=st.sampled_from([32, 48, 64, 128]),
    frac=st.sampled_from([1, 2, 4]),
    interleaved=st.booleans(),
)
def test_hypothesis_shapes(lengths, h, d, frac, interleaved):
    cfg = RopeConfig(rotary_dim=d // frac, interleaved=interleaved)
    x = torch.randn(sum(lengths), h, d)
    got = rope(x, _offsets(lengths), max(lengths), config=cfg, kernel="triton")
    torch.testing.assert_close(got.double(), _complex_rope(x, lengths, cfg), atol=1e-5, rtol=1e-5)


def test_positions_restart_per_sequence():
    pos = positions_of(torch.tensor([0, 3, 3, 5]), 5)
    assert pos.tolist() == [0, 1, 2, 0, 1]


def test_torch_compile_and_opcheck():
    from gem.ops.rotary import _rope_op

    x = torch.randn(12, 2, 32, requires_grad=True)
    off = torch.tensor([0, 5, 12])
    cfg = RopeConfig(rotary_dim=16)
    f = torch.compile(lambda t: rope(t, off, 7, config=cfg, kernel="triton").square().sum(), backend="aot_eager",
                      fullgraph=True)
    f(x).backward()
    ref = _complex_rope(x.detach(), [5, 7], cfg)
    torch.testing.assert_close(x.grad.double(), _complex_rope(2 * ref, [5, 7], cfg, inverse=True), atol=1e-5,
                               rtol=1e-5)
    torch.library.opcheck(_rope_op, (x.detach(), off, 7, 10000.0, 16, False, False))


@pytest.mark.parametrize(
    "cfg,match",
    [(RopeConfig(rotary_dim=7), "rotary_dim"), (RopeConfig(rotary_dim=40), "rotary_dim"),
     (RopeConfig(rotary_dim=0), "rotary_dim"), (RopeConfig(base=0.5), "base")],
)
def test_bad_config(cfg, match):
    with pytest.raises(ValueError, match=match):
        rope(torch.randn(4, 1, 32), torch.tensor([0, 4]), 4, config=cfg)


def test_bad_input():
    with pytest.raises(ValueError, match=r"\[T, H, D\]"):
        rope(torch.randn(4, 32), torch.tensor([0, 4]), 4)
    with pytest.raises(ValueError, match="offsets"):
        rope(torch.randn(4, 1, 32), torch.tensor([0.0, 4.0]), 4)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("cfg", CONFIGS)
def test_gpu_matches_complex_rotation(cfg):
    lengths = [4096, 1, 0, 1000]
    x = torch.randn(sum(lengths), 4, 128, device="cuda")
    off = _offsets(lengths).cuda()
    got = rope(x, off, 4096, config=cfg).cpu()
    torch.testing.assert_close(got.double(), _complex_rope(x.cpu(), lengths, cfg), atol=1e-4, rtol=1e-4)


def _count_position_builds(monkeypatch, cache):
    """positions_of calls over 3 eager fwd+bwd rope calls on one offsets tensor, then after an in-place write."""
    from gem.ops import rotary

    monkeypatch.setenv("GEM_ROPE_POS_CACHE", cache)
    built = []
    real = rotary.positions_of
    monkeypatch.setattr(rotary, "positions_of", lambda off, t: built.append(t) or real(off, t))
    lengths, cfg = [17, 0, 1, 20], RopeConfig(rotary_dim=16)
    x = torch.randn(38, 2, 32, requires_grad=True)
    off = _offsets(lengths)
    counts = []
    for _ in range(3):
        rope(x, off, 20, config=cfg, kernel="triton").sum().backward()
        counts.append(len(built))
    new = [20, 1, 0, 17]
    off.copy_(_offsets(new))  # same T, new positions: must rebuild
    y = rope(x, off, 20, config=cfg, kernel="triton")
    torch.testing.assert_close(y.double(), _complex_rope(x.detach(), new, cfg), atol=1e-5, rtol=1e-5)
    counts.append(len(built))
    return counts


def test_positions_built_once_per_offsets(monkeypatch):
    # the forward and backward of every call share one positions vector until the offsets are written
    assert _count_position_builds(monkeypatch, "1") == [1, 1, 1, 2]


def test_positions_cache_off_rebuilds(monkeypatch):
    # GEM_ROPE_POS_CACHE=0: one build per kernel call (so the test above would fail without the cache)
    assert _count_position_builds(monkeypatch, "0") == [2, 4, 6, 7]


def test_custom_op_does_not_cache_positions(monkeypatch):
    from gem.ops import rotary

    built = []
    real = rotary.positions_of
    monkeypatch.setattr(rotary, "positions_of", lambda off, t: built.append(t) or real(off, t))
    x, off = torch.randn(12, 2, 32), torch.tensor([0, 5, 12])
    for _ in range(2):
        rotary._rope_op(x, off, 7, 10000.0, 32, False, False)
    assert built == [12, 12]
