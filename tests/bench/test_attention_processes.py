"""bench_attention --processes: rows of several fresh processes summarised as min / median / max and spread."""

import json
import math
import subprocess
import types

import pytest

import gem.bench.attention as bench
from gem.bench.kernels import Row, Stat, aggregate_rows, dump_json, largest_spread, load_json, print_table

CASE = "full N=1024 H=4 D=128 B=16"


def _ours(fwd, bwd, **extra):
    return Row("jfa", CASE, "ours (sub mask)", fwd_ms=fwd, bwd_ms=bwd, fwd_tflops=100 / fwd, bwd_tflops=250 / bwd,
               mem_mb=512.0, extra={"N": 1024, **extra})


def _varlen(fwd, bwd):
    return Row("jfa", CASE, "varlen_attn", fwd_ms=fwd, bwd_ms=bwd, fwd_tflops=100 / fwd, bwd_tflops=250 / bwd,
               mem_mb=600.0, extra={"N": 1024})


def _runs():
    """Three processes; varlen_attn failed in the second (no row), as a competitor missing there would."""
    ours = [(1.0, 2.0), (2.0, 2.2), (4.0, 2.1)]
    varlen = {0: (1.0, 3.0), 2: (5.0, 3.3)}
    runs = []
    for p, (f, b) in enumerate(ours):
        rows = []
        if p in varlen:  # the ratio notes as the sections write them: this process's own times
            vf, vb = varlen[p]
            rows.append(_ours(f, b, xvarlen=f"{vf / f:.2f}/{vb / b:.2f}", fwd_speedup=round(vf / f, 2)))
            rows.append(_varlen(vf, vb))
        else:
            rows.append(_ours(f, b, skipped_competitor="varlen_attn: RuntimeError"))
        rows.append(Row("gdpa", "memory anchor: 1 GiB copy", "torch copy_ (device ms)", fwd_ms=0.3 + p / 100,
                        extra={"TBps": 7.0}))
        runs.append(rows)
    return runs


def _by_impl(agg):
    return {(r.section, r.impl): r for r in agg}


def test_min_median_max_over_processes():
    agg = aggregate_rows(_runs())
    assert [(r.section, r.impl) for r in agg] == [("jfa", "ours (sub mask)"), ("jfa", "varlen_attn"),
                                                 ("gdpa", "torch copy_ (device ms)")]
    ours = _by_impl(agg)["jfa", "ours (sub mask)"]
    assert ours.processes == 3 and "processes" not in ours.extra
    assert ours.fwd_ms == Stat(1.0, 2.0, 4.0, 3)
    assert ours.bwd_ms == Stat(2.0, 2.1, 2.2, 3)
    assert ours.fwd_tflops == Stat(25.0, 50.0, 100.0, 3)  # each process's own rate, not 100 / median time
    assert ours.mem_mb == Stat(512.0, 512.0, 512.0, 3)
    assert str(ours.extra["N"]) == "1024"  # the same in every process: one value
    assert ours.extra["skipped_competitor"] == "varlen_attn: RuntimeError"  # a note only one process has
    copy = _by_impl(agg)["gdpa", "torch copy_ (device ms)"]
    assert (copy.fwd_ms.min, copy.fwd_ms.median, copy.fwd_ms.max) == pytest.approx((0.30, 0.31, 0.32))
    assert copy.bwd_ms.n == 0 and math.isnan(copy.bwd_ms.median)  # never timed: nan, not 0


def test_table_keeps_its_columns_and_shows_min_median_max(capsys):
    agg = aggregate_rows(_runs())
    print_table(agg, "jfa")
    lines = capsys.readouterr().out.splitlines()
    assert lines[2] == "| section | case | impl | fwd ms | bwd ms | fwd TFLOP/s | bwd TFLOP/s | peak MB | notes |"
    ours = next(ln for ln in lines if "| ours (sub mask) |" in ln)
    cells = [c.strip() for c in ours.split("|")[1:-1]]
    assert cells[3:8] == ["1.000 / 2.000 / 4.000", "2.000 / 2.100 / 2.200", "25.0 / 50.0 / 100.0",
                          "113.6 / 119.0 / 125.0", "512 / 512 / 512"]
    copy = next(ln for ln in lines if "torch copy_" in ln)
    assert "| nan |" in copy  # bwd never timed


def test_spread_is_max_minus_min_over_median():
    agg = aggregate_rows(_runs())
    ours = _by_impl(agg)["jfa", "ours (sub mask)"]
    assert ours.fwd_ms.spread_pct == pytest.approx(150.0)  # (4 - 1) / 2
    assert ours.bwd_ms.spread_pct == pytest.approx(100 * 0.2 / 2.1)
    varlen = _by_impl(agg)["jfa", "varlen_attn"]
    assert varlen.fwd_ms.spread_pct == pytest.approx(100 * 4 / 3)  # 2 processes: median = mean of the two
    assert math.isnan(Stat.of([1.0]).spread_pct)  # one measurement has no spread
    pct, row, part = largest_spread(agg)
    assert (pct, row.impl, part) == (pytest.approx(150.0), "ours (sub mask)", "fwd")


def test_row_missing_in_one_process_is_summarised_from_the_others():
    varlen = _by_impl(aggregate_rows(_runs()))["jfa", "varlen_attn"]
    assert varlen.processes == 2 and varlen.extra["processes"] == "2/3"
    assert varlen.fwd_ms == Stat(1.0, 3.0, 5.0, 2)
    assert varlen.bwd_ms.n == 2 and varlen.bwd_ms.median == pytest.approx(3.15)


