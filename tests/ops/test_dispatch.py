"""kernel="auto" across backends (gem/ops/dispatch.py) and jagged_attention's torch alternatives: the padded SDPA path
against the reference on CPU, varlen_attn and SDPA on CUDA, the dispatch table's parsing, lookup and the benchmark's
choice rule."""

from __future__ import annotations

import json
import re

import pytest
import torch

from gem.ops import dispatch
from gem.ops.jfa import _unusable, jagged_attention

CASES = [
    # (lens_q, lens_k or None for self attention, causal, window, heads, kv heads, head dim)
    ([5, 0, 17, 1], None, True, None, 4, 2, 24),
    ([5, 0, 17, 1], None, False, None, 2, 2, 7),
    ([5, 0, 17, 1], None, False, (3, 2), 2, 1, 16),
    ([9], None, True, 4, 1, 1, 33),
    ([5, 3, 17, 1], [9, 0, 20, 1], True, None, 2, 2, 24),  # a query sequence with no keys
    ([5, 3, 17, 1], [2, 4, 20, 1], True, 4, 2, 2, 24),  # Lk < Lq under a causal window: leading rows see nothing
    ([0], None, True, None, 2, 2, 16),  # no tokens
    ([1, 1], [1, 3], False, None, 2, 1, 8),
]


def _offsets(lengths, device="cpu"):
    return torch.tensor([0] + torch.tensor(lengths).cumsum(0).tolist(), dtype=torch.int64, device=device)


def _inputs(case, device="cpu", dtype=torch.float32, seed=0):
    lens_q, lens_k, _, _, h, hk, d = case
    g = torch.Generator().manual_seed(seed)
    kk = lens_q if lens_k is None else lens_k
    mk = lambda t, heads: torch.randn(t, heads, d, generator=g).to(device, dtype).requires_grad_()
    return mk(sum(lens_q), h), mk(sum(kk), hk), mk(sum(kk), hk)


def _fwd_bwd(case, kernel, q, k, v):
    lens_q, lens_k, causal, window, *_ = case
    oq = _offsets(lens_q, q.device)
    ok = None if lens_k is None else _offsets(lens_k, q.device)
    out = jagged_attention(q, k, v, oq, max(lens_q), ok, None if lens_k is None else max(lens_k), causal=causal,
                           window=window, kernel=kernel)
    g = torch.randn(out.shape, generator=torch.Generator().manual_seed(1)).to(out)
    return (out, *torch.autograd.grad(out, (q, k, v), g, allow_unused=True))


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"q{c[0]}-k{c[1]}-c{int(c[2])}-w{c[3]}-h{c[4]}/{c[5]}-d{c[6]}")
def test_padded_sdpa_matches_the_reference(case):
    q, k, v = _inputs(case)
    got = _fwd_bwd(case, "sdpa", q, k, v)
    want = _fwd_bwd(case, "reference", q, k, v)
    for name, a, b in zip(("out", "dq", "dk", "dv"), got, want):
        b = torch.zeros_like(a) if b is None else b
        assert a.shape == b.shape, name
        torch.testing.assert_close(a, b, atol=2e-5, rtol=2e-5, msg=name)


def test_alternatives_refuse_what_they_cannot_do():
    case = CASES[0]
    q, k, v = _inputs(case)
    off = _offsets(case[0])
    with pytest.raises(ValueError, match="kernel='varlen': torch's varlen_attn needs CUDA tensors"):
        jagged_attention(q, k, v, off, 17, causal=True, kernel="varlen")
    with pytest.raises(ValueError, match="kernel='sdpa': no HSTU mask and no return_lse"):
        jagged_attention(q, k, v, off, 17, causal=True, kernel="sdpa", return_lse=True)
    with pytest.raises(ValueError, match="kernel='sdpa': no HSTU mask"):
        jagged_attention(q, k, v, off, 17, causal=True, kernel="sdpa", num_targets=torch.tensor([1, 0, 2, 0]))
    with pytest.raises(ValueError, match=r"kernel='flash': expected one of \('auto', 'triton', 'reference', "
                                         r"'varlen', 'sdpa'\)"):
        jagged_attention(q, k, v, off, 17, kernel="flash")


