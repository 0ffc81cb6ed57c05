"""gem.parallel on CUDA/NCCL (the H200 machine): the CPU tests' parity and DCP checks through the CUDA code
paths (torchrec DMPCollection for 2D embedding sharding, FSDP2 + expert all-to-all over NCCL).

    python tests/dist/gpu_check.py OUT_DIR     # needs >= 2 GPUs; prints one summary line per check
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]


def launch(script: str, nproc: int, out: Path, args: list[str]) -> tuple[dict | None, str]:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
               OMP_NUM_THREADS="4", TMPDIR=tempfile.mkdtemp())
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
           str(HERE / script), "--out", str(out), *args]
    r = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=400)
    full = r.stdout + r.stderr
    out.with_suffix(".log").write_text(full)
    # The first rank traceback says where it failed (torchrun's own traceback at the end does not).
    i = full.find("]: Traceback")
    log = (full[max(0, i - 20):i + 4000] + "\n...\n" if i >= 0 else "") + full[-800:]
    return (json.loads(out.read_text()) if r.returncode == 0 and out.exists() else None), log


def max_grad_rel(a: dict, b: dict) -> float:
    worst = 0.0
    for k, ga in a["grads"].items():
        gb = b["grads"][k]
        scale = max(max(abs(x) for x in ga), 1e-12)
        worst = max(worst, max(abs(x - y) for x, y in zip(ga, gb)) / scale)
    return worst


def main() -> None:
    out = Path(sys.argv[1])
    out.mkdir(parents=True, exist_ok=True)
    summary = {}
    common = ["--lr", "0.5", "--sparse-opt", "sgd"]
    ref, log = launch("run_train.py", 1, out / "ref.json", common)
    summary["ref_1rank"] = ref["losses"] if ref else log
    layouts = {
        "ddp_2": {"dense": "ddp"},
        "fsdp_ep2_2d_strided": {"dense": "fsdp", "ep": 2, "emb_shard_group": 1, "emb_group_layout": "strided"},
        "fsdp_ep2_2d_host_local": {"dense": "fsdp", "ep": 2, "emb_shard_group": 1, "emb_group_layout": "host_local"},
        "hsdp_2x1_bf16": {"dense": "fsdp", "dp_replicate": 2},
    }
    for name, par in layouts.items():
        dtype = ["--param-dtype", "bf16"] if name.endswith("_bf16") else []
        got, log = launch("run_train.py", 2, out / f"{name}.json", common + ["--parallel", json.dumps(par), *dtype])
        if got and ref:
            summary[name] = {"loss_diff": max(abs(x - y) for x, y in zip(got["losses"], ref["losses"])),
                             "grad_rel": max_grad_rel(ref, got)}
        else:
            summary[name] = log
    ck = Path(tempfile.mkdtemp()) / "ckpt"
    par = {"dense": "fsdp", "ep": 2, "emb_shard_group": 1, "emb_sync_every": 2, "emb_group_layout": "strided"}
    got, log = launch("run_dcp.py", 2, out / "dcp.json", ["--phase", "save", "--load-here", "--ckpt", str(ck),
                                                            "--parallel", json.dumps(par)])
    summary["dcp_2d"] = got if got else log
    # fp8_block's FP8 all-gather through NCCL and Inductor-compiled regions: the same run as without it
    got, log = launch("run_fp8_all_gather.py", 2, out / "fp8_all_gather.json", ["--compile", '{"enabled": true}'])
    if got:
        layers = {dt: [{k: s[k] for k in ("gathered_fp8", "same_bytes", "quantized", "all_gather_bytes")}
                       for s in r["steps"]] for dt, r in got["layers"].items()}
        train = {dt: {"fp8": r["True"]["fp8"], "same_losses": r["True"]["losses"] == r["False"]["losses"],
                      "same_params": r["True"]["params"] == r["False"]["params"],
                      "checkpoint": r["True"]["checkpoint"]} for dt, r in got["train"].items()}
        summary["fp8_all_gather"] = {"layers": layers, "train": train}
    else:
        summary["fp8_all_gather"] = log
    (out / "summary.json").write_text(json.dumps(summary, indent=1))
    print(json.dumps(summary, indent=1))


if __name__ == "__main__":
    main()
