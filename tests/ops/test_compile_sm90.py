"""The Triton kernels compile for the H200 (sm_90, down to cubins through ptxas) with the GPU's launch configs,
on this GPU-less machine: tools/compile_check.py --quick (JFA's backward forms, GDPA, BlockAttention, the rope op,
fp8_block's quantizers and fused producers; bf16)."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_kernels_compile_for_sm90(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_CACHE_DIR"] = str(tmp_path / "triton-cache")  # compile afresh: a cached kernel proves nothing
    r = subprocess.run([sys.executable, str(ROOT / "tools/compile_check.py"), "--quick"], env=env, cwd=ROOT,
                       capture_output=True, text=True, timeout=1500, check=False)
    out = r.stdout + r.stderr
    assert r.returncode == 0, out[-4000:]
    assert "0 failed case(s)" in out and "FAIL" not in out, out[-4000:]
    cases = [ln for ln in out.splitlines() if ln.startswith("ok ")]
    assert {c.split()[1] for c in cases} == {"jfa", "gdpa", "block", "rope", "fp8"}, out[-4000:]