# ------------------------------------------------------------------------------------------- the table


def _table(classes, device="cpu", torch_version=None, op="jfa"):
    env = {"device": device, "torch": torch_version or torch.__version__.split("+")[0]}
    return {"format": 1, "entries": [{"env": env, "op": op, "classes": classes}]}


def test_call_classes():
    assert dispatch.call_class(-1, -1, 1000, 128, torch.bfloat16) == "full/1024/128/bfloat16"
    assert dispatch.call_class(-1, 0, 1024, 100, torch.float16) == "causal/1024/128/float16"
    assert dispatch.call_class(512, 0, 20000, 64, torch.bfloat16) == "window/32768/64/bfloat16"
    assert dispatch.call_class(-1, 3, 0, 7, torch.float32) == "window/16/16/float32"


def test_choose_reads_the_table_for_this_device_and_torch():
    rules = dispatch.parse(_table({"causal/1024/128/bfloat16": {"use": "sdpa", "speedup": 1.2}}), "t.json")
    cpu = torch.device("cpu")
    assert dispatch.choose("jfa", cpu, lambda: "causal/1024/128/bfloat16", rules) == "sdpa"
    assert dispatch.choose("jfa", cpu, lambda: "causal/2048/128/bfloat16", rules) == "triton"
    other_torch = dispatch.parse(_table({"causal/1024/128/bfloat16": {"use": "sdpa"}}, torch_version="0.1"), "t")
    assert dispatch.choose("jfa", cpu, lambda: "causal/1024/128/bfloat16", other_torch) == "triton"
    other_gpu = dispatch.parse(_table({"causal/1024/128/bfloat16": {"use": "sdpa"}}, device="NVIDIA H100"), "t")
    assert dispatch.choose("jfa", cpu, lambda: "causal/1024/128/bfloat16", other_gpu) == "triton"

    def never():
        raise AssertionError("the class is computed only when this device has measured classes")

    assert dispatch.choose("jfa", cpu, never, {}) == "triton"


@pytest.mark.parametrize("body,problem", [
    ([], "not a gem dispatch table"),
    ({"format": 2, "entries": []}, "not a gem dispatch table"),
    ({"format": 1, "entries": [{"op": "jfa"}]}, "entry 0: needs 'env', 'op' and 'classes'"),
    (_table({}, op="gdpa"), "entry 0: op 'gdpa' has no alternatives"),
    (_table({"full/1024/128/bfloat16": {"use": "flex"}}), "class 'full/1024/128/bfloat16' uses 'flex'"),
    (_table({"full/1024": {"use": "sdpa"}}), "class 'full/1024' is not 'mask/length bucket/head dim tile/dtype'"),
    ({"format": 1, "entries": [{"env": {"device": "x"}, "op": "jfa", "classes": {}}]}, "env needs 'device'"),
])
def test_malformed_tables_name_the_file_and_the_problem(body, problem):
    with pytest.raises(ValueError, match=r"^my\.json: .*" + problem.replace("(", r"\(")):
        dispatch.parse(body, "my.json")


def test_the_shipped_table_parses():
    body = json.loads(dispatch.SHIPPED.read_text())
    rules = dispatch.parse(body, str(dispatch.SHIPPED))
    assert rules == dispatch._shipped()
    for entry in body["entries"]:  # every listed class names a measured alternative and its speedup
        key = (entry["env"]["device"], entry["env"]["torch"], entry["op"])
        assert rules[key] == {cls: c["use"] for cls, c in entry["classes"].items()}
        assert all(c["use"] in ("varlen", "sdpa") and c["speedup"] > 1 + dispatch.MARGIN and c["processes"] >= 3
                   for c in entry["classes"].values())


