"""The benchmark tools' figures against answers worked out by hand: min / median / max over fresh processes that
disagree, the A/B speedup and the reference step from their medians, bench_compare's B / A column, the timed steps
of one run (the warmup's batches left out), and the `gem` entry point's exit status."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

# A stand-in for a checkout's scripts/bench_train.py whose n-th process measures gem.STEPS[n] ms per step (the count
# lives beside the fake gem package, so each checkout counts its own processes).
_VARYING_BENCH = '''
import json, sys
from pathlib import Path
import gem
args = sys.argv[1:]
out = args[args.index("--json") + 1]
count = Path(gem.__file__).with_name("count")
i = int(count.read_text()) if count.exists() else 0
count.write_text(str(i + 1))
step = gem.STEPS[i]
json.dump({"aggregate": {"step_ms": step, "step_ms_median": step, "tflops_per_device": 1000 / step,
                         "mfu_local": 0.5, "peak_allocated_gib_max": 3.0},
           "config": {"overrides": [a for a in args if "=" in a and not a.startswith("-")], "device": "fake GPU",
                      "torch": "2.11.0"}}, open(out, "w"))
print(f"bench_train summary: {step} ms/step")
'''


def _checkout(root, steps):
    (root / "scripts").mkdir(parents=True)
    (root / "gem").mkdir()
    (root / "gem" / "__init__.py").write_text(f"STEPS = {steps!r}\n")
    (root / "scripts" / "bench_train.py").write_text(_VARYING_BENCH)
    return root


def _as_this_tree(monkeypatch, checkout):
    from gem.bench import processes

    monkeypatch.setattr(processes, "this_tree", lambda: processes.checkout_tree(str(checkout)))


def _cells(line: str) -> list[str]:
    return [c.strip() for c in line.strip().strip("|").split("|")]


def test_processes_that_disagree_give_min_median_max_and_the_speedup_of_the_medians(tmp_path, monkeypatch, capsys):
    from gem.bench.runner import main

    # this: 50, 90, 52 ms (median 52, mean 64); baseline: 80, 200, 81 ms (median 81, mean 120.3)
    _as_this_tree(monkeypatch, _checkout(tmp_path / "this", [50.0, 90.0, 52.0]))
    base = _checkout(tmp_path / "base", [80.0, 200.0, 81.0])
    out = tmp_path / "summary.json"
    assert main(["--processes", "3", "--baseline", str(base), "--json", str(out), "experiment=tiny_cpu"]) == 0
    lines = capsys.readouterr().out.splitlines()
    rows = {c[0]: c for c in map(_cells, lines) if c[0] in ("this", "baseline")}
    # columns: tree, processes ok, step ms mean, step ms median, TFLOP/s, local MFU %, peak GiB, spread
    assert rows["this"][1] == "3 of 3" and rows["this"][2] == "50.0 / 52.0 / 90.0"
    assert rows["baseline"][2] == "80.0 / 81.0 / 200.0"
    # TFLOP/s = 1000 / step: 20.0, 11.1, 19.2 -> min 11.1, median 19.2, max 20.0
    assert rows["this"][4] == "11.1 / 19.2 / 20.0"
    assert rows["this"][7] == "76.9%"  # (90 - 50) / 52
    summary = next(ln for ln in lines if ln.startswith("bench_train processes summary:"))
    assert summary == ("bench_train processes summary: this 50.0 / 52.0 / 90.0 ms | baseline 80.0 / 81.0 / 200.0 ms "
                       "| this vs baseline 1.558x (median of the process means)")  # 81 / 52
    s = json.loads(out.read_text())["summary"]
    assert s["speedup_vs_baseline"] == pytest.approx(81.0 / 52.0)
    assert s["this"]["spread"] == pytest.approx(40.0 / 52.0)


def test_reference_step_from_processes_is_their_median(tmp_path, monkeypatch):
    from gem.bench import processes
    from gem.bench.runner import main
    from gem.plan.estimate import reference_step

    _as_this_tree(monkeypatch, _checkout(tmp_path / "this", [50.0, 90.0, 52.0]))
    monkeypatch.setattr(processes.torch.cuda, "is_available", lambda: True)
    ref = tmp_path / "reference.json"
    assert main(["--processes", "3", "--write-reference", str(ref), "experiment=gpu_base"]) == 0
    body = reference_step(ref)
    assert body["step_ms"] == 52.0 and body["processes"] == 3  # not the fastest (50) nor the mean (64)


def test_bench_compare_change_and_ratio_are_b_against_a(tmp_path):
    from gem.bench.compare import _load, compare

    a = {"aggregate": {"step_ms": 100.0, "mfu_e2e": 0.25, "tflops_per_device": 40.0}}
    b = {"aggregate": {"step_ms": 80.0, "mfu_e2e": 0.3, "tflops_per_device": 50.0}}
    for name, d in (("a.json", a), ("b.json", b)):
        (tmp_path / name).write_text(json.dumps(d))
    rows = {c[0]: c[1:] for c in map(_cells, compare(_load(str(tmp_path / "a.json")), _load(str(tmp_path / "b.json"))))}
    assert rows["step ms (mean)"] == ["100.00", "80.00", "-20.00", "0.800"]
    assert rows["model TFLOP/s per device"] == ["40.0", "50.0", "10.0", "1.250"]
    assert rows["E2E MFU vs vendor peak"] == ["25.0%", "30.0%", "5.0%", "1.200"]
    assert rows["step ms (median)"] == ["n/a", "n/a", "n/a", "n/a"]


def test_timed_figures_leave_the_warmup_steps_out():
    """warmup 2 of 5 steps: the timed steps are 3, 4, 5; their marks' gaps and their batches make the figures."""
    from gem.bench.report import aggregate, rank_result

    trainer = SimpleNamespace(world_size=1, rank=0, is_cuda=False)
    # ms[i] is step i + 2: step 2 (warmup, a slow tuning step) 500 ms, then 10, 20, 30 ms
    rec = SimpleNamespace(step_ms=lambda: [500.0, 10.0, 20.0, 30.0], windows=[], comm=None)
    per_step = [{"samples": s, "tokens": 10 * s, "flops": f} for s, f in
                ((100, 9e12), (7, 8e12), (10, 1e12), (20, 2e12), (30, 3e12))]
    r = rank_result(trainer, rec, per_step, warmup=2, total=5, losses=[5.0, 4.0, 3.0, 2.0, 1.0], measured_peak=None)
    assert r["timed_steps"] == 3 and r["timed_s"] == pytest.approx(0.06)
    assert (r["step_ms_mean"], r["step_ms_median"], r["step_ms_min"], r["step_ms_max"]) == pytest.approx(
        (20.0, 20.0, 10.0, 30.0))
    assert (r["samples"], r["tokens"], r["flops"]) == (60, 600, pytest.approx(6e12))
    assert r["tflops"] == pytest.approx(100.0)  # 6e12 FLOPs in 0.06 s
    assert r["loss_timed_mean"] == pytest.approx(2.0)  # steps 3..5
    r["data_ms_per_batch"] = 1.0
    agg = aggregate([r], 1, None, 1000e12)
    assert agg["step_ms"] == pytest.approx(20.0) and agg["samples_per_s"] == pytest.approx(1000.0)
    assert agg["mfu_e2e"] == pytest.approx(0.1) and agg["mfu_local"] == pytest.approx(0.1)


def test_gem_without_a_command_is_a_usage_error(capsys):
    from gem.cli.main import USAGE, main

    for argv, code in (([], 2), (["--help"], 0), (["-h"], 0)):
        with pytest.raises(SystemExit) as e:
            main(argv)
        assert e.value.code == code, argv
        assert capsys.readouterr().out == USAGE
    with pytest.raises(SystemExit) as e:
        main(["trian", "x=1"])
    assert e.value.code == 2
    assert capsys.readouterr().err == "gem: error: unknown command 'trian' (expected train, plan or bench)\n"
