"""Standalone fused RoPE: Triton kernel (interpreter on CPU) against an independent complex-number formulation."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from gem.ops import rotary
from gem.ops.rotary import RopeConfig, full_layout_ok, gpu_configs, positions_of, rope, rope_launch, rope_reference


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
    from gem.ops.rotary import rope_op

    x = torch.randn(12, 2, 32, requires_grad=True)
    off = torch.tensor([0, 5, 12])
    cfg = RopeConfig(rotary_dim=16)
    f = torch.compile(lambda t: rope(t, off, 7, config=cfg, kernel="triton").square().sum(), backend="aot_eager",
                      fullgraph=True)
    f(x).backward()
    ref = _complex_rope(x.detach(), [5, 7], cfg)
    torch.testing.assert_close(x.grad.double(), _complex_rope(2 * ref, [5, 7], cfg, inverse=True), atol=1e-5,
                               rtol=1e-5)
    torch.library.opcheck(rope_op.fwd_op, (x.detach(), off, 7, 10000.0, 16, False, False))


@pytest.mark.parametrize("cfg", CONFIGS)
def test_rotate_traces_whole_in_a_compiled_graph(cfg):
    """`rotate` with the rows gathered from rope_tables inside a graph (as a model's compiled region runs it): one
    graph for jagged batches of changing size, forward and backward equal to the complex rotation."""
    torch._dynamo.reset()

    @torch.compile(backend="aot_eager", fullgraph=True, dynamic=True)
    def f(x, pos, cos, sin):
        return rotary.rotate(x, cos[pos], sin[pos], cfg.interleaved)

    for lengths in ([5, 0, 9], [3, 14, 1, 2]):
        x = torch.randn(sum(lengths), 3, 32, requires_grad=True)
        gy = torch.randn(sum(lengths), 3, 32)
        rd = cfg.resolve_dim(32)
        pos, cos, sin = rotary.rope_tables(_offsets(lengths), x.shape[0], max(lengths), rd, cfg.base)
        assert pos.dtype == torch.int32 and cos.shape[1] == rd // 2
        y = f(x, pos, cos, sin)
        y.backward(gy)
        torch.testing.assert_close(y.double(), _complex_rope(x.detach(), lengths, cfg), atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(x.grad.double(), _complex_rope(gy, lengths, cfg, inverse=True), atol=1e-5,
                                   rtol=1e-5)


def test_rope_tables_reject_offsets_longer_than_max_len():
    with pytest.raises(ValueError, match="max_len"):
        rotary.rope_tables(_offsets([3, 9]), 12, 4, 16, 10000.0)


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


def test_positions_built_once_per_batch(monkeypatch):
    """positions_of calls over 3 eager fwd+bwd rope calls on one JaggedBatch, then after an in-place write: the
    forward and backward of every call share one positions vector until the offsets are written."""
    from gem.ops import JaggedBatch, rotary

    built = []
    real = rotary.positions_of
    monkeypatch.setattr(rotary, "positions_of", lambda off, t: built.append(t) or real(off, t))
    lengths, cfg = [17, 0, 1, 20], RopeConfig(rotary_dim=16)
    x = torch.randn(38, 2, 32, requires_grad=True)
    off = _offsets(lengths)
    batch = JaggedBatch(off, 20)
    counts = []
    for _ in range(3):
        rope(x, batch, config=cfg, kernel="triton").sum().backward()
        counts.append(len(built))
    new = [20, 1, 0, 17]
    off.copy_(_offsets(new))  # same T, new positions: must rebuild
    y = rope(x, batch, config=cfg, kernel="triton")
    torch.testing.assert_close(y.double(), _complex_rope(x.detach(), new, cfg), atol=1e-5, rtol=1e-5)
    counts.append(len(built))
    assert counts == [1, 1, 1, 2]  # without the cache: [2, 4, 6, 7], one build per kernel call


def test_custom_op_does_not_cache_positions(monkeypatch):
    from gem.ops import rotary

    built = []
    real = rotary.positions_of
    monkeypatch.setattr(rotary, "positions_of", lambda off, t: built.append(t) or real(off, t))
    x, off = torch.randn(12, 2, 32), torch.tensor([0, 5, 12])
    for _ in range(2):
        rotary.rope_op.fwd_op(x, off, 7, 10000.0, 32, False, False)
    assert built == [12, 12]


# ---------------------------------------------------------------------------------------------------------------
# Launch configs: every layout the GPU tuner may pick, forced one at a time under the interpreter; the tuner itself.

GPU_LAUNCHES = gpu_configs(32, False)  # every candidate (a power-of-two NeoX rotary_dim admits the "full" layout)

# (lengths, heads, head dim, config, dtype): T not a multiple of any BLOCK_T, T = 0 and 1, H = 1 and 3, rotary_dim = D
# and partial (pass-through channels), NeoX and interleaved, a head dim that is not a power of two, fp32 and bf16.
LAUNCH_CASES = [
    ([17, 0, 1, 40], 3, 32, RopeConfig(), torch.float32),
    ([17, 0, 1, 40], 3, 32, RopeConfig(interleaved=True), torch.float32),
    ([70, 3], 1, 32, RopeConfig(rotary_dim=16), torch.bfloat16),
    ([30, 9], 3, 32, RopeConfig(rotary_dim=10, interleaved=True, base=500.0), torch.bfloat16),
    ([13, 20], 3, 48, RopeConfig(rotary_dim=16), torch.float32),
    ([5, 6], 3, 32, RopeConfig(rotary_dim=10), torch.float32),  # NeoX rotary_dim 10: no "full" layout
    ([1], 1, 32, RopeConfig(), torch.bfloat16),
    ([1], 3, 32, RopeConfig(rotary_dim=8, interleaved=True), torch.float32),
    ([0, 0], 3, 32, RopeConfig(), torch.float32),
]


def _force(monkeypatch, *cands):
    """rope's tuner sees only cands (fresh cache, so an earlier test's pick for the same key does not stick)."""
    monkeypatch.setattr(rotary, "rope_configs", lambda rd, interleaved: list(cands))
    monkeypatch.setattr(rotary._TUNER, "best", {})


def test_gpu_candidates():
    assert GPU_LAUNCHES[0] == rope_launch("halves", 32, "loop", 4)  # the measured default comes first
    assert len(set(GPU_LAUNCHES)) == len(GPU_LAUNCHES)
    def kind(c):
        return c.tile("layout"), c.tile("heads")

    assert {c.tile("BLOCK_T") for c in GPU_LAUNCHES if kind(c) == ("halves", "loop")} == {32, 64, 128}
    assert {c.num_warps for c in GPU_LAUNCHES if kind(c) == ("halves", "loop")} == {4, 8}
    assert {c.tile("BLOCK_T") for c in GPU_LAUNCHES if kind(c) == ("halves", "grid")} == {64, 128}
    assert {kind(c) for c in GPU_LAUNCHES} == {(a, b) for a in rotary.LAYOUTS for b in ("loop", "grid")}
    assert all(c.tile("layout") == "halves" for c in gpu_configs(48, False))  # NeoX, rotary_dim not a power of two
    assert gpu_configs(48, True) == GPU_LAUNCHES
    assert rotary.rope_configs(32, False) == [rope_launch("halves", 16, "loop", 4)]  # interpreter: one small config


@pytest.mark.parametrize("launch", GPU_LAUNCHES, ids=str)
def test_every_launch_config_matches_reference(monkeypatch, launch):
    _force(monkeypatch, launch)
    checked = 0
    for lengths, h, d, cfg, dtype in LAUNCH_CASES:
        rd = cfg.resolve_dim(d)
        off, max_len = _offsets(lengths), max(lengths)
        x = torch.randn(sum(lengths), h, d, generator=torch.Generator().manual_seed(len(lengths) + d)).to(dtype)
        if launch.tile("layout") == "full" and not full_layout_ok(rd, cfg.interleaved):
            with pytest.raises(ValueError, match="power-of-two"):
                rope(x, off, max_len, config=cfg, kernel="triton")
            continue
        tol = 1e-5 if dtype == torch.float32 else 1e-2
        for inverse in (False, True):
            got = rope(x, off, max_len, config=cfg, inverse=inverse, kernel="triton")
            assert got.dtype == dtype and got.shape == x.shape
            ref = rope_reference(x, off, max_len, cfg, inverse=inverse)
            torch.testing.assert_close(got.float(), ref.float(), atol=tol, rtol=tol)
            if dtype == torch.float32:
                torch.testing.assert_close(got.double(), _complex_rope(x, lengths, cfg, inverse=inverse), atol=1e-5,
                                           rtol=1e-5)
            # pass-through channels are copied bit for bit
            assert torch.equal(got[..., rd:], x[..., rd:])
        checked += 1
    assert checked >= 6


def test_launch_config_backward(monkeypatch):
    # the backward is a launch of the same tuned config in the other direction
    for launch in (rope_launch("halves", 32, "grid", 4), rope_launch("full", 16, "loop", 4)):
        _force(monkeypatch, launch)
        lengths, cfg = [17, 0, 1, 40], RopeConfig(rotary_dim=16, interleaved=True)
        x = torch.randn(58, 3, 32, requires_grad=True)
        gy = torch.randn(58, 3, 32)
        rope(x, _offsets(lengths), 40, config=cfg, kernel="triton").backward(gy)
        torch.testing.assert_close(x.grad.double(), _complex_rope(gy, lengths, cfg, inverse=True), atol=1e-5,
                                   rtol=1e-5)


TUNE_CANDS = [rope_launch("halves", 16, "loop", 4), rope_launch("halves", 32, "grid", 4),
              rope_launch("full", 16, "grid", 4)]


def _record_launches(monkeypatch, cost=None):
    """(launched configs, timed configs); the tuner's bench runs the launch and reports cost[cfg] ms."""
    launched, timed = [], []
    real = rotary._rope_launch
    monkeypatch.setattr(rotary, "_rope_launch", lambda cfg, *a: launched.append(cfg) or real(cfg, *a))

    def bench(fn):
        if cost is None:
            raise AssertionError("timed with GEM_AUTOTUNE=0")
        fn()
        timed.append(launched[-1])
        return cost[launched[-1]]

    monkeypatch.setattr(rotary._TUNER, "bench", bench)
    return launched, timed


