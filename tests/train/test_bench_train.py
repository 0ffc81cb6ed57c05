"""The training benchmark (gem.bench, run as scripts/bench_train.py) as a GPU run uses it, on CPU: the op profile
of its last steps, the fresh-process and A/B runs."""

from __future__ import annotations

import json
import re
import subprocess
import sys

import pytest
import torch

from tests.train._util import ROOT, env


def test_profile_steps_cpu(tmp_path):
    out, traces = tmp_path / "bench.json", tmp_path / "traces"
    cmd = [sys.executable, str(ROOT / "scripts" / "bench_train.py"), "--warmup", "2", "--steps", "4",
           "--profile-steps", "2", "--profile-dir", str(traces), "--profile-sources", "aten::mm", "--profile-top", "7",
           "--json", str(out), "experiment=tiny_cpu"]
    p = subprocess.run(cmd, cwd=tmp_path, env=env(tmp_path), capture_output=True, text=True, timeout=240, check=False)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    lines = p.stdout.splitlines()
    assert "| op | calls/step | self device ms/step | % of profiled CPU time | self CPU ms/step |" in lines, p.stdout
    assert any(ln.startswith("## op profile, rank 0: steps 5..6 recorded") for ln in lines), p.stdout
    buckets = [ln for ln in lines if ln.startswith("bench_train profile buckets (rank 0")]
    assert len(buckets) == 1 and all(b in buckets[0] for b in ("matmul/gemm", "attention", "nccl/comm",
                                                               "embedding", "elementwise/other")), p.stdout
    assert any(ln.startswith("bench_train summary:") for ln in lines)  # the usual report still comes first
    for row in ("| input |", "| forward |", "| backward |", "| optimizer |", "| exposed comm (inside the phases above) |"):
        assert any(ln.startswith(row) for ln in lines), (row, p.stdout)

    res = json.loads(out.read_text())
    agg = res["aggregate"]  # one rank: no communication, so local MFU is E2E MFU
    assert agg["scaling_ratio"] == 1.0 and agg["exposed_comm_ms"] == 0.0
    assert sorted(agg["phase_ms"]) == ["backward", "forward", "input", "optimizer"]
    assert 0 < sum(agg["phase_ms"].values()) <= 1.05 * agg["step_ms"]
    prof = res["profile"]
    assert prof["recorded_steps"] == [5, 6] and prof["profiler_warmup_step"] == 4
    rank0 = prof["ranks"][0]
    assert len(rank0["rows"]) == 7 and rank0["rows"][0]["self_cpu_ms_per_step"] > 0  # --profile-top 7
    assert sum(b["pct"] for b in rank0["buckets"].values()) > 0.999
    assert "profile" not in res["ranks"][0] and res["ranks"][0]["step_ms_profiled_mean"] > 0
    # aten::mm split by caller: the forward's projections name their gem functions (innermost first)
    sites = {x["site"]: x for x in rank0["sources"]}
    assert all(x["op"] == "aten::mm" and x["calls_per_step"] > 0 for x in rank0["sources"]), rank0["sources"]
    assert any(site.startswith("gem/model/attention.py(") and "project" in site for site in sites), sites
    assert any(ln.startswith("| aten::mm | gem/model/attention.py(") for ln in lines), p.stdout
    # each row carries its inputs' shapes and dtypes: a matmul's two 2-D operands
    assert all(re.fullmatch(r"\[\d+, \d+\] \S+, \[\d+, \d+\] \S+", x["inputs"]) for x in rank0["sources"]), \
        rank0["sources"]
    # the backward's matmuls sit at the forward site of the node they run for
    assert any(site.startswith("backward of gem/model/attention.py(") and site.endswith("(MmBackward0)")
               for site in sites), sites
    assert sorted(f.name for f in traces.iterdir()) == ["trace_rank0.json"]  # no temp file left behind
    assert json.loads((traces / "trace_rank0.json").read_text())["traceEvents"]