@pytest.fixture
def sdpa_listed(monkeypatch):
    """CASES[0]'s (q, k, v, offsets) under the interpreter (where "auto" resolves to Triton on CPU and consults the
    table), with a table that lists its class, causal/32/32/float32, for padded SDPA on this device."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    rules = dispatch.parse(_table({"causal/32/32/float32": {"use": "sdpa"}}), "t")
    monkeypatch.setattr(dispatch, "_shipped", lambda: rules)
    return (*_inputs(CASES[0]), _offsets(CASES[0][0]))


def test_auto_takes_the_listed_alternative(sdpa_listed, monkeypatch):
    """With a table naming this device, "auto" runs the listed alternative for that class only."""
    q, k, v, off = sdpa_listed
    ran = []
    from gem.ops import jfa

    monkeypatch.setitem(jfa._ALTERNATIVES, "sdpa", lambda *a: ran.append("sdpa") or jfa._padded_sdpa(*a))
    jagged_attention(q, k, v, off, 17, causal=True)
    assert ran == ["sdpa"]
    jagged_attention(q, k, v, off, 17, causal=False, kernel="auto")  # class full|32|32: not listed
    jagged_attention(q, k, v, off, 17, causal=True, kernel="triton")  # named: never dispatched
    jagged_attention(q, k, v, off, 17, causal=True, return_lse=True)  # the alternative cannot: Triton
    assert ran == ["sdpa"]


def test_winners_need_every_process_and_the_margin():
    def rows(cls, triton_ms, alt_ms, alt="varlen"):
        out = []
        for p, (a, b) in enumerate(zip(triton_ms, alt_ms)):
            out += [{"class": cls, "backend": "triton", "process": p, "ms": a},
                    {"class": cls, "backend": alt, "process": p, "ms": b}]
        return out

    res = (rows("window/32768/128/bfloat16", [10, 10, 10], [8, 8.2, 7.9])  # wins everywhere
           + rows("full/1024/128/bfloat16", [10, 10, 10], [9, 9, 10.5])  # loses in one process
           + rows("causal/1024/128/bfloat16", [10, 10, 10], [9.9, 9.8, 9.9])  # inside the margin
           + rows("full/256/64/bfloat16", [1, 1, 1], [0.9, 0.9, 0.9], "sdpa")
           + rows("full/256/64/bfloat16", [1, 1, 1], [0.6, 0.7, 0.6], "varlen")  # the faster of two winners
           + rows("causal/8192/128/bfloat16", [10, 10], [5, 5])
           + [{"class": "causal/8192/128/bfloat16", "backend": "varlen", "process": 2, "ms": 5}])  # unpaired
    got = dispatch.winners(res)
    assert set(got) == {"window/32768/128/bfloat16", "full/256/64/bfloat16"}
    assert got["window/32768/128/bfloat16"][0] == "varlen"
    assert got["window/32768/128/bfloat16"][1] == pytest.approx(10 / 8)
    assert got["full/256/64/bfloat16"][0] == "varlen"


def test_winners_by_kernel_time_ignore_host_bound_event_times():
    """A short-row class as measured on the H200: the lone call's event time is host work (varlen_attn ahead in
    that race), while Triton's kernels are faster; picks by kernel time keep Triton."""
    res = []
    for p, (tri_ev, alt_ev) in enumerate([(1.25, 0.87), (1.38, 1.02), (1.27, 1.08)]):
        res += [{"class": "causal/512/128/bfloat16", "backend": "triton", "process": p, "ms": tri_ev,
                 "device_ms": 0.72},
                {"class": "causal/512/128/bfloat16", "backend": "varlen", "process": p, "ms": alt_ev,
                 "device_ms": 0.87}]
    assert dispatch.winners(res)["causal/512/128/bfloat16"][0] == "varlen"
    assert dispatch.winners(res, key="device_ms") == {}


# ------------------------------------------------------------------------------------------- GPU


@pytest.mark.gpu
@pytest.mark.parametrize("kernel", ["varlen", "sdpa"])
@pytest.mark.parametrize("case", [c for c in CASES if c[6] % 8 == 0],
                         ids=lambda c: f"q{c[0]}-k{c[1]}-c{int(c[2])}-w{c[3]}-h{c[4]}/{c[5]}-d{c[6]}")