def test_ratios_come_from_each_process_not_from_the_medians():
    ours = _by_impl(aggregate_rows(_runs()))["jfa", "ours (sub mask)"]
    # per-process fwd ratios 1.0 (process 1) and 1.25 (process 3); medians would give 3.0 / 2.0 = 1.5
    fwd, bwd = ours.extra["xvarlen"]
    assert (fwd.min, fwd.median, fwd.max, fwd.n) == pytest.approx((1.0, 1.125, 1.25, 2))
    assert (bwd.min, bwd.max) == pytest.approx((1.5, 1.57))
    assert str(ours.extra["xvarlen"]) == "(1 / 1.125 / 1.25)/(1.5 / 1.535 / 1.57)"
    speedup = ours.extra["fwd_speedup"]
    assert (speedup.min, speedup.median, speedup.max, speedup.n) == pytest.approx((1.0, 1.125, 1.25, 2))


def test_json_holds_every_process_and_the_summary(tmp_path):
    runs = _runs()
    path = tmp_path / "rows.json"
    dump_json(runs[0], str(path))
    assert repr(load_json(str(path))) == repr(runs[0])  # repr: nan != nan
    dump_json({"processes": runs, "aggregate": aggregate_rows(runs)}, str(path))
    data = json.loads(path.read_text())
    assert [len(p) for p in data["processes"]] == [3, 2, 3]
    ours = data["aggregate"][0]
    assert ours["impl"] == "ours (sub mask)" and ours["processes"] == 3
    assert ours["fwd_ms"] == {"min": 1.0, "median": 2.0, "max": 4.0, "n": 3}
    assert ours["extra"]["xvarlen"][0]["median"] == pytest.approx(1.125)
    assert not (tmp_path / "rows.json.tmp").exists()


def test_child_argv_drops_the_parents_options_only():
    argv = ["--sections", "jfa", "--processes", "3", "--json=out.json", "--plo", "p.png", "--quick",
            "--jfa-anchors", "varlen_attn"]
    assert bench.child_argv(argv) == ["--sections", "jfa", "--quick", "--jfa-anchors", "varlen_attn"]


def _no_spawn(*a, **k):
    raise AssertionError("spawned a child")


def test_without_cuda_the_parent_spawns_nothing(monkeypatch):
    monkeypatch.setattr(bench.torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(subprocess, "run", _no_spawn)
    with pytest.raises(SystemExit, match="needs a CUDA device"):
        bench.main(["--processes", "3"])
    with pytest.raises(SystemExit) as e:
        bench.main(["--processes", "0"])
    assert e.value.code == 2


def _fake_children(monkeypatch, outcomes):
    """subprocess.run standing in for the children: outcome i is a row list (written to the child's --json) or an
    exit status with its stderr."""
    calls = []

    def run(cmd, **kwargs):
        calls.append(cmd)
        out = outcomes[len(calls) - 1]
        if isinstance(out, int):
            return types.SimpleNamespace(returncode=out, stdout="", stderr="Traceback ...\nRuntimeError: boom\n")
        dump_json(out, cmd[cmd.index("--json") + 1])
        return types.SimpleNamespace(returncode=0, stdout="measured bf16 matmul peak: 790 TFLOP/s\n", stderr="")

    monkeypatch.setattr(bench.torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(subprocess, "run", run)
    return calls


def test_parent_runs_children_in_sequence_and_reports_a_failed_one(monkeypatch, capsys, tmp_path):
    runs = _runs()
    calls = _fake_children(monkeypatch, [runs[0], -9, runs[2]])
    bench.main(["--sections", "jfa", "--processes", "3", "--json", str(tmp_path / "all.json")])
    assert len(calls) == 3
    assert all(c[1:3] == ["-m", "gem.bench.attention"] and c[3:5] == ["--sections", "jfa"] and "--processes" not in c
               for c in calls)
    assert len({c[c.index("--json") + 1] for c in calls}) == 3
    out = capsys.readouterr().out
    assert "process 2/3: failed (killed by signal 9, 0 s): Traceback ... / RuntimeError: boom" in out
    assert "## jfa: min / median / max over 2 processes (1 of 3 failed)" in out
    # varlen_attn fwd 1 and 5 ms: (5 - 1) / 3
    assert f"largest process-to-process spread: 133.3% (jfa | {CASE} | varlen_attn, fwd)" in out
    data = json.loads((tmp_path / "all.json").read_text())
    assert [p["status"] for p in data["processes"]] == ["ok", "killed by signal 9", "ok"]


def test_parent_fails_when_every_child_fails(monkeypatch, capsys):
    _fake_children(monkeypatch, [1, 1])
    with pytest.raises(SystemExit, match="all 2 processes failed"):
        bench.main(["--processes", "2"])
    assert capsys.readouterr().out.count("failed (exit status 1") == 2


def test_stderr_tail_keeps_the_cause_of_an_abort():
    from gem.bench.processes import stderr_tail

    frames = "\n".join(f"frame #{i}: <unknown function> + 0x{i:x}" for i in range(20))
    abort = ("warming up\nterminate called after throwing an instance of 'c10::AcceleratorError'\n"
             "  what():  CUDA error: an illegal memory access was encountered\n" + frames)
    line = stderr_tail(abort)
    assert line.startswith("what():  CUDA error: an illegal memory access") and line.endswith("frame #19: <unknown "
                                                                                             "function> + 0x13")
    py = "Traceback (most recent call last):\n  File \"x.py\", line 1\n    f()\nValueError: bad length"
    assert stderr_tail(py) == 'File "x.py", line 1 / f() / ValueError: bad length'
    assert stderr_tail("  \n") == "no stderr"
