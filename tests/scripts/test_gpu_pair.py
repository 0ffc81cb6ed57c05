"""scripts/gpu_pair.sh: two step queues run side by side, one log per step, status and time limit per step."""

import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_queues_run_with_logs_status_and_limits(tmp_path):
    out = tmp_path / "out"
    q0 = "5 first echo one; 5 second bash -c 'echo 3 passed && exit 3'"
    q1 = "1 slow sleep 5;\n  5 after echo two"  # a queue written over two lines
    res = subprocess.run(["bash", str(ROOT / "scripts/gpu_pair.sh"), q0, q1], capture_output=True, text=True,
                         env={"OUT": str(out), "PATH": "/usr/bin:/bin"}, timeout=60, check=False)
    assert res.returncode == 0, res.stderr
    assert (out / "first.log").read_text() == "one\n"
    assert (out / "after.log").read_text() == "two\n"
    lines = res.stdout.splitlines()
    assert any("second rc=3: 3 passed" in line for line in lines), res.stdout
    assert any("slow rc=124" in line for line in lines), res.stdout  # killed at its 1 s limit
    # queue 1's second step ran although its first timed out
    assert any("after rc=0" in line for line in lines), res.stdout