def test_gpu_alternatives_match_the_reference(case, kernel):
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    q, k, v = _inputs(case, "cuda", torch.bfloat16)
    why = _unusable(kernel, q, k, None, False)
    if why:  # e.g. GQA on a torch whose varlen_attn lacks enable_gqa: one clear line, not a wrong answer
        with pytest.raises(ValueError, match=re.escape(f"kernel='{kernel}': {why}")):
            _fwd_bwd(case, kernel, q, k, v)
        return
    got = _fwd_bwd(case, kernel, q, k, v)
    want = _fwd_bwd(case, "reference", *(x.detach().float().requires_grad_() for x in (q, k, v)))
    for name, a, b in zip(("out", "dq", "dk", "dv"), got, want):
        b = torch.zeros_like(b) if a is None else b
        a = torch.zeros_like(b) if a is None else a
        scale = max(1.0, b.abs().max().item() if b.numel() else 0.0)
        err = (a.float() - b).abs().max().item() if a.numel() else 0.0
        assert err <= 2e-2 * scale, f"{kernel} {name}: max error {err:.3e}"


def test_merged_tables_round_trip_and_replace_only_their_entry():
    won = {"window/32768/128/bfloat16": ("varlen", 1.31, [1.29, 1.31, 1.35])}
    env = {"device": "cpu", "torch": torch.__version__.split("+")[0]}
    other = {"env": {"device": "NVIDIA H100", "torch": "2.11.0"}, "op": "jfa",
             "classes": {"full/256/64/bfloat16": {"use": "sdpa"}}}
    old_mine = {"env": env, "op": "jfa", "classes": {"full/1024/128/bfloat16": {"use": "sdpa"}}}
    body = dispatch.merged({"format": 1, "entries": [other, old_mine]}, env, "jfa", won)
    rules = dispatch.parse(json.loads(json.dumps(body)), "t")
    cpu = torch.device("cpu")
    assert dispatch.choose("jfa", cpu, lambda: "window/32768/128/bfloat16", rules) == "varlen"
    assert dispatch.choose("jfa", cpu, lambda: "full/1024/128/bfloat16", rules) == "triton"  # replaced
    assert rules[("NVIDIA H100", "2.11.0", "jfa")] == {"full/256/64/bfloat16": "sdpa"}  # kept
    mine = next(e for e in body["entries"] if e["env"] == env)
    assert mine["classes"]["window/32768/128/bfloat16"] == {"use": "varlen", "speedup": 1.31, "processes": 3}
    assert dispatch.merged(None, env, "jfa", {}) == {"format": 1, "entries": []}


def test_compiled_calls_keep_triton(sdpa_listed, monkeypatch):
    """Under torch.compile "auto" stays on the Triton custom op (no table lookup in the graph)."""
    q, k, v, off = sdpa_listed
    from gem.ops import jfa

    monkeypatch.setitem(jfa._ALTERNATIVES, "sdpa", lambda *a: (_ for _ in ()).throw(AssertionError("dispatched")))
    torch._dynamo.reset()
    f = torch.compile(lambda a, b, c: jagged_attention(a, b, c, off, 17, causal=True), fullgraph=True,
                      backend="aot_eager")
    want = jagged_attention(q, k, v, off, 17, causal=True, kernel="triton")
    torch.testing.assert_close(f(q, k, v), want)


@pytest.mark.gpu
def test_gpu_padded_sdpa_never_syncs_the_host():
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    for lens_q, lens_k, causal, window, *_ in (CASES[0], CASES[2], CASES[4]):
        case = (lens_q, lens_k, causal, window, *_)
        q, k, v = _inputs(case, "cuda", torch.bfloat16)
        oq = _offsets(lens_q, "cuda")
        ok = None if lens_k is None else _offsets(lens_k, "cuda")
        mk = None if lens_k is None else max(lens_k)

        def step(g=None):
            out = jagged_attention(q, k, v, oq, max(lens_q), ok, mk, causal=causal, window=window, kernel="sdpa")
            torch.autograd.grad(out, (q, k, v), torch.ones_like(out) if g is None else g)

        step()  # first-call work (checks of new offsets, library loads) may sync
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            step()
        finally:
            torch.cuda.set_sync_debug_mode("default")
