"""scripts/bench_train.py as a GPU run uses it, on CPU: the op profile of its last steps."""

from __future__ import annotations

import json
import subprocess
import sys

from tests.train._util import ROOT, env


def test_profile_steps_cpu(tmp_path):
    out, traces = tmp_path / "bench.json", tmp_path / "traces"
    cmd = [sys.executable, str(ROOT / "scripts" / "bench_train.py"), "--warmup", "2", "--steps", "4",
           "--profile-steps", "2", "--profile-dir", str(traces), "--json", str(out), "experiment=tiny_cpu"]
    p = subprocess.run(cmd, cwd=tmp_path, env=env(tmp_path), capture_output=True, text=True, timeout=240, check=False)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    lines = p.stdout.splitlines()
    assert "| op | calls/step | self device ms/step | % of profiled CPU time | self CPU ms/step |" in lines, p.stdout
    assert any(ln.startswith("## op profile, rank 0: steps 5..6 recorded") for ln in lines), p.stdout
    buckets = [ln for ln in lines if ln.startswith("bench_train profile buckets (rank 0")]
    assert len(buckets) == 1 and all(b in buckets[0] for b in ("matmul/gemm", "attention", "nccl/comm",
                                                               "embedding", "elementwise/other")), p.stdout
    assert any(ln.startswith("bench_train summary:") for ln in lines)  # the usual report still comes first

    res = json.loads(out.read_text())
    prof = res["profile"]
    assert prof["recorded_steps"] == [5, 6] and prof["profiler_warmup_step"] == 4
    rank0 = prof["ranks"][0]
    assert rank0["rows"] and rank0["rows"][0]["self_cpu_ms_per_step"] > 0
    assert sum(b["pct"] for b in rank0["buckets"].values()) > 0.999
    assert "profile" not in res["ranks"][0] and res["ranks"][0]["step_ms_profiled_mean"] > 0
    assert sorted(f.name for f in traces.iterdir()) == ["trace_rank0.json"]  # no temp file left behind
    assert json.loads((traces / "trace_rank0.json").read_text())["traceEvents"]