def test_tuner_picks_fastest_and_caches_per_key(monkeypatch):
    monkeypatch.delenv("GEM_AUTOTUNE", raising=False)
    _force(monkeypatch, *TUNE_CANDS)
    launched, timed = _record_launches(monkeypatch, dict(zip(TUNE_CANDS, (3.0, 1.0, 2.0))))
    cfg = RopeConfig(rotary_dim=16)
    x = torch.randn(40, 3, 32)
    y = rope(x, _offsets([40]), 40, config=cfg, kernel="triton")
    assert timed == TUNE_CANDS and launched[-1] == TUNE_CANDS[1]  # each timed once, then the fastest writes y
    torch.testing.assert_close(y.double(), _complex_rope(x, [40], cfg), atol=1e-5, rtol=1e-5)
    # another T and the inverse direction: same key, no re-timing
    launched.clear()
    x2 = torch.randn(75, 3, 32)
    y2 = rope(x2, _offsets([50, 25]), 50, config=cfg, kernel="triton")
    back = rope(y2, _offsets([50, 25]), 50, config=cfg, inverse=True, kernel="triton")
    assert len(timed) == 3 and launched == [TUNE_CANDS[1]] * 2
    torch.testing.assert_close(back, x2, atol=1e-5, rtol=1e-5)
    # another head count (or dtype, rotary_dim, layout): a new key, timed again
    rope(torch.randn(40, 2, 32), _offsets([40]), 40, config=cfg, kernel="triton")
    rope(torch.randn(40, 3, 32).bfloat16(), _offsets([40]), 40, config=cfg, kernel="triton")
    assert len(timed) == 9
    assert len(rotary._TUNER.best) == 3


