"""Which JFA shapes and kernel forms fault or go wrong on this GPU: each case runs forward + backward in its own process
(a device fault leaves the CUDA context unusable for everything after it) with CUDA_LAUNCH_BLOCKING=1, so the
traceback names the launch that faulted. One line per case: ok | FAULT | WRONG, the case, and the detail.

    python tools/jfa_fault_matrix.py            # every case
    python tools/jfa_fault_matrix.py --case 3   # one case, in this process
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# (form, d, h, h_kv, lengths, max_q, causal, window); "fwd:" before the form runs the forward only. Forms patch what
# the dispatch picks per call (_FORMS): "tma" the v2 backward with TMA loads at this D (the GPU takes them at D 128
# only: _TMA_BWD_HEAD_DIMS), "rowmajor" the v2 backward with pointer loads, "base" the long-row backward, "auto" none.
_LONG = [1131, 1801, 602, 1418, 97, 1976, 0, 1, 2048, 129]  # like the GPU test: max 2048, a 0 and a 1
CASES = [
    ("tma", 64, 4, 2, _LONG, 2048, False, None),
    ("rowmajor", 64, 4, 2, _LONG, 2048, False, None),
    ("fwd:tma", 64, 4, 2, _LONG, 2048, False, None),
    ("tma", 64, 4, 4, _LONG, 2048, False, None),
    ("tma", 64, 4, 2, [n for n in _LONG if n], 2048, False, None),
    ("tma", 64, 4, 2, [min(n, 1000) for n in _LONG], 1000, False, None),
    ("tma", 128, 4, 2, _LONG, 2048, False, None),
    ("tma", 64, 4, 2, _LONG, 2048, True, None),
    ("tma", 64, 4, 2, _LONG, 2048, False, (19, 0)),
    ("tma", 128, 4, 4, [1024] * 8, 1024, False, None),
    ("base", 64, 4, 2, _LONG, 2048, False, None),
    ("auto", 64, 4, 2, _LONG, 2048, True, None),
    ("auto", 64, 4, 2, [min(n, 1000) for n in _LONG], 1000, False, None),
]
# The D=64 TMA backward forced on (it is off on the GPU, see _TMA_BWD_HEAD_DIMS), under other backward configs
# (dkdv BLOCK_M, dkdv BLOCK_N, dq BLOCK_M, dq BLOCK_N, warps, stages): which pass and which pipelining fault.
_FORCED = [(64, 128, 128, 64, 8, 2), (64, 128, 128, 64, 8, 3), (64, 128, 128, 64, 8, 1), (64, 64, 64, 64, 4, 3),
           (64, 128, 64, 64, 4, 2)]
CASES += [("tma", 64, 4, 2, _LONG, 2048, False, None, cfg) for cfg in _FORCED]


_FORMS = {"tma": lambda d: {"_TMA_BWD_HEAD_DIMS": (d,), "_BWD_DELTA_PRE_MIN_LEN": 2**31},
          "rowmajor": lambda d: {"_tma_ok": lambda *t: False, "_BWD_DELTA_PRE_MIN_LEN": 2**31},
          "base": lambda d: {"_BWD_DELTA_PRE_MIN_LEN": 0},
          "auto": lambda d: {}}


def run_case(i: int) -> None:
    import torch

    import gem.ops.triton_jfa as tj
    from gem.ops import jagged_attention
    from tests.ops.test_jfa import _check, _inputs, _offsets, _run

    var, d, h, h_kv, lens, max_q, causal, window, *forced = CASES[i]
    if forced:  # one backward config
        tj._bwd_configs = lambda *_a, **_k: [forced[0]]
    fwd_only = var.startswith("fwd:")
    for name, value in _FORMS[var.removeprefix("fwd:")](d).items():
        setattr(tj, name, value)
    q, k, v = _inputs(lens, h=h, h_kv=h_kv, d=d, dtype=torch.bfloat16, device="cuda")
    if fwd_only:
        with torch.no_grad():
            out = jagged_attention(q, k, v, _offsets(lens, "cuda"), max_q, causal=causal, window=window)
        torch.cuda.synchronize()
        print(f"forward finite: {bool(torch.isfinite(out).all())}")
        return
    got, want = _run(q, k, v, lens, causal=causal, window=window, max_q=max_q)
    torch.cuda.synchronize()
    _check(got, want, torch.bfloat16, tol=3e-2)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--case", type=int)
    args = ap.parse_args()
    if args.case is not None:
        run_case(args.case)
        return 0
    env = dict(os.environ, CUDA_LAUNCH_BLOCKING="1", GEM_AUTOTUNE="0",
               PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    bad = 0
    for i, case in enumerate(CASES):
        var, d, h, h_kv, lens, max_q, causal, window, *forced = case
        name = (f"#{i} {var} d={d} h={h}/{h_kv} max_q={max_q} zero_len={0 in lens} causal={causal} "
                f"window={window}" + (f" forced TMA bwd cfg={forced[0]}" if forced else ""))
        try:
            r = subprocess.run([sys.executable, __file__, "--case", str(i)], env=env, capture_output=True, check=False,
                               text=True, timeout=120)
            text, rc = r.stdout + r.stderr, r.returncode
        except subprocess.TimeoutExpired:
            text, rc = "time limit 120 s", -1
        if rc == 0:
            status, detail = "ok", ""
        elif re.search(r"CUDA error|\[CUDA\]|AcceleratorError|illegal|launch failure", text):
            status = "FAULT"
            frames = re.findall(r'triton_jfa\.py", line (\d+), in (\w+)', text)
            err = [ln for ln in text.splitlines() if "Error" in ln]
            detail = f"last gem frame {frames[-1] if frames else '?'}; {err[-1][:160] if err else ''}"
        else:
            status = "WRONG"
            err = [ln for ln in text.splitlines() if "Error" in ln or "error" in ln]
            detail = err[-1][:200] if err else text.strip().splitlines()[-1][:200] if text.strip() else ""
        bad += status != "ok"
        print(f"{status} {name} {detail}", flush=True)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