def test_profile_buckets_by_kernel_and_op_name():
    """Inductor's fused pointwise kernels named after a matmul they follow stay elementwise; GEMMs, attention ops
    (through the launching op) and collectives land in their buckets."""
    from types import SimpleNamespace

    from gem.bench.profiler import _bucket

    def op(name, parent=None):
        return SimpleNamespace(name=name, cpu_parent=parent)

    assert _bucket("triton_poi_fused__grouped_mm_mul_silu_silu_backward_11", None, {}) == "elementwise/other"
    assert _bucket(None, op("triton_red_fused__to_copy_mm_sum_3"), {}) == "elementwise/other"
    assert _bucket("nvjet_sm90_tst_128x256_64x4_2x1_v_bz_coopA_NTN", op("aten::mm"), {}) == "matmul/gemm"
    assert _bucket("cutlass_kernel", op("aten::_grouped_mm"), {}) == "matmul/gemm"
    assert _bucket("_fwd_kernel", op("triton_fn", op("_JfaFn")), {}) == "attention"
    assert _bucket("ncclDevKernel_AllGather", op("aten::mul"), {}) == "nccl/comm"
    assert _bucket("elementwise_kernel", op("aten::copy_"), {}) == "elementwise/other"


def test_call_sites_outside_gem_name_the_library_frames():
    """An op with no gem frame above it is labelled by the innermost library frames (site-packages stripped), and
    its inputs by shape and dtype; a stack with no Python frame at all says so."""
    from types import SimpleNamespace as Ev

    from gem.bench import profiler as bt

    def chain(*names):
        parent = None
        for name in reversed(names):  # outermost first in the list's tail
            parent = Ev(name=name, cpu_parent=parent)
        return parent

    op = Ev(name="aten::copy_", cpu_parent=chain(
        "<built-in method copy_ of Tensor object at 0x1>",
        "/opt/venv/lib/python3.12/site-packages/torchrec/distributed/embedding.py(812): compute",
        "/opt/venv/lib/python3.12/site-packages/torch/nn/modules/module.py(1775): _call_impl",
        "/opt/venv/lib/python3.12/site-packages/torch/nn/modules/module.py(1786): _wrapped_call_impl"),
        input_shapes=[[65536, 1024], [65536, 1024], []], input_dtypes=["c10::BFloat16", "float", "Scalar"])
    assert bt._gem_frames(op) == ""
    assert bt._outer_frames(op) == ("torchrec/distributed/embedding.py(812): compute < "
                                    "torch/nn/modules/module.py(1775): _call_impl")
    assert bt._inputs_of(op) == "[65536, 1024] bf16, [65536, 1024] f32"
    bare = Ev(name="aten::add_", cpu_parent=chain("autograd::engine::evaluate_function: AddBackward0"),
              input_shapes=[], input_dtypes=[])
    assert bt._outer_frames(bare) == "" and bt._inputs_of(bare) == ""


_FAKE_BENCH = '''
import json, sys
import gem  # this checkout's own package: the parent puts the checkout first on PYTHONPATH
args = sys.argv[1:]
out = args[args.index("--json") + 1]
step = {"fast": 50.0, "slow": 80.0}[gem.MARK]
json.dump({"aggregate": {"step_ms": step, "step_ms_median": step - 1, "tflops_per_device": 1000 / step,
                         "mfu_local": 0.5, "peak_allocated_gib_max": 3.0, "argv": args},
           "config": {"overrides": [a for a in args if "=" in a and not a.startswith("-")], "device": "fake GPU",
                      "torch": "2.11.0", "triton": "3.6.0"}}, open(out, "w"))
print(f"bench_train summary: fake {gem.MARK} {step} ms/step")
'''


def _fake_checkout(root, mark, *, fail=False):
    (root / "scripts").mkdir(parents=True)
    (root / "gem").mkdir()
    (root / "gem" / "__init__.py").write_text(f"MARK = {mark!r}\n")
    (root / "scripts" / "bench_train.py").write_text("import sys; sys.exit(3)\n" if fail else _FAKE_BENCH)
    return root


def _this_tree(monkeypatch, checkout):
    """The "this" tree of the A/B runs: a fake checkout's script instead of `python -m gem.bench`."""
    from gem.bench import processes

    monkeypatch.setattr(processes, "this_tree", lambda: processes.checkout_tree(str(checkout)))