def test_autotune_off_keeps_first_config(monkeypatch):
    monkeypatch.setenv("GEM_AUTOTUNE", "0")
    _force(monkeypatch, *TUNE_CANDS)
    launched, timed = _record_launches(monkeypatch)
    cfg = RopeConfig()
    for n in (40, 9):
        x = torch.randn(n, 3, 32)
        y = rope(x, _offsets([n]), n, config=cfg, kernel="triton")
        torch.testing.assert_close(y.double(), _complex_rope(x, [n], cfg), atol=1e-5, rtol=1e-5)
    assert not timed and set(launched) == {TUNE_CANDS[0]}


def test_tuner_prints_nothing_by_default(monkeypatch, capsys):
    monkeypatch.delenv("GEM_AUTOTUNE", raising=False)
    monkeypatch.delenv("GEM_TUNE_LOG", raising=False)
    _force(monkeypatch, *TUNE_CANDS)
    rope(torch.randn(20, 2, 32), _offsets([20]), 20, kernel="triton")
    assert capsys.readouterr().out == ""


def _plain_qkv_rope(qkv, h, hk, d, pos, cos, sin, interleaved):
    """What qkv_rope replaces: split, reshape, rotate with autograd's own backward."""
    t = qkv.shape[0]
    q, k, v = qkv.split([h * d, hk * d, hk * d], dim=-1)
    c, s = cos[pos], sin[pos]
    return (rotary.rotate(q.reshape(t, h, d), c, s, interleaved), rotary.rotate(k.reshape(t, hk, d), c, s, interleaved),
            v.reshape(t, hk, d))


