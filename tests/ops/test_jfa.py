"""Jagged softmax attention: Triton kernels (interpreted on CPU) against the padded fp64 reference."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gem.ops._common import norm_window, triton_interpreting
from gem.ops.jfa import jagged_attention, jagged_attention_reference

TOL = {torch.float32: 2e-4, torch.bfloat16: 6e-2, torch.float16: 1e-2}


def _offsets(lengths, device="cpu"):
    lens = torch.tensor(lengths, dtype=torch.int64, device=device)
    return torch.nn.functional.pad(lens.cumsum(0), (1, 0))


def _inputs(lens_q, lens_k=None, *, h=2, h_kv=1, d=16, dtype=torch.float32, seed=0, device="cpu"):
    g = torch.Generator(device="cpu").manual_seed(seed)
    tq = sum(lens_q)
    tk = sum(lens_q if lens_k is None else lens_k)
    mk = lambda *s: torch.randn(*s, generator=g).to(device=device, dtype=dtype).requires_grad_()
    return mk(tq, h, d), mk(tk, h_kv, d), mk(tk, h_kv, d)


def _run(q, k, v, lens_q, lens_k=None, *, max_q=None, max_k=None, causal=False, window=None, scale=None,
         kernel="triton", mask_mode="auto", seed=1):
    """-> (out, dq, dk, dv) of the op and of the fp64 reference, for a random upstream gradient."""
    off_q = _offsets(lens_q, q.device)
    off_k = None if lens_k is None else _offsets(lens_k, q.device)
    max_q = max(lens_q, default=0) if max_q is None else max_q
    if lens_k is not None:
        max_k = max(lens_k, default=0) if max_k is None else max_k
    out = jagged_attention(q, k, v, off_q, max_q, off_k, max_k, causal=causal, window=window, scale=scale,
                           kernel=kernel, mask_mode=mask_mode)
    g = torch.randn(out.shape, generator=torch.Generator().manual_seed(seed)).to(out)
    got = (out, *torch.autograd.grad(out, (q, k, v), g))

    left, right = norm_window(causal, window)
    q64, k64, v64 = (t.detach().double().requires_grad_() for t in (q, k, v))
    ref = jagged_attention_reference(q64, k64, v64, off_q, max_q, off_q if off_k is None else off_k,
                                     max_q if off_k is None else max_k, left=left, right=right, scale=scale)
    want = (ref, *torch.autograd.grad(ref, (q64, k64, v64), g.double()))
    return got, want


def _check(got, want, dtype, tol=None):
    tol = TOL[dtype] if tol is None else tol
    tols = tol if isinstance(tol, tuple) else (tol,) * 4  # per output: out, dq, dk, dv
    for name, a, b, tol in zip(("out", "dq", "dk", "dv"), got, want, tols):
        assert a.dtype == dtype and a.shape == b.shape, name
        assert torch.isfinite(a).all(), f"{name} has non-finite values"
        err = (a.double() - b).abs().max().item() if a.numel() else 0.0
        scale = max(1.0, b.abs().max().item() if b.numel() else 0.0)
        assert err <= tol * scale, f"{name}: max error {err:.3e} > {tol * scale:.3e}"


# Block size under the interpreter is 16: lengths straddle it (0, 1, 15, 16, 17, 33, 40).
SELF_CASES = [
    {"lens": [5, 0, 17, 1, 33]},
    {"lens": [5, 0, 17, 1, 33], "causal": True},
    {"lens": [40, 16, 3], "window": 7},
    {"lens": [40, 15, 0, 2], "window": (5, 3)},
    {"lens": [40, 15, 2], "window": (20, None)},
    {"lens": [40, 9], "window": (None, 4)},
    {"lens": [33, 1], "causal": True, "window": (40, 7)},  # right side clipped to 0 by causal
    {"lens": [1]},
    {"lens": [0, 0]},
]


def _pin_form(form, monkeypatch):
    """Pins what the dispatch picks per call: "delta_pre" the long-row backward (as for rows of
    _BWD_DELTA_PRE_MIN_LEN and more), "rowmajor" the fused_delta backward with pointer loads (as for tensors TMA
    cannot take), "tma" the fused_delta backward with
    TMA loads (the dispatch for shorter rows), "auto" nothing."""
    from gem.ops import triton_jfa

    if form == "delta_pre":
        monkeypatch.setattr(triton_jfa, "_BWD_DELTA_PRE_MIN_LEN", 0)
    elif form in ("rowmajor", "tma"):
        monkeypatch.setattr(triton_jfa, "_BWD_DELTA_PRE_MIN_LEN", 1 << 30)
        if form == "rowmajor":
            monkeypatch.setattr(triton_jfa, "_tma_ok", lambda *tensors: False)


@pytest.mark.parametrize("case", SELF_CASES, ids=lambda c: "-".join(f"{k}={v}" for k, v in c.items()))
def test_self_attention_matches_reference(case):
    case = dict(case)
    lens = case.pop("lens")
    q, k, v = _inputs(lens, h=2, h_kv=2)
    got, want = _run(q, k, v, lens, **case)
    _check(got, want, torch.float32)


@pytest.mark.parametrize("causal,window", [(False, None), (True, None), (False, (3, 2)), (False, 6)])
def test_cross_attention_bottom_right_aligned(causal, window):
    lens_q, lens_k = [5, 3, 20, 1, 0, 33], [9, 0, 4, 20, 6, 17]
    q, k, v = _inputs(lens_q, lens_k, h=2, h_kv=1)
    got, want = _run(q, k, v, lens_q, lens_k, causal=causal, window=window)
    _check(got, want, torch.float32)


def test_clamp_window_keeps_every_mask():
    """clamp_window cuts a side only where it cannot bind: the visibility masks (bottom-right aligned, cross
    lengths, 0 and 1 included) are identical before and after, for sides around and far past the cut."""
    from gem.ops._common import clamp_window
    from gem.ops.jfa import visible_mask

    lq, lk = torch.tensor([0, 1, 5, 9, 12, 3]), torch.tensor([4, 1, 0, 9, 7, 12])
    max_q, max_k = 12, 12
    sides = [-1, 0, 1, 2, 3, 6, 10, 11, 12, 13, 2**30, 2**31 - 1]
    for left in sides:
        for right in sides:
            cl, cr = clamp_window(left, right, max_q, max_k)
            assert (cl == -1) == (left == -1) and (cr == -1) == (right == -1)
            assert max(cl, cr) <= 12
            assert torch.equal(visible_mask(lq, lk, max_q, max_k, left, right),
                               visible_mask(lq, lk, max_q, max_k, cl, cr)), (left, right)


def test_work_order_matches_reference():
    """Self and cross, masked or not, windows wider than any sequence included (their sizes must not wrap in the
    work table's int32 arithmetic)."""
    lens = [40, 0, 17, 1, 33]
    q, k, v = _inputs(lens, h=2, h_kv=2)
    for kw in ({"causal": True}, {"window": (5, 3)}, {}, {"window": (2**30, 2**30)}, {"window": (2**31 - 1, 0)}):
        _check(*_run(q, k, v, lens, **kw), torch.float32)
    lens_q, lens_k = [5, 3, 20, 1, 0, 33], [9, 0, 4, 20, 6, 17]
    q, k, v = _inputs(lens_q, lens_k, h=2, h_kv=1)
    _check(*_run(q, k, v, lens_q, lens_k, causal=True), torch.float32)


def test_gqa_and_head_dim_32_max_len_above_lengths():
    lens = [19, 7, 33]
    q, k, v = _inputs(lens, h=4, h_kv=2, d=32)
    # max_len larger than any length (and than a block) only adds empty work items
    got, want = _run(q, k, v, lens, max_q=64, causal=True)
    _check(got, want, torch.float32)


@pytest.mark.parametrize("causal", [False, True])
def test_bfloat16(causal):
    lens = [5, 0, 17, 1, 33]
    q, k, v = _inputs(lens, h=2, h_kv=1, dtype=torch.bfloat16)
    got, want = _run(q, k, v, lens, causal=causal)
    _check(got, want, torch.bfloat16)


@settings(max_examples=6, deadline=None, suppress_health_check=list(HealthCheck))
@given(
    lens=st.lists(st.integers(0, 40), min_size=1, max_size=4),
    group=st.sampled_from([1, 2]),
    causal=st.booleans(),
    window=st.one_of(st.none(), st.integers(0, 20), st.tuples(st.integers(0, 20), st.integers(0, 20))),
    seed=st.integers(0, 1000),
)
@pytest.mark.parametrize("form", ["delta_pre", "tma", "auto"])
def test_hypothesis_shapes(form, lens, group, causal, window, seed, monkeypatch):
    _pin_form(form, monkeypatch)
    q, k, v = _inputs(lens, h=2, h_kv=2 // group, seed=seed)
    got, want = _run(q, k, v, lens, causal=causal, window=window, seed=seed)
    _check(got, want, torch.float32)


# the interpreter warns about inf/NaN in lanes of zero-loaded out-of-sequence keys; those lanes are never stored
@pytest.mark.filterwarnings("ignore::RuntimeWarning")
@pytest.mark.parametrize("mask_mode", ["sub", "inf"])
@pytest.mark.parametrize("causal", [False, True])
def test_large_negative_scores(mask_mode, causal):
    """Real scores far below 0: the zero scores of out-of-sequence keys would dominate the softmax sum."""
    lens = [20, 3, 37]
    q, k, v = _inputs(lens, h=1, h_kv=1)
    with torch.no_grad():
        q.copy_(q.abs() + 1.0)
        k.copy_(-(k.abs() + 1.0))
    # scores around -400 (natural log): 2^(s - 0) underflows in fp32, so the subtraction alone would give 0/0
    got, want = _run(q, k, v, lens, causal=causal, scale=25.0, mask_mode=mask_mode)
    _check(got, want, torch.float32, tol=1e-3)


@pytest.mark.filterwarnings("ignore::RuntimeWarning")
@pytest.mark.parametrize("form", ["delta_pre", "rowmajor", "tma"])
def test_bfloat16_large_scores_keep_their_precision(form, monkeypatch):
    """Scores near -300: scaling q (or k) by scale*log2(e) in bf16 before the dot rounds it, an error proportional
    to |score| (several % of the output here, as on the H200); the kernels scale the fp32 scores instead."""
    _pin_form(form, monkeypatch)
    lens = [20, 3, 37]
    q, k, v = _inputs(lens, h=1, h_kv=1, d=64, dtype=torch.bfloat16)
    with torch.no_grad():
        q.copy_(q.abs() + 1.0)
        k.copy_(-(k.abs() + 1.0))
    got, want = _run(q, k, v, lens, scale=1.5)
    # out 2.2% off before the fix, 0.55% after. dq keeps ~4%: delta = rowsum(dO * O) uses the bf16 output, as in
    # FlashAttention, and the peaked softmax's dP - delta cancels (a float64 emulation shows the same 2-4%).
    _check(got, want, torch.bfloat16, tol=(1e-2, 6e-2, 3e-2, 3e-2))


def test_scale_must_be_positive():
    q = torch.zeros(4, 1, 16)
    off = torch.tensor([0, 4])
    for bad in (0.0, -0.5, float("nan"), float("inf")):
        with pytest.raises(ValueError, match="scale"):
            jagged_attention(q, q, q, off, 4, scale=bad, kernel="triton")


def test_inf_and_sub_variants_agree():
    lens = [5, 0, 17, 1, 33]
    q, k, v = _inputs(lens, h=2, h_kv=1)
    a, _ = _run(q, k, v, lens, window=(9, 4), mask_mode="sub")
    b, _ = _run(q, k, v, lens, window=(9, 4), mask_mode="inf")
    for x, y in zip(a, b):
        torch.testing.assert_close(x, y, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("causal,window,mask_inf", [(False, None, False), (True, None, False), (False, 6, True),
                                                    (False, (3, 2), True), (False, (None, 4), False)])
def test_auto_mask_mode_takes_inf_for_sliding_windows(causal, window, mask_inf, monkeypatch):
    from gem.ops import triton_jfa

    seen = []
    monkeypatch.setattr(triton_jfa, "jfa_triton", lambda *a: seen.append(a[-1]) or a[0])
    q, k, v = _inputs([3, 4])
    jagged_attention(q, k, v, _offsets([3, 4]), 4, causal=causal, window=window, kernel="triton")
    assert seen == [mask_inf]


def test_lse_matches_reference_and_is_inf_for_rows_without_keys():
    from gem.ops.triton_jfa import jfa_triton_with_lse

    lens_q, lens_k = [4, 6, 17], [0, 3, 20]
    q, k, v = _inputs(lens_q, lens_k, h=2, h_kv=2)
    off_q, off_k = _offsets(lens_q), _offsets(lens_k)
    _, lse = jfa_triton_with_lse(q.detach(), k.detach(), v.detach(), off_q, off_k, 17, 20, 0.25, -1, 0)
    # reference logsumexp, causal bottom-right aligned: query i of sequence b sees keys j <= i + Lk - Lq
    for b in range(3):
        for i in range(lens_q[b]):
            row = int(off_q[b]) + i
            n_vis = min(max(i + lens_k[b] - lens_q[b] + 1, 0), lens_k[b])
            for h in range(2):
                if n_vis == 0:
                    assert lse[h, row] == math.inf
                    continue
                keys = k.detach()[int(off_k[b]): int(off_k[b]) + n_vis, h]
                want = torch.logsumexp(keys.double() @ q.detach()[row, h].double() * 0.25, 0)
                assert abs(lse[h, row].item() - want.item()) < 1e-4


def test_backward_is_deterministic():
    lens = [17, 33, 5]
    q, k, v = _inputs(lens, h=4, h_kv=2)
    off = _offsets(lens)
    g = torch.randn(q.shape, generator=torch.Generator().manual_seed(3))
    grads = []
    for _ in range(2):
        out = jagged_attention(q, k, v, off, 33, causal=True, kernel="triton")
        grads.append((out, *torch.autograd.grad(out, (q, k, v), g)))
    for a, b in zip(*grads):
        assert torch.equal(a, b)


def test_eager_calls_bypass_the_custom_op_with_the_same_result(monkeypatch):
    """Eager calls take the autograd.Function (no custom-op dispatch per call); both give bit-identical results."""
    import gem.ops.triton_jfa as tj

    lens = [7, 0, 12]
    q, k, v = _inputs(lens, h=2, h_kv=1)
    off = _offsets(lens)
    g = torch.randn(q.shape, generator=torch.Generator().manual_seed(4))
    out_op, _ = tj.jfa_op.fwd_op(q, k, v, off, off, 12, 12, 0.25, -1, 0, False)
    want = (out_op, *torch.autograd.grad(out_op, (q, k, v), g))

    def no_op(*args):
        raise AssertionError("the custom op ran in eager mode")

    monkeypatch.setattr(tj.jfa_op, "fwd_op", no_op)
    out = jagged_attention(q, k, v, off, 12, causal=True, scale=0.25, kernel="triton")
    got = (out, *torch.autograd.grad(out, (q, k, v), g))
    for a, b in zip(got, want):
        assert torch.equal(a, b)


def test_torch_compile_fullgraph():
    lens = [5, 17, 0]
    q, k, v = _inputs(lens, h=2, h_kv=1)
    off = _offsets(lens)

    def f(q, k, v):
        return (jagged_attention(q, k, v, off, 17, causal=True, kernel="triton") * 2).sum()

    compiled = torch.compile(f, fullgraph=True, backend="aot_eager")
    loss_c = compiled(q, k, v)
    grads_c = torch.autograd.grad(loss_c, (q, k, v))
    loss_e = f(q, k, v)
    grads_e = torch.autograd.grad(loss_e, (q, k, v))
    torch.testing.assert_close(loss_c, loss_e)
    for a, b in zip(grads_c, grads_e):
        torch.testing.assert_close(a, b)


def test_reference_kernel_on_cpu_matches_triton():
    lens = [5, 17, 1]
    q, k, v = _inputs(lens, h=2, h_kv=1)
    off = _offsets(lens)
    a = jagged_attention(q, k, v, off, 17, window=4, kernel="reference")
    b = jagged_attention(q, k, v, off, 17, window=4, kernel="triton")
    torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


# ------------------------------------------------------------------------------------- kernel forms

FORM_CASES = [
    {"lens": [5, 0, 17, 1, 33]},
    {"lens": [5, 0, 17, 1, 33], "causal": True},
    {"lens": [40, 15, 0, 2], "window": (5, 3)},
    {"lens": [40, 9], "window": (None, 4), "mask_mode": "inf"},
    {"lens": [33, 20, 1], "lens_k": [9, 40, 0], "causal": True},
    {"lens": [19, 7, 33], "h": 4, "h_kv": 2, "d": 32, "causal": True, "max_q": 64},
    {"lens": [21, 0, 9, 1], "h": 4, "h_kv": 1},  # GROUP 4: dK/dV's descriptors span the group's heads
    {"lens": [5, 0, 17, 1, 33], "dtype": torch.bfloat16, "causal": True},
]


# every case on every form but auto (the default elsewhere in this file)
_FORM_PARAMS = [(v, c) for v in ("delta_pre", "rowmajor", "tma") for c in FORM_CASES]


@pytest.mark.parametrize("form,case", _FORM_PARAMS,
                         ids=[f"{v}-" + "-".join(f"{k}={x}" for k, x in c.items()) for v, c in _FORM_PARAMS])
def test_forms_match_reference(form, case, monkeypatch):
    _pin_form(form, monkeypatch)
    case = dict(case)
    lens, lens_k = case.pop("lens"), case.pop("lens_k", None)
    shape = {k: case.pop(k) for k in ("h", "h_kv", "d", "dtype") if k in case}
    shape = {"h": 2, "h_kv": 1, **shape}
    q, k, v = _inputs(lens, lens_k, **shape)
    got, want = _run(q, k, v, lens, lens_k, **case)
    _check(got, want, shape.get("dtype", torch.float32))


def test_tma_needs_adjacent_heads_and_falls_back(monkeypatch):
    """Heads that are not adjacent in memory (a slice of a wider tensor) cannot share one descriptor: the tma
    form then takes pointer loads, and still matches the reference."""
    from gem.ops.triton_jfa import _tma_ok

    _pin_form("tma", monkeypatch)
    lens = [13, 0, 6]
    g = torch.Generator().manual_seed(5)
    wide = [torch.randn(sum(lens), 4, 32, generator=g) for _ in range(3)]
    q, k, v = (w[:, :, :16].requires_grad_() for w in wide)
    assert not _tma_ok(q) and _tma_ok(q.detach().contiguous())
    got, want = _run(q, k, v, lens)
    _check(got, want, torch.float32)


@pytest.mark.parametrize("form", ["delta_pre", "rowmajor", "tma"])
def test_fused_qkv_slices_go_in_uncopied(form, monkeypatch):
    """q, k, v as column slices of one fused projection [T, (H + 2 H_kv) D] (what the model's QKV split gives):
    the kernels read them through their strides, with the same result as contiguous copies, and the reference."""
    from gem.ops import triton_jfa

    _pin_form(form, monkeypatch)
    lens, h, h_kv, d = [21, 0, 9, 1, 16], 4, 2, 16
    t = sum(lens)
    fused = torch.randn(t, (h + 2 * h_kv) * d, generator=torch.Generator().manual_seed(7)).requires_grad_()
    q, k, v = (x.unflatten(-1, (-1, d)) for x in fused.split([h * d, h_kv * d, h_kv * d], dim=-1))
    assert not v.is_contiguous() and triton_jfa._unit_last(v) is v
    got, want = _run(q, k, v, lens, causal=True)
    _check(got, want, torch.float32)
    dense = [x.detach().contiguous().requires_grad_() for x in (q, k, v)]
    again, _ = _run(*dense, lens, causal=True)
    for a, b in zip(got, again):
        assert torch.equal(a, b)


@pytest.mark.filterwarnings("ignore::RuntimeWarning")
@pytest.mark.parametrize("form", ["rowmajor", "tma"])
def test_forms_large_negative_scores(form, monkeypatch):
    """The subtraction scheme's cancellation fallback in the v2 forward, and the v2 backward's clamp."""
    _pin_form(form, monkeypatch)
    lens = [20, 3, 37]
    q, k, v = _inputs(lens, h=1, h_kv=1)
    with torch.no_grad():
        q.copy_(q.abs() + 1.0)
        k.copy_(-(k.abs() + 1.0))
    got, want = _run(q, k, v, lens, scale=25.0)
    _check(got, want, torch.float32, tol=1e-3)


def test_forms_agree_and_v2_backward_is_deterministic(monkeypatch):
    lens = [17, 33, 5]
    q, k, v = _inputs(lens, h=2, h_kv=1)
    off = _offsets(lens)
    g = torch.randn(q.shape, generator=torch.Generator().manual_seed(3))
    results = {}
    for form in ["delta_pre", "tma", "tma"]:
        _pin_form(form, monkeypatch)
        out = jagged_attention(q, k, v, off, 33, causal=True, kernel="triton")
        res = (out, *torch.autograd.grad(out, (q, k, v), g))
        if form in results:
            for a, b in zip(results[form], res):
                assert torch.equal(a, b)
        results[form] = res
    for a, b in zip(results["delta_pre"], results["tma"]):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


def test_bwd_form():
    from gem.ops.triton_jfa import _BWD_DELTA_PRE_MIN_LEN as n
    from gem.ops.triton_jfa import _bwd_form

    assert _bwd_form(n, -1) == "delta_pre"  # long, full or causal
    assert _bwd_form(2 * n, -1) == "delta_pre"
    assert _bwd_form(n - 1, -1) == "fused_delta"  # short
    assert _bwd_form(2 * n, 512) == "fused_delta"  # sliding window
    assert _bwd_form(2 * n, 0) == "fused_delta"


def _count_builders(monkeypatch):
    """Counts work table builds and backward launches per form ("delta_pre" / "fused_delta", from _bwd_configs)."""
    from gem.ops import triton_jfa, triton_utils

    calls = {"keys": 0}
    keys, configs = triton_utils._seq_span_table, triton_jfa._bwd_configs

    def counted(*args):
        calls["keys"] += 1
        return keys(*args)

    def bwd_form(d, form):
        calls[form] = calls.get(form, 0) + 1
        return configs(d, form)

    monkeypatch.setattr(triton_utils, "_seq_span_table", counted)
    monkeypatch.setattr(triton_jfa, "_bwd_configs", bwd_form)
    return calls


@pytest.mark.parametrize("form", ["delta_pre", "tma"])
def test_backward_passes_tuned_apart(form, monkeypatch):
    """The dK/dV and dQ passes pick their configs independently: here a pairing no single entry of the list has."""
    from gem.ops import triton_jfa

    _pin_form(form, monkeypatch)
    monkeypatch.delenv("GEM_AUTOTUNE", raising=False)
    monkeypatch.setattr(triton_jfa, "_bwd_configs", lambda d, form: [(16, 16, 16, 16, 4, 1), (32, 16, 16, 32, 4, 1)])
    monkeypatch.setattr(triton_jfa._TUNER, "best", {})
    want = {"bwd_dkdv": (32, 16, 4, 1), "bwd_dq": (16, 16, 4, 1)}  # dK/dV from the 2nd entry, dQ from the 1st
    # candidates are timed in list order, pass by pass: v2 (tma) runs dQ first (it writes delta), base dK/dV first
    clock = iter([1.0, 2.0, 2.0, 1.0] if form == "tma" else [2.0, 1.0, 1.0, 2.0])

    def fake_bench(fn):
        fn()
        return next(clock)

    monkeypatch.setattr(triton_jfa._TUNER, "bench", fake_bench)
    lens = [5, 0, 37, 1, 20]
    q, k, v = _inputs(lens, h=2, h_kv=1)
    got, ref = _run(q, k, v, lens, causal=True)
    _check(got, ref, torch.float32)
    picks = {key[0]: cfg for key, cfg in triton_jfa._TUNER.best.items() if key[0].startswith("bwd")}
    assert picks == want


def test_register_cap_config_launches(monkeypatch):
    """A forward config with a register cap (ptxas's maxnreg) is picked and run like any other; the cap becomes the
    maxnreg launch option on the GPU only (the interpreter rejects nothing, but it has no registers to cap)."""
    from gem.ops import _tune, triton_jfa
    from gem.ops._tune import tile_config

    capped, plain = tile_config(16, 16, 4, 1, 128), tile_config(16, 16, 4, 1)
    monkeypatch.setenv("GEM_AUTOTUNE", "0")
    monkeypatch.setattr(triton_jfa, "_fwd_configs", lambda d, masked=False: [capped])
    monkeypatch.setattr(triton_jfa._TUNER, "best", {})
    lens = [5, 0, 37, 1, 20]
    q, k, v = _inputs(lens, h=2, h_kv=1)
    got, ref = _run(q, k, v, lens, causal=True)
    _check(got, ref, torch.float32)
    assert {cfg for key, cfg in triton_jfa._TUNER.best.items() if key[0] == "fwd"} == {capped}
    assert "maxnreg" not in capped.launch_kwargs() and "maxnreg" not in plain.launch_kwargs()
    # as on the GPU: the cap reaches the forward launch as maxnreg (the interpreter ignores the option)
    monkeypatch.setattr(_tune, "triton_interpreting", lambda: False)
    assert capped.launch_kwargs()["maxnreg"] == 128 and "maxnreg" not in plain.launch_kwargs()
    caps = []
    real = triton_jfa._jfa_fwd_kernel

    class Spy:
        def __getitem__(self, grid):
            return lambda *a, **kw: caps.append(kw.get("maxnreg")) or real[grid](*a, **kw)

    monkeypatch.setattr(triton_jfa, "_jfa_fwd_kernel", Spy())
    for cfg in (capped, plain):
        monkeypatch.setattr(triton_jfa, "_fwd_configs", lambda d, masked=False, c=cfg: [c])
        monkeypatch.setattr(triton_jfa._TUNER, "best", {})
        got, ref = _run(q, k, v, lens, causal=True)
        _check(got, ref, torch.float32)
    assert caps and set(caps) == {128, None} and caps[0] == 128 and caps[-1] is None


def test_gpu_forward_register_caps_leave_room_for_two_programs(monkeypatch):
    """Every capped GPU forward config lets two programs share an SM's 64K registers."""
    from gem.ops import triton_jfa

    monkeypatch.setattr(triton_jfa, "triton_interpreting", lambda: False)
    capped = [c for d in (32, 64, 128, 256) for c in triton_jfa._fwd_configs(d) if c.maxnreg]
    assert capped and all(2 * c.num_warps * 32 * c.maxnreg <= 65536 for c in capped), capped


@pytest.mark.parametrize("base_min_len", [0, 1 << 30])
@pytest.mark.parametrize("causal,window", [(False, None), (True, None), (False, 6)])
def test_auto_runs_both_backward_branches(base_min_len, causal, window, monkeypatch):
    """The base backward only for long rows without a left window, the v2 one otherwise."""
    from gem.ops import triton_jfa

    monkeypatch.setattr(triton_jfa, "_BWD_DELTA_PRE_MIN_LEN", base_min_len)
    monkeypatch.setattr(triton_jfa._TUNER, "best", {})  # candidates are listed only for a key not yet tuned
    calls = _count_builders(monkeypatch)
    lens = [5, 0, 17, 1, 33]
    q, k, v = _inputs(lens, h=2, h_kv=1)
    got, want = _run(q, k, v, lens, causal=causal, window=window)
    _check(got, want, torch.float32)
    base_bwd = base_min_len == 0 and window is None
    # each pass lists its candidates once (tuned apart): two lookups of the form's list
    assert calls.get("delta_pre", 0) == (2 if base_bwd else 0)
    assert calls.get("fused_delta", 0) == (0 if base_bwd else 2)


def _torch_work_table(offsets_a, offsets_b, max_len_a, block, left, right):
    """Reference for the "seq_span" work table: b * NT + tile of every tile of `block` rows, heaviest sequences first
    (La x partner span, capped), each sequence's tiles adjacent in index order; -1 pads."""
    nt = max(1, -(-max_len_a // block))
    la = (offsets_a[1:] - offsets_a[:-1])[:, None].long()
    lb = (offsets_b[1:] - offsets_b[:-1])[:, None].long()
    start = torch.arange(nt)[None, :] * block
    span = torch.minimum(lb, torch.tensor(left + right + 1)) if left >= 0 and right >= 0 else lb
    weight = (la.clamp(max=65535) * span.clamp(max=32767)).expand(-1, nt)
    cost = torch.where(start < la, weight, -1).flatten()
    perm = torch.argsort(cost, descending=True, stable=True)
    return torch.where(cost[perm] >= 0, perm, -1), nt


def _decode(table, nt):
    """A work table's (sequence, tile) rows as b * NT + tile, -1 for spare rows."""
    assert table.dtype == torch.int32 and table.shape[1] == 2
    b, t = table.long().unbind(1)
    assert torch.equal(b < 0, t < 0)
    return torch.where(b < 0, -1, b * nt + t)


def test_work_table_groups_sequences():
    """Heaviest sequences first, each sequence's tiles adjacent (shared K/V stays in L2), either side."""
    from gem.ops.triton_utils import work_table

    off = _offsets([300, 100, 0, 129])
    items = _decode(*work_table("seq_span", off, off, 300, 128, left=-1, right=0, cached=False))
    assert items.tolist() == [0, 1, 2, 9, 10, 3] + [-1] * 6


# (2**30, 2**30): wider than any sequence; the public ops clamp wider ones (clamp_window) before the table
@pytest.mark.parametrize("left,right", [(-1, -1), (-1, 0), (5, 0), (3, 7), (-1, 2), (20, -1), (2**30, 2**30)])
def test_work_keys_match_the_torch_reference(left, right):
    """The one-launch table decodes to the reference order, both sides, cross lengths, empty sequences."""
    from gem.ops.triton_utils import work_table

    off_q, off_k = _offsets([300, 100, 0, 129, 17]), _offsets([40, 100, 7, 0, 300])
    for a, b in ((off_q, off_k), (off_k, off_q)):
        keys, nt = work_table("seq_span", a, b, 300, 32, left=left, right=right, cached=False)
        want, nt_want = _torch_work_table(a, b, 300, 32, left, right)
        assert nt == nt_want
        assert _decode(keys, nt).tolist() == want.tolist()


# ------------------------------------------------------------------------------------- work table cache


def _fwd_bwd(q, k, v, off_q, max_q, off_k=None, max_k=None, **kw):
    out = jagged_attention(q, k, v, off_q, max_q, off_k, max_k, kernel="triton", **kw)
    g = torch.randn(out.shape, generator=torch.Generator().manual_seed(5))
    return (out, *torch.autograd.grad(out, (q, k, v), g))


def _ref_fwd_bwd(q, k, v, off_q, max_q, off_k=None, max_k=None, *, causal=False, window=None):
    left, right = norm_window(causal, window)
    q64, k64, v64 = (t.detach().double().requires_grad_() for t in (q, k, v))
    off_k, max_k = (off_q, max_q) if off_k is None else (off_k, max_k)
    ref = jagged_attention_reference(q64, k64, v64, off_q, max_q, off_k, max_k, left=left, right=right)
    g = torch.randn(ref.shape, generator=torch.Generator().manual_seed(5)).double()
    return (ref, *torch.autograd.grad(ref, (q64, k64, v64), g))


@pytest.mark.parametrize("form", ["auto", "delta_pre"])
def test_batch_keeps_its_tables_for_every_layer(form, monkeypatch):
    from gem.ops import JaggedBatch

    _pin_form(form, monkeypatch)
    calls = _count_builders(monkeypatch)
    lens = [5, 0, 17, 1, 33]
    q, k, v = _inputs(lens, h=2, h_kv=1)
    off = _offsets(lens)
    batch = JaggedBatch(off, 33)
    first = _fwd_bwd(q, k, v, batch, 33, causal=True)
    built = dict(calls)
    # interpreter blocks are all 16 and the table's order depends only on the sequences' lengths: in self attention
    # the forward's table serves both backward passes
    assert built["keys"] == 1
    for _ in range(2):  # another layer given the batch (max_len from it): no rebuild, same bits
        again = _fwd_bwd(q, k, v, batch, None, causal=True)
        assert calls["keys"] == built["keys"]
        for a, b in zip(first, again):
            assert torch.equal(a, b)
    _fwd_bwd(q, k, v, batch, 33, window=4)  # other mask parameters: their own tables
    assert calls["keys"] > built["keys"]
    n = calls["keys"]
    for _ in range(2):  # a plain offsets tensor, call after call: one batch of its own, built once
        plain = _fwd_bwd(q, k, v, off, 33, causal=True)
    assert calls["keys"] == n + 1
    for a, b in zip(first, plain):
        assert torch.equal(a, b)
    _check(first, _ref_fwd_bwd(q, k, v, off, 33, causal=True), torch.float32)
    off.copy_(_offsets([33, 0, 17, 1, 5]))  # written in place: the plain tensor's tables are rebuilt
    got = _fwd_bwd(q, k, v, off, 33, causal=True)
    assert calls["keys"] == n + 2
    _check(got, _ref_fwd_bwd(q, k, v, off, 33, causal=True), torch.float32)
    fresh = _offsets([33, 0, 17, 1, 5])  # another tensor of equal values: its own batch
    _fwd_bwd(q, k, v, fresh, 33, causal=True)
    assert calls["keys"] == n + 3


@pytest.mark.parametrize("form", ["auto", "delta_pre"])
def test_batch_tables_rebuilt_after_in_place_change(form, monkeypatch):
    from gem.ops import JaggedBatch

    _pin_form(form, monkeypatch)
    calls = _count_builders(monkeypatch)
    lens = [5, 17, 1, 33]
    q, k, v = _inputs(lens, h=2, h_kv=1)
    off = _offsets(lens)
    batch = JaggedBatch(off, 33)
    _fwd_bwd(q, k, v, batch, 33, causal=True)
    built = calls["keys"]
    off.copy_(_offsets([33, 1, 21, 1]))  # same total, other sequences: a version bump
    got = _fwd_bwd(q, k, v, batch, 33, causal=True)
    assert calls["keys"] > built
    _check(got, _ref_fwd_bwd(q, k, v, off, 33, causal=True), torch.float32)


@pytest.mark.parametrize("form", ["auto", "delta_pre"])
def test_batch_tables_never_shared_between_batches(form, monkeypatch):
    """Another batch of equal shapes rebuilds; so does another key batch with the same query batch, also when the
    previous key batch was freed and a new object took its id."""
    from gem.ops import JaggedBatch

    _pin_form(form, monkeypatch)
    calls = _count_builders(monkeypatch)
    lens_a, lens_b = [5, 17, 1, 33], [33, 1, 21, 1]
    q, k, v = _inputs(lens_a, h=2, h_kv=1)
    batch_a, batch_b = JaggedBatch(_offsets(lens_a), 33), JaggedBatch(_offsets(lens_b), 33)
    _fwd_bwd(q, k, v, batch_a, 33, causal=True)
    n = calls["keys"]
    got = _fwd_bwd(q, k, v, batch_b, 33, causal=True)
    assert calls["keys"] > n
    _check(got, _ref_fwd_bwd(q, k, v, batch_b.offsets, 33, causal=True), torch.float32)
    lens_k = [[9, 0, 40, 3], [0, 40, 3, 9]]
    for i in range(4):
        lk = lens_k[i % 2]
        _, k2, v2 = _inputs(lens_a, lk, h=2, h_kv=1, seed=i)
        batch_k = JaggedBatch(_offsets(lk), 40)  # the previous one is freed: its id may come back
        got = _fwd_bwd(q, k2, v2, batch_a, 33, batch_k, 40, causal=True)
        _check(got, _ref_fwd_bwd(q, k2, v2, batch_a.offsets, 33, batch_k.offsets, 40, causal=True), torch.float32)
        del batch_k


def test_batch_tables_bounded_and_not_kept_for_inference_tensors(monkeypatch):
    from gem.ops import JaggedBatch, triton_jfa
    from gem.ops._common import TABLES_MAX, batch_scope

    calls = _count_builders(monkeypatch)
    batch = JaggedBatch(_offsets([300, 100, 0, 129]), 300)
    off = batch.offsets
    blocks = [16 * (i + 1) for i in range(TABLES_MAX + 4)]
    with batch_scope((batch, batch)):
        for block in blocks:
            triton_jfa._cached_table(off, off, 300, block, -1, 0)
        assert len(batch.tables()) == TABLES_MAX
        n = calls["keys"]
        keys, nt = triton_jfa._cached_table(off, off, 300, blocks[-1], -1, 0)
        assert calls["keys"] == n  # the newest entries stay
        want, nt_want = _torch_work_table(off, off, 300, blocks[-1], -1, 0)
        assert _decode(keys, nt).tolist() == want.tolist() and nt == nt_want
        triton_jfa._cached_table(off, off, 300, blocks[0], -1, 0)
        assert calls["keys"] == n + 1  # the oldest went
    triton_jfa._cached_table(off, off, 300, blocks[-1], -1, 0)
    assert calls["keys"] == n + 2  # outside an op call with its batches: built every time

    with torch.inference_mode():  # no version counter: never kept
        inf = JaggedBatch(_offsets([3, 4]), 4)
        with batch_scope((inf, inf)):
            for _ in range(2):
                triton_jfa._cached_table(inf.offsets, inf.offsets, 4, 16, -1, -1)
        assert inf.tables() is None
    assert calls["keys"] == n + 4


@pytest.mark.parametrize(
    "kwargs,exc,match",
    [
        ({"q": torch.zeros(4, 2)}, ValueError, "3-D"),
        ({"k": torch.zeros(4, 3, 16), "v": torch.zeros(4, 3, 16)}, ValueError, "multiple of key/value heads"),
        ({"v": torch.zeros(4, 1, 8)}, ValueError, "same shape"),
        ({"q": torch.zeros(4, 2, 16, dtype=torch.float64)}, TypeError, "not supported"),
        ({"k": torch.zeros(4, 1, 16, dtype=torch.float16)}, TypeError, "one dtype"),
        ({"offsets_q": torch.tensor([1, 2, 4])}, ValueError, "start at 0"),
        ({"offsets_q": torch.tensor([0.0, 4.0])}, TypeError, "int32 or int64"),
        ({"max_len_q": -1}, ValueError, "max_len_q"),
        ({"window": (-3, 2)}, ValueError, "window"),
        ({"window": "big"}, TypeError, "window"),
        ({"mask_mode": "nan"}, ValueError, "mask_mode"),
        ({"kernel": "cuda"}, ValueError, "kernel"),
        ({"offsets_k": torch.tensor([0, 4, 4, 4]), "max_len_k": 4}, ValueError, "sequences"),
        ({"q": torch.zeros(4, 2, 300), "k": torch.zeros(4, 1, 300), "v": torch.zeros(4, 1, 300)}, ValueError, "head dim"),
    ],
)
def test_bad_inputs_raise(kwargs, exc, match):
    args = {"q": torch.zeros(4, 2, 16), "k": torch.zeros(4, 1, 16), "v": torch.zeros(4, 1, 16),
                "offsets_q": torch.tensor([0, 1, 4]), "max_len_q": 3, "kernel": "triton"}
    args.update(kwargs)
    with pytest.raises(exc, match=match):
        jagged_attention(**args)


def test_offsets_check_is_cached_per_version_and_sees_in_place_writes():
    q, k, v = torch.zeros(4, 2, 16), torch.zeros(4, 1, 16), torch.zeros(4, 1, 16)
    off = torch.tensor([0, 1, 4])
    jagged_attention(q, k, v, off, 3, kernel="triton")
    off[0] = 1  # an in-place write bumps the version: checked again
    with pytest.raises(ValueError, match="start at 0"):
        jagged_attention(q, k, v, off, 3, kernel="triton")


# ------------------------------------------------------------------------------------------- GPU (H200)

gpu = pytest.mark.gpu


@pytest.fixture
def no_autotune(monkeypatch):
    monkeypatch.setenv("GEM_AUTOTUNE", "0")  # default configs: the tests check results, not speed


def _need_gpu():
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    if triton_interpreting():
        pytest.skip("TRITON_INTERPRET=1 is set: run the GPU tests with TRITON_INTERPRET=0")


_GPU_MASKS = [(False, None), (True, None), (False, 256), (False, (100, 30))]
# every mask on auto, base (first backward) and tma (TMA loads, v2 backward); rowmajor (pointer loads, v2 backward)
# on the masks whose code differs most
_GPU_PARAMS = [(v, d, c, w) for v in ("auto", "delta_pre", "tma") for d in (64, 128) for c, w in _GPU_MASKS]
_GPU_PARAMS += [("rowmajor", 128, c, w) for c, w in _GPU_MASKS[1::2]]


@gpu
@pytest.mark.parametrize("form,d,causal,window", _GPU_PARAMS)
def test_gpu_matches_reference(d, causal, window, form, no_autotune, monkeypatch):
    _need_gpu()
    _pin_form(form, monkeypatch)
    g = torch.Generator().manual_seed(d)
    lens = torch.randint(1, 2049, (6,), generator=g).tolist() + [0, 1, 2048, 129]
    q, k, v = _inputs(lens, h=4, h_kv=2, d=d, dtype=torch.bfloat16, device="cuda")
    got, want = _run(q, k, v, lens, causal=causal, window=window, max_q=2048)
    _check(got, want, torch.bfloat16, tol=3e-2)


@gpu
@pytest.mark.parametrize("form", ["auto", "delta_pre", "rowmajor", "tma"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_gpu_dtypes_and_cross(dtype, form, no_autotune, monkeypatch):
    _need_gpu()
    _pin_form(form, monkeypatch)
    lens_q, lens_k = [300, 0, 1, 777, 64], [1000, 5, 0, 100, 64]
    q, k, v = _inputs(lens_q, lens_k, h=4, h_kv=1, d=64, dtype=dtype, device="cuda")
    got, want = _run(q, k, v, lens_q, lens_k, causal=True)
    _check(got, want, dtype, tol=2e-3 if dtype == torch.float32 else 1e-2)


@gpu
@pytest.mark.parametrize("form", ["auto", "delta_pre", "tma"])
def test_gpu_large_negative_and_determinism(form, no_autotune, monkeypatch):
    _need_gpu()
    _pin_form(form, monkeypatch)
    lens = [1000, 3, 517]
    q, k, v = _inputs(lens, h=2, h_kv=2, d=128, dtype=torch.bfloat16, device="cuda")
    with torch.no_grad():
        q.copy_(q.abs() + 1.0)
        k.copy_(-(k.abs() + 1.0))
    got, want = _run(q, k, v, lens, scale=2.0)
    _check(got, want, torch.bfloat16, tol=(1e-2, 3e-2, 3e-2, 3e-2))  # out was 4.2% off with q pre-scaled in bf16
    again, _ = _run(q, k, v, lens, scale=2.0)
    for a, b in zip(got, again):
        assert torch.equal(a, b)


@gpu
@pytest.mark.parametrize("form,d", [("delta_pre", 128), ("tma", 128), ("tma", 64), ("tma", 256)])
def test_gpu_forms_every_config(form, d, monkeypatch):
    """Every config in the lists compiles, runs and matches on jagged rows with empty and one-token sequences: the
    tuner times every candidate, and one that faults ends the process's CUDA context."""
    _need_gpu()
    from gem.ops import triton_jfa

    _pin_form(form, monkeypatch)
    lens = [1, 700, 2048, 63, 0, 1500]
    q, k, v = _inputs(lens, h=4, h_kv=4, d=d, dtype=torch.bfloat16, device="cuda")
    form = "delta_pre" if form == "delta_pre" else "fused_delta"
    fwd_cfgs, bwd_cfgs = triton_jfa._fwd_configs(d), triton_jfa._bwd_configs(d, form)
    for i in range(max(len(fwd_cfgs), len(bwd_cfgs))):
        f, b = fwd_cfgs[i % len(fwd_cfgs)], bwd_cfgs[i % len(bwd_cfgs)]
        monkeypatch.setattr(triton_jfa, "_fwd_configs", lambda d, f=f: [f])
        monkeypatch.setattr(triton_jfa, "_bwd_configs", lambda d, var, b=b: [b])
        triton_jfa._TUNER.best.clear()
        # full, causal, and a sliding window (its default -inf mask)
        for causal, window in ((False, None), (True, None), (False, 300)):
            got, want = _run(q, k, v, lens, causal=causal, window=window, max_q=2048)
            _check(got, want, torch.bfloat16, tol=3e-2)
    triton_jfa._TUNER.best.clear()


def test_tables_kept_only_in_eager_calls_with_a_batch(monkeypatch):
    """The custom op (what torch.compile runs) rebuilds its tables; the eager path keeps them in the batch."""
    from gem.ops import JaggedBatch, triton_jfa

    lens = [5, 0, 17]
    q, k, v = _inputs(lens, h=2, h_kv=1)
    batch = JaggedBatch(_offsets(lens), 17)
    off = batch.offsets
    # tune the key first: the tuner launches a new key's config once more, which would count as a build
    triton_jfa.jfa_op.fwd_op(q, k, v, _offsets(lens), _offsets(lens), 17, 17, 0.25, -1, 0, False)
    calls = _count_builders(monkeypatch)
    for _ in range(2):
        triton_jfa.jfa_op.fwd_op(q, k, v, off, off, 17, 17, 0.25, -1, 0, False)
    assert calls["keys"] == 2 and not batch.tables()
    _fwd_bwd(q, k, v, batch, 17, causal=True)
    assert batch.tables() and calls["keys"] == 3
