"""gem.bench.dispatch (scripts/bench_dispatch.py) off the GPU: its argument checks and the crossover table it prints."""

from __future__ import annotations

import pytest
import torch

from gem.bench import dispatch as bench_dispatch


def test_write_needs_three_processes():
    with pytest.raises(SystemExit):
        bench_dispatch.main(["--processes", "2", "--write", "x.json"])


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message on a machine without a GPU")
def test_refuses_without_a_gpu():
    with pytest.raises(SystemExit, match="bench_dispatch: error: needs a CUDA GPU"):
        bench_dispatch.main(["--processes", "1"])


def test_classes_cover_the_issue_shapes():
    cases = bench_dispatch.classes(quick=False)
    assert {(c["n"], c["causal"], c["window"]) for c in cases} >= {
        (256, False, None), (1024, True, None), (8192, False, None), (16384, True, 512), (32768, True, 512)}


def test_report_marks_the_pick(capsys):
    rows = [{"class": "window/32768/128/bfloat16", "backend": b, "process": p, "ms": ms + (p == 1) * (b == "triton")}
            for p in (3, 1, 2) for b, ms in (("triton", 10.0), ("varlen", 8.0))]
    for r in rows:
        if r["backend"] == "triton":  # device time steady, picks the same: the spread is the host's
            r.update(device_ms=9.0 + 0.09 * (r["process"] == 2), configs=["fwd:(64, 64, 4, 2)"])
    rows += [{"class": "window/32768/128/bfloat16", "backend": "sdpa", "process": p, "skipped": "too large"}
             for p in (1, 2, 3)]
    from gem.ops import dispatch

    bench_dispatch.report(rows, dispatch.winners([r for r in rows if "ms" in r]))
    out = capsys.readouterr().out
    line = next(ln for ln in out.splitlines() if ln.startswith("| window"))
    assert line == ("| window/32768/128/bfloat16 | 10.000 / 10.000 / 11.000 (9.000 / 9.000 / 9.090) | "
                    "8.000 / 8.000 / 8.000 | skipped | varlen (1.25x) | 11.000, 10.000, 10.000 (10%) | "
                    "9.000, 9.090, 9.000 (1%) |")
    assert "configs differ" not in out


def test_report_names_picks_that_differ_between_processes(capsys):
    rows = [{"class": "causal/1024/128/bfloat16", "backend": "triton", "process": p, "ms": 1.0, "configs": c}
            for p, c in ((1, ["fwd:(128, 64, 8, 3)"]), (2, ["fwd:(64, 64, 4, 2)"]), (3, ["fwd:(64, 64, 4, 2)"]))]
    bench_dispatch.report(rows, {})
    out = capsys.readouterr().out
    assert "configs differ between processes" in out and "fwd:(128, 64, 8, 3)" in out, out
    assert "| 1.000, 1.000, 1.000 (0%) | n/a |" in out  # no device time recorded: n/a, not a made-up spread


def test_child_times_every_backend_it_can_run(monkeypatch):
    """One process's rows on CPU (Triton interpreted, a stand-in timer): varlen_attn is skipped with its reason."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    tiny = [{"n": 16, "low": 1, "tokens": 48, "heads": 2, "dim": 16, "causal": True, "window": None},
            {"n": 24, "low": 12, "tokens": 48, "heads": 2, "dim": 16, "causal": True, "window": 4}]
    monkeypatch.setattr(bench_dispatch, "classes", lambda quick: tiny)
    calls = []

    def timer(fn, warmup, rep):
        fn()
        calls.append(1)
        return 1.0

    args = bench_dispatch.argparse.Namespace(quick=True, child=2)
    rows = bench_dispatch._child(args, device="cpu", timer=timer)
    assert [(r["class"].split("/")[0], r["backend"]) for r in rows] == [
        ("causal", "triton"), ("causal", "varlen"), ("causal", "sdpa"),
        ("window", "triton"), ("window", "varlen"), ("window", "sdpa")]
    assert all(r["process"] == 2 for r in rows)
    assert [r.get("ms") for r in rows if r["backend"] != "varlen"] == [1.0] * 4 and len(calls) == 4
    assert all(r["skipped"] == "torch's varlen_attn needs CUDA tensors" for r in rows if r["backend"] == "varlen")
    tri = [r for r in rows if r["backend"] == "triton"]
    assert all(isinstance(r["configs"], list) and "device_ms" not in r for r in tri)  # the stand-in timer: no profile
    assert tri[0]["configs"] and all(c.split(":")[0] in ("fwd", "bwd_dq", "bwd_dkdv") for c in tri[0]["configs"])


def test_write_dispatch_replaces_one_environment_and_keeps_the_others(tmp_path):
    """gem.bench.tuned.write_dispatch (--write): this GPU and torch's entry replaced, other environments kept, the
    file still a dispatch table gem.ops.dispatch reads; a file that is not one is refused and left alone."""
    import json

    from gem.bench.tuned import write_dispatch
    from gem.ops import dispatch

    path = tmp_path / "dispatch.json"
    here, other = {"device": "GPU A", "torch": "2.11"}, {"device": "GPU B", "torch": "2.11"}
    old = {"format": dispatch.FORMAT, "entries": [
        {"env": here, "op": "jfa", "classes": {"causal/512/128/bfloat16": {"use": "varlen", "speedup": 1.2}}},
        {"env": other, "op": "jfa", "classes": {"full/256/64/bfloat16": {"use": "sdpa", "speedup": 1.1}}}]}
    path.write_text(json.dumps(old))
    write_dispatch(path, here, "jfa", {"window/32768/128/bfloat16": ("varlen", 1.25, [1.2, 1.25, 1.3])})
    table = dispatch.parse(json.loads(path.read_text()), str(path))
    assert table == {("GPU A", "2.11", "jfa"): {"window/32768/128/bfloat16": "varlen"},
                     ("GPU B", "2.11", "jfa"): {"full/256/64/bfloat16": "sdpa"}}
    write_dispatch(path, here, "jfa", {})  # nothing won here: the entry goes
    assert list(dispatch.parse(json.loads(path.read_text()), str(path))) == [("GPU B", "2.11", "jfa")]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["dispatch.json"]

    bad = tmp_path / "other.json"
    bad.write_text('{"something": "else"}')
    with pytest.raises(ValueError, match="not a gem dispatch table"):
        write_dispatch(bad, here, "jfa", {})
    assert bad.read_text() == '{"something": "else"}'