QKV_CASES = [  # lengths, heads, kv heads, head dim, config, dtype
    ([17, 0, 1, 40], 4, 2, 32, RopeConfig(), torch.float32),
    ([5, 9], 3, 3, 16, RopeConfig(rotary_dim=10, interleaved=True, base=500.0), torch.float32),
    ([1], 2, 1, 32, RopeConfig(rotary_dim=16), torch.float32),
    ([], 2, 1, 16, RopeConfig(), torch.float32),
    ([33, 2, 7], 4, 1, 64, RopeConfig(), torch.bfloat16),
]


@pytest.mark.parametrize("kernel", ["triton", "reference"])
@pytest.mark.parametrize("case", QKV_CASES, ids=lambda c: f"{c[0]}-h{c[1]}-{c[2]}-d{c[3]}-{c[5]}")
def test_qkv_rope_matches_split_and_rotate(case, kernel, monkeypatch):
    """The fused projection's split + RoPE, forward and backward, against the plain autograd form; the gradient
    of the whole qkv comes back as one [T, (H + 2 H_kv) D] buffer with dv in its columns bit for bit."""
    lengths, h, hk, d, cfg, dtype = case
    if kernel == "reference":
        monkeypatch.setenv("TRITON_INTERPRET", "0")
    t = sum(lengths)
    g = torch.Generator().manual_seed(len(lengths) + d)
    qkv = torch.randn(t, (h + 2 * hk) * d, generator=g).to(dtype).requires_grad_()
    grads = [torch.randn(t, n, d, generator=g).to(dtype) for n in (h, hk, hk)]
    pos, cos, sin = rotary.rope_tables(_offsets(lengths), t, max(lengths, default=1), cfg.resolve_dim(d), cfg.base)
    got = rotary.qkv_rope(qkv, h, hk, d, pos, cos, sin, cfg.interleaved)
    want = _plain_qkv_rope(qkv, h, hk, d, pos, cos, sin, cfg.interleaved)
    for a, b in zip(got, want):
        assert a.dtype == dtype and a.shape == b.shape
        assert torch.equal(a, b)  # the same forward ops
    assert got[2].is_contiguous()  # v's gradient then arrives in v's own layout (no re-layout copy by autograd)
    dgot, = torch.autograd.grad(got, qkv, grads)
    dwant, = torch.autograd.grad(want, qkv, grads)
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(dgot.float(), dwant.float(), atol=tol, rtol=tol)
    assert torch.equal(dgot[:, (h + hk) * d:], grads[2].reshape(t, hk * d))
    if dtype == torch.float32:  # against the independent complex rotation too
        dq = dgot[:, : h * d].reshape(t, h, d)
        torch.testing.assert_close(dq.double(), _complex_rope(grads[0], lengths, cfg, inverse=True), atol=1e-5,
                                   rtol=1e-5)


