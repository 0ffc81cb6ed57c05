"""GDPA: Triton kernels (interpreted on CPU) against the padded fp32 PyTorch reference, forward and backward."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from gem.ops.gdpa import ACTIVATIONS, POLY6, activation_fn, gdpa, gdpa_reference, poly6
from tests.ops.conftest import assert_within


@pytest.fixture(autouse=True)
def _nan_outputs(monkeypatch):
    """Kernel outputs start as NaN: a row that no program writes cannot pass as a zero."""
    from gem.ops import triton_gdpa

    monkeypatch.setattr(triton_gdpa, "_POISON", float("nan"))


TOL = {torch.float32: (2e-5, 2e-5), torch.bfloat16: (2e-2, 2e-2), torch.float16: (3e-3, 3e-3)}


def _offsets(lengths):
    return torch.tensor([0] + list(torch.tensor(lengths, dtype=torch.int64).cumsum(0)), dtype=torch.int32)


def _inputs(lq, lk, h=2, hk=1, d=32, dtype=torch.float32, device="cpu", seed=0):
    g = torch.Generator().manual_seed(seed)
    oq, ok = _offsets(lq).to(device), _offsets(lk).to(device)

    def r(t, heads):
        return torch.randn(t, heads, d, generator=g).to(device=device, dtype=dtype).requires_grad_()

    q, k, v = r(sum(lq), h), r(sum(lk), hk), r(sum(lk), hk)
    return q, k, v, oq, max(lq, default=0), ok, max(lk, default=0)


def _close(got, want, dtype, what):
    assert_within(got.float(), want.float(), *TOL[dtype], what)


def _check(lq, lk, *, h=2, hk=1, d=32, dtype=torch.float32, device="cpu", seed=0, **kw):
    q, k, v, oq, mq, ok, mk = _inputs(lq, lk, h, hk, d, dtype, device, seed)
    out = gdpa(q, k, v, oq, mq, ok, mk, kernel="triton", **kw)
    ref_kw = {key: val for key, val in kw.items() if key not in ("ordered", "short_kv")}
    # reference on fp32 copies of the same (rounded) inputs
    q32, k32, v32 = (x.detach().float().requires_grad_() for x in (q, k, v))
    ref = gdpa_reference(q32, k32, v32, oq, mq, ok, mk, **ref_kw)
    assert out.shape == q.shape and out.dtype == q.dtype
    _close(out, ref, dtype, "out")
    g = torch.randn(out.shape, generator=torch.Generator().manual_seed(seed + 1)).to(device=device, dtype=dtype)
    grads = torch.autograd.grad(out, (q, k, v), g)
    refs = torch.autograd.grad(ref, (q32, k32, v32), g.float())
    for name, a, b in zip(("dq", "dk", "dv"), grads, refs):
        assert a.dtype == dtype
        _close(a, b, dtype, name)
    return out, grads


# ---------------------------------------------------------------------------------------------- activations
@pytest.mark.parametrize("activation", ACTIVATIONS)
def test_each_activation_fwd_bwd(activation):
    # GQA 4:2, an empty q and an empty k sequence, lengths over and under the 16-row block
    _check([5, 0, 33, 17], [7, 4, 0, 40], h=4, hk=2, activation=activation)


@pytest.mark.parametrize("activation", ("gelu_tanh", "silu"))
@pytest.mark.parametrize("short_kv,causal", [(True, False), (False, True)])
def test_tanh_form_matches_reference(monkeypatch, activation, short_kv, causal):
    # gelu_tanh and silu written with one tanh, as the GPU runs them for bf16 (on CPU that tanh goes through exp):
    # forward and the derivative the backward recomputes; both K/V paths and a masked case.
    from gem.ops import triton_gdpa

    forms = triton_gdpa.ACT_TANH_FORM
    monkeypatch.setattr(triton_gdpa, "tanh_form", lambda act, approx, dtype: not approx and act in forms)
    seen = []
    real = triton_gdpa._consts
    monkeypatch.setattr(triton_gdpa, "_consts", lambda *a: seen.append(real(*a)["ACT"]) or real(*a))
    _check([5, 0, 33, 1, 17], [7, 4, 0, 1, 40], h=4, hk=2, activation=activation, causal=causal, short_kv=short_kv)
    assert seen and set(seen) == {triton_gdpa.ACT_TANH_FORM[activation]}


def _spy_kind(monkeypatch, kind):
    """Records (launch keywords, grid) of every launch of one GDPA kernel kind, and launches it."""
    from gem.ops import triton_gdpa

    kernel, names = triton_gdpa._KINDS[kind]
    seen = []

    class Spy:
        def __getitem__(self, grid):
            launch = kernel[grid]
            return lambda *a, **kw: seen.append((kw, grid)) or launch(*a, **kw)

    monkeypatch.setitem(triton_gdpa._KINDS, kind, (Spy(), names))
    return seen


@pytest.mark.parametrize("causal,tile", [(False, 64), (True, 64), (False, 128)])
def test_short_kv_narrow_tiles(monkeypatch, causal, tile):
    """The short-K/V forward and one-pass backward give each sequence the narrowest of its K/V tile, a half and
    a quarter of it that holds its keys: lengths at and one past each width's edge (16 and 32 of a 64-key tile,
    32 and 64 of a 128-key one), 0 and 1, under GQA."""
    fwd, bwd = _spy_kind(monkeypatch, "fwd_short"), _spy_kind(monkeypatch, "bwd_short")
    q4, q2 = tile // 4, tile // 2
    lk = [1, q4, q4 + 1, q2, q2 + 1, tile, 0, 9]
    lq = [3, 20, 1, 17, 40, 33, 5, 0]
    _check(lq, lk, h=4, hk=2, activation="gelu", causal=causal, short_kv=True)
    # both short-K/V kernels ran, on the whole tile (the narrow widths are picked per sequence inside them)
    assert fwd and bwd and {kw["BLOCK_N"] for kw, _ in fwd + bwd} == {tile}


@pytest.mark.parametrize("keys_major", [True, False])
@pytest.mark.parametrize("kw", [{"causal": True}, {"window": (3, 2)}, {"activation": "relu2"}, {"window": (0, 5)}])
def test_one_pass_backward_forms(monkeypatch, keys_major, kw):
    """The one-pass backward computing scores keys-major (S^T = K Q^T; KT) or row-major, pinned by its config:
    masks (causal, two-sided windows), narrow and full K/V tiles, lengths 0 and 1 and at the narrow tiles' edges,
    GQA 4:2, several q tiles per sequence."""
    from gem.ops import triton_gdpa

    monkeypatch.setitem(triton_gdpa.CONFIGS, "bwd_short",
                        [triton_gdpa.LaunchConfig.of(num_warps=1, num_stages=1, BLOCK_M=16, KT=keys_major)])
    monkeypatch.setattr(triton_gdpa._TUNER, "best", {})
    used = _spy_kind(monkeypatch, "bwd_short")
    _check([3, 40, 1, 0, 17, 33, 5, 2], [16, 17, 0, 5, 64, 1, 33, 32], h=4, hk=2, short_kv=True,
           **{"activation": "gelu", **kw})
    # one program per (sequence, kv head); a key's first call also launches once in the tuner
    assert {(k["KT"], k["BLOCK_N"], grid[0]) for k, grid in used} == {(keys_major, 64, 16)}


def test_configs_tuned_per_key(monkeypatch):
    """GDPA's kernels go through the shared ConfigTuner: a key's first call times every candidate and launches the
    fastest, later calls launch it untimed with the same outputs, and another key (here causal: MASKED) tunes
    again."""
    from gem.ops import triton_gdpa
    from gem.ops._tune import LaunchConfig

    one = LaunchConfig.of(1, 1, BLOCK_M=16, KT=False)
    two = LaunchConfig.of(2, 1, BLOCK_M=16, KT=True)
    monkeypatch.setitem(triton_gdpa.CONFIGS, "bwd_short", [one, two])
    monkeypatch.setattr(triton_gdpa._TUNER, "best", {})
    monkeypatch.delenv("GEM_AUTOTUNE", raising=False)
    timed = []

    def bench(fn):  # a fake clock: `two` is the faster config
        before = len(launched)
        fn()
        timed.append(launched[before][0]["num_warps"])
        return 1.0 if launched[before][0]["num_warps"] == 2 else 2.0

    monkeypatch.setattr(triton_gdpa._TUNER, "bench", bench)
    launched = _spy_kind(monkeypatch, "bwd_short")
    q, k, v, oq, mq, ok, mk = _inputs([3, 20, 1, 0], [5, 9, 2, 4], h=2, hk=1)

    def bwd(**kw):
        out = gdpa(q, k, v, oq, mq, ok, mk, kernel="triton", short_kv=True, activation="silu", **kw)
        return torch.autograd.grad(out, (q, k, v), torch.ones_like(out))

    first = bwd()
    assert timed == [1, 2] and launched[-1][0]["num_warps"] == 2  # both timed, the fastest launched
    again = bwd()
    assert timed == [1, 2] and len(launched) == 4 and launched[-1][0]["num_warps"] == 2  # untimed
    ref = gdpa_reference(q, k, v, oq, mq, ok, mk, activation="silu")
    for name, got, prev, want in zip(("dq", "dk", "dv"), again, first,
                                     torch.autograd.grad(ref, (q, k, v), torch.ones_like(ref))):
        torch.testing.assert_close(got, prev, rtol=0, atol=0)
        _close(got, want, torch.float32, name)
    bwd(causal=True)
    assert timed == [1, 2, 1, 2]


@pytest.mark.parametrize("causal", [False, True])
def test_short_kv_forward(causal):
    """The short-K/V forward (the scale applied to S), GQA, sequences of 0 and 1 and up to a 64-key tile."""
    _check([3, 20, 1, 0, 40], [1, 17, 33, 5, 64], h=4, hk=2, activation="silu", causal=causal, short_kv=True)


def test_tanh_form_on_gpu_bf16_only(monkeypatch):
    from gem.ops import triton_gdpa
    from gem.ops.triton_gdpa import tanh_form

    assert not tanh_form("gelu_tanh", "", torch.bfloat16)  # the interpreter has no tanh.approx: exp + divide
    monkeypatch.setattr(triton_gdpa, "triton_interpreting", lambda: False)  # on the GPU: bf16 only
    assert tanh_form("gelu_tanh", "", torch.bfloat16) and tanh_form("silu", "", torch.bfloat16)
    assert not tanh_form("silu", "", torch.float16) and not tanh_form("silu", "", torch.float32)
    assert not tanh_form("gelu", "", torch.bfloat16)  # no tanh in it
    assert not tanh_form("silu", "poly6", torch.bfloat16)  # poly6 keeps its own polynomial


@pytest.mark.parametrize("activation", ("gelu", "gelu_tanh", "silu"))
def test_poly6_kernel_matches_poly6_reference(activation):
    _check([9, 21], [30, 3], activation=activation, approx="poly6", causal=True)


@pytest.mark.parametrize("activation", ("gelu", "gelu_tanh", "silu"))
def test_poly6_error_bounds(activation):
    """Documented max |approx - act| and |approx' - act'| hold on a dense grid and are not loose."""
    p = POLY6[activation]
    x = torch.linspace(-4 * p.clamp, 4 * p.clamp, 400001, dtype=torch.float64, requires_grad=True)
    approx, exact = poly6(x, activation), activation_fn(x, activation)
    da = torch.autograd.grad(approx.sum(), x)[0]
    de = torch.autograd.grad(exact.sum(), x)[0]
    err = (approx - exact).abs().max().item()
    gerr = (da - de).abs().max().item()
    assert err <= p.max_abs_err and gerr <= p.max_abs_grad_err
    assert err > p.max_abs_err / 2 and gerr > p.max_abs_grad_err / 2  # the documented bound is tight
    assert poly6(torch.zeros(1, dtype=torch.float64), activation).item() == 0.0  # masking relies on act(0) = 0
    far = torch.tensor([-1e4, 1e4], dtype=torch.float64)  # asymptotes: 0 and x
    assert (poly6(far, activation) - torch.relu(far)).abs().max() <= p.max_abs_err


@pytest.mark.parametrize("activation", ("gelu", "silu"))
def test_poly6_attention_within_bound_of_exact(activation):
    q, k, v, oq, mq, ok, mk = _inputs([12, 7], [20, 9], d=16)
    q = (q * 3).detach()  # spread scores across the fitted range and past the clamp
    approx = gdpa(q, k, v, oq, mq, ok, mk, activation=activation, approx="poly6", kernel="triton")
    exact = gdpa_reference(q, k, v, oq, mq, ok, mk, activation=activation)
    # |sum_j (approx - act)(s_ij) v_j| <= bound * sum_j |v_j|, per sequence
    vabs = torch.stack([v[ok[b] : ok[b + 1]].abs().sum(0) for b in range(2)])  # [B, H, D]
    per_row = torch.cat([vabs[b].expand(int(oq[b + 1] - oq[b]), -1, -1) for b in range(2)])
    assert ((approx - exact).abs() <= POLY6[activation].max_abs_err * per_row + 1e-5).all()
    assert (approx - exact).abs().max() > 0  # it is an approximation, not the exact path


# ---------------------------------------------------------------------------------------------- masking
@pytest.mark.parametrize("activation", ("silu", "gelu"))
def test_causal_self(activation):
    lens = [1, 16, 33, 0, 7]
    _check(lens, lens, activation=activation, causal=True)


@pytest.mark.parametrize("short_kv", [True, False])  # the one-pass short-K/V backward, and the two-pass one
def test_causal_cross_bottom_right(short_kv):
    _check([40, 3, 5], [9, 20, 5], activation="gelu_tanh", causal=True, short_kv=short_kv)


@pytest.mark.parametrize("window", [(4, 2), (0, 0), (7, None), (None, 3)])
def test_window(window):
    lens = [37, 18]
    _check(lens, lens, activation="relu", window=window)


@pytest.mark.parametrize("lq,lk,window,causal", [
    ([90, 70, 1], None, (40, 20), False),  # edge tiles on both sides and unmasked ones between
    ([60, 33, 0], [90, 20, 7], (30, 10), False),  # cross: windows bottom-right aligned (Lk != Lq)
    ([95, 17], None, None, True),  # causal: unmasked tiles left of the diagonal
    ([64, 48], [100, 3], (None, 5), False),
])
def test_long_path_edge_and_inner_tiles(lq, lk, window, causal):
    """The tiled loops split into edge tiles (masked) and inner ones (not): many tiles per row, every split."""
    _check(lq, lq if lk is None else lk, activation="gelu", window=window, causal=causal, short_kv=False)


@pytest.mark.parametrize("short_kv", [None, True])
def test_window_with_causal(short_kv):
    lens = [29, 5]
    _check(lens, lens, activation="leaky_relu", window=(5, 8), causal=True, short_kv=short_kv)


@pytest.mark.parametrize("short_kv", [True, False])
def test_cross_short_kv_paths(short_kv):
    _check([50, 1, 0, 19], [12, 3, 5, 30], h=4, hk=1, activation="gelu_tanh", short_kv=short_kv)


@pytest.mark.parametrize("short_kv", [None, True, False])
def test_empty_sides_and_all_empty(short_kv):
    # q without k gives zeros; k without q gets zero grads (one-pass and two-pass backward)
    _check([0, 0, 4], [3, 0, 0], activation="silu", short_kv=short_kv)
    _check([0, 0], [0, 0], activation="silu", short_kv=short_kv)
    q, k, v, oq, mq, ok, mk = _inputs([], [])
    out = gdpa(q, k, v, oq, mq, ok, mk, kernel="triton")
    assert out.shape == (0, 2, 32)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_dtypes(dtype):
    _check([17, 5], [9, 31], h=2, hk=2, dtype=dtype, activation="silu", causal=True)


@pytest.mark.parametrize("d", [48, 64])
def test_head_dims(d):
    _check([17, 3], [5, 20], d=d, activation="gelu")


@pytest.mark.parametrize("normalize", ["max_len_k", 3.0])
def test_normalize(normalize):
    _check([6, 11], [13, 2], activation="relu2", normalize=normalize, scale=0.3)


@settings(max_examples=6, deadline=None)
@given(
    lens=st.lists(st.tuples(st.integers(0, 40), st.integers(0, 40)), min_size=1, max_size=3),
    group=st.sampled_from([(1, 1), (2, 1), (2, 2)]),
    d=st.sampled_from([16, 32]),
    activation=st.sampled_from(ACTIVATIONS),
    causal=st.booleans(),
    seed=st.integers(0, 1000),
)
def test_hypothesis_shapes(lens, group, d, activation, causal, seed):
    lq = [a for a, _ in lens]
    lk = lq if causal else [b for _, b in lens]
    _check(lq, lk, h=group[0], hk=group[1], d=d, activation=activation, causal=causal, seed=seed)


def test_deterministic_and_order_invariant():
    args = _inputs([3, 40, 18], [25, 33, 1], h=2, hk=1)
    q, k, v = args[:3]
    g = torch.randn(q.shape, generator=torch.Generator().manual_seed(5))
    results = []
    for ordered in (True, True, False):
        out = gdpa(*args, activation="gelu", kernel="triton", ordered=ordered, short_kv=False)
        results.append((out, *torch.autograd.grad(out, (q, k, v), g)))
    for other in results[1:]:
        for a, b in zip(results[0], other):
            assert torch.equal(a, b)


def test_work_table_orders_costliest_first():
    from gem.ops.triton_utils import work_table

    def table(*args, **kw):
        return work_table("tile_span", off, off, *args, cached=False, **kw)

    off = _offsets([5, 40, 0, 17])
    plain = table(40, 16, ordered=False)
    assert plain[:, 0].tolist()[:6] == [0, 1, 1, 1, 3, 3]
    # costliest sequences first, each one's tiles adjacent and costliest first; empty tiles last
    full = table(40, 16)
    assert full.tolist()[:6] == [[1, 0], [1, 1], [1, 2], [3, 0], [3, 1], [0, 0]]
    assert full[6:, 0].tolist() == [-1] * 6
    assert table(40, 16, total=62)[:, 0].tolist() == [1, 1, 1, 3, 3, 0, -1]  # keeps 62 // 16 + 4 rows
    causal = table(40, 16, left=-1, right=0)  # later q tiles see more keys
    # costs rows x keys seen: sequence 1's tiles 256, 512, 320; sequence 3's 256, 17
    assert causal.tolist()[:6] == [[1, 1], [1, 2], [1, 0], [3, 0], [3, 1], [0, 0]]
    keys = table(40, 16, left=-1, right=0, transpose=True)  # earlier key tiles: more queries
    assert keys.tolist()[:6] == [[1, 0], [1, 1], [1, 2], [3, 0], [3, 1], [0, 0]]


# ---------------------------------------------------------------------------------------------- errors
def _bad(**kw):
    q, k, v, oq, mq, ok, mk = _inputs([3], [4], h=kw.pop("h", 2), hk=kw.pop("hk", 1))
    for name in ("q", "k", "v", "oq", "ok"):
        if name in kw:
            val = kw.pop(name)
            q, k, v, oq, ok = [val if n == name else x for n, x in zip(("q", "k", "v", "oq", "ok"), (q, k, v, oq, ok))]
    kw.setdefault("kernel", "reference")
    return gdpa(q, k, v, oq, mq, ok, mk, **kw)


@pytest.mark.parametrize(
    "kw, msg",
    [
        ({"activation": "softmax"}, "expected one of ('gelu'"),
        ({"activation": "relu", "approx": "poly6"}, "supports activations"),
        ({"approx": "poly9"}, "approx='poly9'"),
        ({"h": 3, "hk": 2}, "multiple of k/v heads"),
        ({"k": torch.randn(4, 1, 32, dtype=torch.bfloat16)}, "dtypes differ"),
        ({"q": torch.randn(3, 2, 32, dtype=torch.float64)}, "unsupported"),
        ({"oq": torch.tensor([0, 3.0])}, "offsets_q"),
        ({"ok": torch.tensor([0, 2, 4], dtype=torch.int32)}, "batch sizes"),
        ({"window": -5}, "window=-5"),  # an int window is jagged_attention's causal left window (test_window.py)
        ({"normalize": "sum"}, "normalize='sum'"),
        ({"kernel": "cuda"}, "kernel='cuda'"),
    ],
)
def test_bad_inputs(kw, msg):
    with pytest.raises(ValueError, match=None) as e:
        _bad(**kw)
    assert msg in str(e.value)


# ---------------------------------------------------------------------------------------------- compile
def test_eager_calls_bypass_the_custom_op_with_the_same_result(monkeypatch):
    import gem.ops.triton_gdpa as tg

    q, k, v, oq, mq, ok, mk = _inputs([5, 0, 9], [7, 3, 2])
    g = torch.randn(q.shape, generator=torch.Generator().manual_seed(2))
    out_op = tg.gdpa_op.fwd_op(q, k, v, oq, ok, mq, mk, "gelu", "", -1, -1, 0.2, 1.0, True, -1)
    want = (out_op, *torch.autograd.grad(out_op, (q, k, v), g))

    def no_op(*args):
        raise AssertionError("the custom op ran in eager mode")

    monkeypatch.setattr(tg.gdpa_op, "fwd_op", no_op)
    out = gdpa(q, k, v, oq, mq, ok, mk, activation="gelu", scale=0.2, kernel="triton")
    got = (out, *torch.autograd.grad(out, (q, k, v), g))
    for a, b in zip(got, want):
        assert torch.equal(a, b)


def test_torch_compile_and_opcheck():
    from gem.ops.triton_gdpa import gdpa_op

    q, k, v, oq, mq, ok, mk = _inputs([5, 9], [7, 2])

    def f(q, k, v):
        return gdpa(q, k, v, oq, mq, ok, mk, activation="silu", kernel="triton").square().sum()

    loss = torch.compile(f, backend="aot_eager", fullgraph=True)(q, k, v)
    grads = torch.autograd.grad(loss, (q, k, v))
    want = f(q, k, v)
    wgrads = torch.autograd.grad(want, (q, k, v))
    torch.testing.assert_close(loss, want)
    for a, b in zip(grads, wgrads):
        torch.testing.assert_close(a, b)
    torch.library.opcheck(
        gdpa_op.fwd_op,
        (q, k, v, oq, ok, mq, mk, "silu", "", -1, -1, 0.2, 1.0, True, -1),
        test_utils=("test_schema", "test_autograd_registration", "test_faketensor"),
    )


# ---------------------------------------------------------------------------------------------- GPU
gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize(
    "activation, approx",
    # silu and gelu_tanh take tanh.approx on the GPU
    [("silu", None), ("gelu", None), ("gelu_tanh", None), ("gelu_tanh", "poly6"), ("relu2", None)],
)
@pytest.mark.parametrize("causal", [False, True])
def test_gpu_self_bf16(activation, approx, causal):
    g = torch.Generator().manual_seed(1)
    lens = torch.randint(1, 700, (9,), generator=g).tolist() + [0, 1, 1024]
    _check(
        lens,
        lens,
        h=4,
        hk=2,
        d=128,
        dtype=torch.bfloat16,
        device="cuda",
        activation=activation,
        approx=approx,
        causal=causal,
        scale=1.0 / 128,
    )


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("activation", ["silu", "gelu_tanh"])
def test_gpu_tanh_form_wide_scores(activation):
    # scores spread over about [-20, 20] (q scaled by 4, scale 1/sqrt(d)): where 0.5*s*(1 + t) cancels for s < 0
    q, k, v, oq, mq, ok, mk = _inputs([300, 1, 77, 0, 512], [300, 1, 77, 0, 512], h=4, hk=2, d=128,
                                      dtype=torch.bfloat16, device="cuda", seed=3)
    q = (4 * q.detach()).requires_grad_()
    out = gdpa(q, k, v, oq, mq, ok, mk, activation=activation, causal=True, kernel="triton")
    q32, k32, v32 = (x.detach().float().requires_grad_() for x in (q, k, v))
    ref = gdpa_reference(q32, k32, v32, oq, mq, ok, mk, activation=activation, causal=True)
    _close(out, ref, torch.bfloat16, "out")
    g = torch.randn_like(out)
    for name, a, b in zip(("dq", "dk", "dv"), torch.autograd.grad(out, (q, k, v), g),
                          torch.autograd.grad(ref, (q32, k32, v32), g.float())):
        _close(a, b, torch.bfloat16, name)


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("short_kv", [None, False])
def test_gpu_cross_short_kv(d, short_kv):
    g = torch.Generator().manual_seed(2)
    lq = torch.randint(1, 1024, (12,), generator=g).tolist() + [0, 5]
    lk = torch.randint(1, 256, (12,), generator=g).tolist() + [7, 0]
    _check(
        lq,
        lk,
        h=4,
        hk=4,
        d=d,
        dtype=torch.bfloat16,
        device="cuda",
        activation="gelu_tanh",
        short_kv=short_kv,
        normalize="max_len_k",
    )


@pytest.mark.gpu
@gpu
def test_gpu_every_config(monkeypatch):
    """Every config of every kernel compiles and matches: the tuner may pick any of them, and GPU tests otherwise run
    only the first (GEM_AUTOTUNE=0). Config i of each list runs together (lists cycle)."""
    from gem.ops import triton_gdpa as tg

    g = torch.Generator().manual_seed(4)
    lq = torch.randint(1, 600, (10,), generator=g).tolist() + [0, 1]
    lk_short = torch.randint(1, 64, (10,), generator=g).tolist() + [5, 0]
    lk_128 = torch.randint(1, 129, (10,), generator=g).tolist() + [128, 0]
    lk_256 = torch.randint(1, 257, (10,), generator=g).tolist() + [256, 0]
    lk_long = torch.randint(1, 300, (10,), generator=g).tolist() + [5, 0]
    kw = {"h": 4, "hk": 2, "dtype": torch.bfloat16, "device": "cuda", "activation": "gelu_tanh"}
    every = dict(tg.CONFIGS)
    for i in range(max(len(c) for c in every.values())):
        for kind, cfgs in every.items():
            monkeypatch.setitem(tg.CONFIGS, kind, [cfgs[i % len(cfgs)]])
        monkeypatch.setattr(tg._TUNER, "best", {})
        _check(lq, lk_short, d=128, short_kv=True, **kw)  # short forward, one-pass backward
        # the short forward on 128- and 256-key tiles (narrow bodies of 32-128 keys), two-pass backward
        _check(lq, lk_128, d=128, short_kv=True, **kw)
        _check(lq, lk_256, d=64, short_kv=True, **kw)
        _check(lq, lk_long, d=128, short_kv=False, **kw)  # 64-row tiled forward and dQ, dK/dV pass
        _check(lq, lq, d=128, causal=True, **kw)
        _check(lq, lk_long, d=64, short_kv=False, **kw)  # 128-row tiled forward and dQ (D <= 64)
        _check(lq, lk_short, d=128, short_kv=True, causal=True, **kw)  # the one-pass backward, masked
        _check(lq, lk_128, d=64, short_kv=True, **kw)  # the one-pass backward on a 128-key tile (D 64)
        _check(lq, lk_256, d=128, short_kv=False, **kw)  # the tiled forward's fused loop (up to 256 keys)


@pytest.mark.gpu
@gpu
def test_gpu_window_fp32():
    lens = [300, 129, 1, 513]
    _check(lens, lens, h=2, hk=1, d=64, dtype=torch.float32, device="cuda", activation="gelu", window=(100, 20))


def test_reference_cpu_default_matches():
    # kernel="auto" follows resolve_kernel; the reference path itself must agree with a direct dense loop
    q, k, v, oq, mq, ok, mk = _inputs([3, 4], [2, 5], h=2, hk=1, d=8)
    out = gdpa(q, k, v, oq, mq, ok, mk, activation="gelu", causal=True, kernel="reference")
    want = torch.zeros_like(out)
    for b in range(2):
        qs, ks = slice(int(oq[b]), int(oq[b + 1])), slice(int(ok[b]), int(ok[b + 1]))
        lq, lk = qs.stop - qs.start, ks.stop - ks.start
        for i in range(lq):
            for j in range(lk):
                if j <= i + lk - lq:
                    s = (q[qs][i] * k[ks][j]).sum(-1) / math.sqrt(8)  # [H]
                    want[qs.start + i] += torch.nn.functional.gelu(s)[:, None] * v[ks][j]
    torch.testing.assert_close(out, want)


@pytest.mark.parametrize("tiles", [0, 2, 4])
def test_fused_forward_loop(monkeypatch, tiles):
    """The unmasked long-K/V forward walks several q tiles per program in one fused loop (pinned here; by default
    for short key loops on a large grid). Sequences with more, fewer and no q tiles than a program holds, keys
    empty, one tile and several."""
    from gem.ops import triton_gdpa

    monkeypatch.setattr(triton_gdpa, "_fused_tiles", lambda *a: tiles)
    _check([70, 0, 33, 1, 5, 49], [9, 40, 0, 17, 1, 33], h=4, hk=2, activation="gelu_tanh", short_kv=False)
    # masked calls keep the per-tile loop
    _check([40, 7], [40, 9], activation="silu", causal=True, short_kv=False)


def test_work_order_matches_reference():
    """Ordered work tables, masked and not, windows wider than any sequence."""
    _check([70, 0, 33, 1], [9, 4, 0, 17], h=4, hk=2, activation="gelu_tanh", short_kv=False)
    _check([40, 7, 23], [40, 9, 23], activation="silu", causal=True, short_kv=False)
    for window in ((2**31 - 1, 0), (2**30, 2**30)):  # wider than any sequence: clamped, no int32 wrap
        for short_kv in (True, False):
            _check([40, 7, 23], [40, 9, 23], activation="silu", window=window, short_kv=short_kv)


def test_bwd_scale_placement():
    """The dK/dV passes scale S and dK, not the loaded q: on the one-pass and the tiled backward, with a scale that
    is not folded anywhere else."""
    for short_kv in (True, False):
        _check([70, 0, 33, 1], [9, 4, 0, 17], h=4, hk=2, activation="gelu_tanh", scale=0.37, short_kv=short_kv)
        _check([40, 7], [40, 9], activation="silu", causal=True, scale=1.9, short_kv=short_kv)
        _check([40, 7], [40, 9], activation="gelu", window=(6, 3), scale=0.6, short_kv=short_kv)  # both edges


def test_fused_loop_default_keeps_waves(monkeypatch):
    """By default a program takes several q tiles only for short key loops and while the grid keeps >= ~4 waves
    (4 "SMs" on CPU)."""
    from gem.ops import triton_gdpa as tg

    cpu = torch.device("cpu")
    assert tg._fused_tiles(500_000, 128, 4, 1000, 1024, 256, cpu) == 8
    assert tg._fused_tiles(500_000, 128, 4, 1000, 300, 256, cpu) == 4  # no more tiles than a sequence has
    assert tg._fused_tiles(2000, 128, 1, 8, 1024, 256, cpu) == 0  # too few programs: one tile each
    assert tg._fused_tiles(500_000, 128, 4, 1000, 1024, 257, cpu) == 0  # long key loops: no fused loop


def test_work_tables_built_once_per_batch(monkeypatch):
    # the layers of a model share a JaggedBatch: one table per pass, reused by later calls and the backward;
    # an in-place write to the offsets (a new batch in the same buffer) rebuilds them and stays correct
    from gem.ops import JaggedBatch, triton_gdpa, triton_utils

    built = []
    real = triton_gdpa.cached

    def counting(attr, oa, ob, key, build):
        return real(attr, oa, ob, key, lambda: built.append(key) or build())

    monkeypatch.setattr(triton_gdpa, "cached", counting)
    monkeypatch.setattr(triton_utils, "batch_cached", counting)
    lq, lk = [40, 0, 17, 33], [9, 5, 0, 30]
    q, k, v, oq, mq, ok, mk = _inputs(lq, lk)
    bq, bk = JaggedBatch(oq, mq), JaggedBatch(ok, mk)
    counts = []
    for _ in range(3):
        out = gdpa(q, k, v, bq, mq, bk, mk, activation="silu", kernel="triton")
        out.sum().backward()
        counts.append(len(built))
    # the forward's table and the backward's (one-pass short K/V here), then no more
    assert counts[0] == 2 and counts[1] == counts[2] == counts[0]
    new_lq = [17, 33, 40, 0]
    oq.copy_(_offsets(new_lq))
    _check(new_lq, lk)  # fresh tensors: builds its own tables
    out = gdpa(q, k, v, bq, None, bk, None, activation="silu", kernel="triton")
    assert len(built) > 2 * counts[0]  # the write bumped oq's version: rebuilt
    ref = gdpa_reference(q, k, v, oq, mq, ok, mk, activation="silu")
    _close(out, ref, torch.float32, "out after an in-place offsets write")