def test_processes_alternate_with_a_baseline_and_summarise(tmp_path, monkeypatch):
    """--processes N --baseline DIR: N fresh processes of each tree, alternating, each importing its own checkout's
    gem; the parent's options stay with the parent; min / median / max per tree and the speedup of the medians."""
    from gem.bench.runner import main

    this = _fake_checkout(tmp_path / "this", "fast")
    base = _fake_checkout(tmp_path / "base", "slow")
    out = tmp_path / "summary.json"
    _this_tree(monkeypatch, this)
    code = main(["--processes", "3", "--baseline", str(base), "--json", str(out), "--warmup", "3",
                 "experiment=tiny_cpu"])
    assert code == 0
    res = json.loads(out.read_text())
    assert [(r["process"], r["tree"]) for r in res["processes"]] == [
        (i, t) for i in (1, 2, 3) for t in ("this", "baseline")]
    for r in res["processes"]:
        assert r["status"] == "ok" and r["aggregate"]["step_ms"] == (50.0 if r["tree"] == "this" else 80.0)
        argv = r["aggregate"]["argv"]
        assert argv[:3] == ["--warmup", "3", "experiment=tiny_cpu"] and argv[3] == "--json" and len(argv) == 5
    s = res["summary"]
    assert s["this"]["step_ms"] == [50.0] * 3 and s["baseline"]["step_ms"] == [80.0] * 3
    assert s["this"]["mfu_local"] == [50.0] * 3 and s["this"]["spread"] == 0.0
    assert s["speedup_vs_baseline"] == pytest.approx(80.0 / 50.0)


def test_this_tree_runs_the_imported_gem():
    """Without a baseline the children run `python -m gem.bench` with this gem's folder first on the path."""
    import gem
    from gem.bench.processes import this_tree

    cmd, root = this_tree()
    assert cmd == [sys.executable, "-m", "gem.bench"] and (root / "gem" / "__init__.py").samefile(gem.__file__)


def test_processes_fail_loudly_when_a_tree_never_runs(tmp_path, capsys, monkeypatch):
    from gem.bench.runner import main

    base = _fake_checkout(tmp_path / "base", "slow", fail=True)
    _this_tree(monkeypatch, _fake_checkout(tmp_path / "this", "fast"))
    code = main(["--baseline", str(base), "experiment=tiny_cpu"])
    assert code == 2
    err = capsys.readouterr()
    assert "every process of baseline failed" in err.err and "(baseline): failed (exit status 3" in err.out


def test_processes_bad_arguments_name_the_option(tmp_path, capsys):
    from gem.bench.options import parse_args

    for argv, msg in ((["--processes", "0"], "--processes must be >= 1"),
                      (["--baseline", str(tmp_path)], "no scripts/bench_train.py there"),
                      (["--processes", "2", "--profile-steps", "1", "--profile-dir", str(tmp_path)], "--profile-dir")):
        with pytest.raises(SystemExit) as exc:
            parse_args([*argv, "experiment=tiny_cpu"])
        assert exc.value.code == 2 and msg in capsys.readouterr().err, argv


def test_write_reference_from_processes_feeds_gem_plan(tmp_path, monkeypatch):
    """--processes 3 --write-reference PATH: the median of the process means, with the device, versions and command,
    in the file gem plan reads its reference step from; the children never write it."""
    from gem.bench import processes
    from gem.bench.runner import main
    from gem.plan.estimate import PlanOptions, reference_step

    _this_tree(monkeypatch, _fake_checkout(tmp_path / "this", "fast"))
    monkeypatch.setattr(processes.torch.cuda, "is_available", lambda: True)
    ref = tmp_path / "reference.json"
    assert main(["--processes", "3", "--write-reference", str(ref), "--warmup", "3", "experiment=gpu_base"]) == 0
    body = reference_step(ref)
    assert body["experiment"] == "gpu_base" and body["step_ms"] == 50.0 and body["processes"] == 3
    assert body["device"] == "fake GPU" and body["versions"] == {"torch": "2.11.0", "triton": "3.6.0"}
    assert body["command"].startswith("python scripts/bench_train.py --processes 3 --write-reference ")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["reference.json", "this"]  # no temp file left
    shipped = reference_step()
    assert PlanOptions().ref_step_ms == shipped["step_ms"] > 0 and PlanOptions().ref_experiment == shipped["experiment"]


def test_write_reference_needs_the_experiment_alone_and_a_gpu(tmp_path, capsys):
    from gem.bench.options import parse_args
    from gem.bench.runner import main

    for extra in ([], ["experiment=gpu_base", "data.batch_size=64"], ["data.batch_size=64"]):
        with pytest.raises(SystemExit) as exc:
            parse_args(["--write-reference", str(tmp_path / "r.json"), *extra])
        assert exc.value.code == 2 and "the only override allowed is experiment=NAME" in capsys.readouterr().err
    if not torch.cuda.is_available():
        assert main(["--write-reference", str(tmp_path / "r.json"), "experiment=tiny_cpu"]) == 2
        assert "--write-reference: the reference step is a GPU's" in capsys.readouterr().err
        assert not (tmp_path / "r.json").exists()