def test_qkv_rope_backward_takes_the_callers_kernel(monkeypatch):
    """kernel="reference" reaches the backward: no Triton launch even where "auto" would pick Triton (here the
    interpreter, 190x slower than the reference in a CPU training step), and the same gradient as "auto"."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    h, hk, d, cfg = 2, 1, 32, RopeConfig()
    lengths = [5, 0, 9]
    t = sum(lengths)
    qkv = torch.randn(t, (h + 2 * hk) * d, requires_grad=True)
    pos, cos, sin = rotary.rope_tables(_offsets(lengths), t, max(lengths), d, cfg.base)
    grads = [torch.randn(t, n, d) for n in (h, hk, hk)]
    want, = torch.autograd.grad(rotary.qkv_rope(qkv, h, hk, d, pos, cos, sin), qkv, grads)
    launches = []
    monkeypatch.setattr(rotary, "_rope_launch", lambda *a, **k: launches.append(a))
    got, = torch.autograd.grad(rotary.qkv_rope(qkv, h, hk, d, pos, cos, sin, kernel="reference"), qkv, grads)
    assert not launches
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_target_tokens_block_runs_rope_on_the_models_kernel(monkeypatch):
    """A TransformerBlock built with kernel="reference" rotates the target form's q and k (explicit positions)
    without Triton in the backward, and computes what the same block on Triton (the interpreter here) computes:
    output, input gradient and every parameter's gradient. Sequences: targets after history, an empty one, a lone
    target, one target after an odd history."""
    import copy

    from gem.model.attention import JaggedSelfAttention, SwiGLU, Targets, TransformerBlock

    monkeypatch.setenv("TRITON_INTERPRET", "1")
    torch.manual_seed(0)
    ref = TransformerBlock(32, JaggedSelfAttention(32, 2, 2, 16, rope=RopeConfig(), kernel="reference"),
                           SwiGLU(32, 64))
    tri = copy.deepcopy(ref)
    tri.attn.kernel = "triton"
    lengths, num_targets = [4, 0, 1, 4], torch.tensor([2, 0, 1, 1])
    positions = torch.tensor([0, 1, 2, 2, 0, 0, 1, 2, 3], dtype=torch.int32)
    x = torch.randn(sum(lengths), 32)

    def run(blk):
        xi = x.clone().requires_grad_()
        y, _ = blk(xi, _offsets(lengths), max(lengths), Targets(num_targets, positions))
        y.backward(torch.linspace(-1, 1, y.numel()).reshape(y.shape))
        return [y.detach(), xi.grad, *(p.grad for p in blk.parameters())]

    want = run(tri)
    launches = []
    monkeypatch.setattr(rotary, "_rope_launch", lambda *a, **k: launches.append(a))
    got = run(ref)
    assert not launches
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b, atol=2e-5, rtol=2e-5)


def test_qkv_rope_under_compile_and_opcheck():
    """In a compiled region of changing token counts: the gradient op stays one opaque call, results as eager."""
    torch._dynamo.reset()
    h, hk, d, cfg = 2, 1, 32, RopeConfig()

    @torch.compile(backend="aot_eager", fullgraph=True, dynamic=True)
    def f(qkv, pos, cos, sin):
        return rotary.qkv_rope(qkv, h, hk, d, pos, cos, sin)

    for lengths in ([5, 0, 9], [3, 14, 1, 2]):
        t = sum(lengths)
        qkv = torch.randn(t, (h + 2 * hk) * d, requires_grad=True)
        pos, cos, sin = rotary.rope_tables(_offsets(lengths), t, max(lengths), d, cfg.base)
        grads = [torch.randn(t, n, d) for n in (h, hk, hk)]
        dgot, = torch.autograd.grad(f(qkv, pos, cos, sin), qkv, grads)
        dwant, = torch.autograd.grad(_plain_qkv_rope(qkv, h, hk, d, pos, cos, sin, False), qkv, grads)
        torch.testing.assert_close(dgot, dwant, atol=1e-5, rtol=1e-5)
    t = 9
    pos, cos, sin = rotary.rope_tables(_offsets([4, 5]), t, 5, d, cfg.base)
    torch.library.opcheck(rotary.qkv_rope_grad, (torch.randn(t, h, d), torch.randn(t, hk, d), torch.randn(t, hk, d),
                                                 pos, cos, sin, False))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("cfg", CONFIGS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gpu_qkv_rope_matches_split_and_rotate(cfg, dtype):
    """On the GPU: the tuned rope kernels writing into the wide q/k/v gradient, against autograd's own backward."""
    lengths, h, hk, d = [4096, 1, 0, 1000, 333], 8, 2, 128
    t = sum(lengths)
    g = torch.Generator(device="cuda").manual_seed(0)
    qkv = torch.randn(t, (h + 2 * hk) * d, device="cuda", generator=g).to(dtype).requires_grad_()
    grads = [torch.randn(t, n, d, device="cuda", generator=g).to(dtype) for n in (h, hk, hk)]
    pos, cos, sin = rotary.rope_tables(_offsets(lengths).cuda(), t, 4096, cfg.resolve_dim(d), cfg.base)
    got = rotary.qkv_rope(qkv, h, hk, d, pos, cos, sin, cfg.interleaved)
    want = _plain_qkv_rope(qkv, h, hk, d, pos, cos, sin, cfg.interleaved)
    dgot, = torch.autograd.grad(got, qkv, grads)
    dwant, = torch.autograd.grad(want, qkv, grads)
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(dgot.float(), dwant.float(), atol=tol, rtol=tol)
    assert torch.equal(dgot[:, (h + hk) * d:], grads[2].reshape(t, hk * d))
