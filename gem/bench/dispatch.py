"""Measures where jagged_attention's torch alternatives beat its Triton kernel, and writes the dispatch table that
kernel="auto" reads (gem/ops/dispatch.py).

    python scripts/bench_dispatch.py --processes 3                       # print the crossover table
    python scripts/bench_dispatch.py --processes 3 --write gem/ops/tuned/dispatch.json

Each class (mask, length bucket, head dim, bf16) runs in every one of N fresh processes, one after another: the
full call (jagged_attention(kernel=...), padding and dispatch included) forward + backward, first call (tuning,
compiling) untimed: the median of the timed repetitions by CUDA events, and the kernels' time by the profiler. An
alternative is listed for a class when its kernels beat Triton's in every process and by more than dispatch.MARGIN
at the median (event time only where the profiler recorded nothing); --write replaces this GPU and torch's entry.
Batches hold about 64K tokens (SWA: 48K), as the attention benchmark's.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from gem.bench.tuned import write_dispatch

BACKENDS = ("triton", "varlen", "sdpa")
SDPA_MAX_MASK = 1 << 31  # padded SDPA with a [B, 1, N, N] bool mask past this many entries: not a contender


def classes(quick: bool) -> list[dict]:
    """The measured cases: JFA lengths ~U[1, N] (H 4, D 128; N 256 also at H 2, D 64), SWA lengths ~U[N/2, N]."""
    ns = [1024, 4096] if quick else [512, 1024, 2048, 4096, 8192]
    out = [{"n": n, "low": 1, "tokens": 65536, "heads": 4, "dim": 128, "causal": c, "window": None}
           for c in (False, True) for n in ns]
    out += [{"n": 256, "low": 1, "tokens": 65536, "heads": 2, "dim": 64, "causal": c, "window": None}
            for c in (False, True)]
    out += [{"n": n, "low": n // 2, "tokens": 49152, "heads": 4, "dim": 128, "causal": True, "window": 512}
            for n in ([16384] if quick else [16384, 32768, 65536])]
    return out


def _child(args, device: str = "cuda", timer=None) -> list[dict]:
    """One process's rows; device and timer (fn, warmup=, rep=) -> ms are for testing off the GPU."""
    import torch

    from gem.bench.kernels import bench_ms, device_ms, jagged_lengths, offsets_of
    from gem.ops import dispatch
    from gem.ops._common import norm_window
    from gem.ops.jfa import _unusable, jagged_attention
    from gem.ops.triton_jfa import _TUNER

    profiled = timer is None  # device time needs the GPU profiler
    timer = timer or bench_ms
    rows = []
    for c in classes(args.quick):
        lengths = jagged_lengths(c["n"], c["tokens"], low=c["low"], seed=c["n"], device=device)
        off, max_len = offsets_of(lengths), int(lengths.max())
        g = torch.Generator(device=device).manual_seed(0)
        q, k, v = (torch.randn(int(off[-1]), c["heads"], c["dim"], device=device, dtype=torch.bfloat16,
                               generator=g).requires_grad_() for _ in range(3))
        left, right = norm_window(c["causal"], c["window"])
        cls = dispatch.call_class(left, right, max_len, c["dim"], q.dtype)
        do = torch.randn_like(q)
        for backend in BACKENDS:
            row = {"class": cls, "backend": backend, "process": args.child, "case": f"N={c['n']} B={lengths.numel()}"}
            if backend != "triton" and _unusable(backend, q, k, None, False):
                row["skipped"] = _unusable(backend, q, k, None, False)
            elif backend == "sdpa" and lengths.numel() * max_len * max_len > SDPA_MAX_MASK:
                row["skipped"] = "padded mask too large"
            else:
                def step(backend=backend, q=q, k=k, v=v, off=off, max_len=max_len, c=c, do=do):
                    out = jagged_attention(q, k, v, off, max_len, causal=c["causal"], window=c["window"],
                                           kernel=backend)
                    torch.autograd.grad(out, (q, k, v), do)

                try:
                    before = dict(_TUNER.best)
                    step()  # tuning and compiling stay out of the timing
                    row["ms"] = timer(step, warmup=5, rep=30 if args.quick else 60)
                    if backend == "triton":  # what differs between processes: the picks, or host vs device time
                        row["configs"] = sorted(f"{k[0]}:{v}" for k, v in _TUNER.best.items() if before.get(k) != v)
                    if profiled:
                        row["device_ms"] = device_ms(step)
                except torch.cuda.OutOfMemoryError:
                    row["skipped"] = "OOM"
                if device == "cuda":
                    torch.cuda.empty_cache()
            rows.append(row)
            print(json.dumps(row), flush=True)
    return rows


def _stats(xs: list[float]) -> str:
    xs = sorted(xs)
    return f"{xs[0]:.3f} / {xs[len(xs) // 2]:.3f} / {xs[-1]:.3f}" if xs else "n/a"


def report(rows: list[dict], won: dict) -> None:
    """The crossover table: per class each backend's fwd+bwd ms (min / median / max over processes), the pick, and
    Triton's ms in each process in order with its spread, (max - min) / median (the first process also compiles
    and tunes)."""
    by: dict = {}
    for r in rows:
        by.setdefault(r["class"], {}).setdefault(r["backend"], []).append(r)
    print("\n| class (mask, length bucket, head dim, dtype) | " + " | ".join(f"{b} ms (kernels)" for b in BACKENDS)
          + " | auto runs | triton ms by process (spread) | triton device ms by process (spread) |\n|---|"
          + "---|" * (len(BACKENDS) + 3))
    for cls, backends in by.items():
        cells = []
        for b in BACKENDS:
            ms = [r["ms"] for r in backends.get(b, []) if "ms" in r]
            dev = [r["device_ms"] for r in backends.get(b, []) if "device_ms" in r]
            cells.append((_stats(ms) + (f" ({_stats(dev)})" if dev else "")) if ms else "skipped")
        pick = f"{won[cls][0]} ({won[cls][1]:.2f}x)" if cls in won else "triton"
        ordered = [r for r in sorted(backends.get("triton", []), key=lambda r: r["process"]) if "ms" in r]
        spread = _spread([r["ms"] for r in ordered])
        dev = _spread([r["device_ms"] for r in ordered if "device_ms" in r])
        print(f"| {cls} | " + " | ".join(cells) + f" | {pick} | {spread} | {dev} |")
        picks = {tuple(r.get("configs", ())) for r in ordered}
        if len(picks) > 1:
            print(f"|   configs differ between processes: {' / '.join(' '.join(p) or '(cached)' for p in picks)} |")


def _spread(xs: list[float]) -> str:
    """Values in process order and (max - min) / median."""
    if not xs:
        return "n/a"
    return f"{', '.join(f'{x:.3f}' for x in xs)} ({(max(xs) - min(xs)) / sorted(xs)[len(xs) // 2]:.0%})"


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--processes", type=int, default=3, help="fresh processes, one after another (at least 3 to "
                                                             "write a table)")
    p.add_argument("--quick", action="store_true", help="fewer classes and repetitions")
    p.add_argument("--write", default=None, help="merge the winners into this dispatch table (JSON)")
    p.add_argument("--json", default=None, help="write every timing to this JSON file")
    p.add_argument("--child", type=int, default=0, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child:
        rows = _child(args)
        Path(args.json).write_text(json.dumps(rows))
        return
    if args.processes < 1 or (args.write and args.processes < 3):
        p.error(f"--processes {args.processes}: need at least 1, and 3 with --write")
    import torch

    from gem.ops import dispatch

    if not torch.cuda.is_available():
        sys.exit("bench_dispatch: error: needs a CUDA GPU (the alternatives and the timings run there)")
    rows = []
    with tempfile.TemporaryDirectory(prefix="bench_dispatch.") as tmp:
        for i in range(1, args.processes + 1):
            out, t0 = os.path.join(tmp, f"p{i}.json"), time.time()
            cmd = [sys.executable, "-m", "gem.bench.dispatch", "--child", str(i), "--json", out]
            proc = subprocess.run(cmd + (["--quick"] if args.quick else []), check=False, capture_output=True,
                                  text=True)
            if proc.returncode != 0 or not os.path.exists(out):
                sys.exit(f"bench_dispatch: error: process {i} failed (exit status {proc.returncode}): "
                         f"{proc.stderr.strip().splitlines()[-1:] or 'no stderr'}")
            rows += json.loads(Path(out).read_text())
            print(f"process {i}/{args.processes}: done in {time.time() - t0:.0f} s", flush=True)
    timed = [r for r in rows if "ms" in r]
    key = "device_ms" if all(r.get("device_ms", math.nan) > 0 for r in timed) else "ms"
    won = dispatch.winners(timed, key=key)
    env = dispatch.environment(torch.device("cuda"))
    print(f"# {env['device']}, torch {env['torch']}, {args.processes} processes; picks by "
          f"{'kernel time' if key == 'device_ms' else 'event time (the profiler recorded no kernel time)'}")
    report(rows, won)
    if args.json:
        Path(args.json).write_text(json.dumps({"env": env, "rows": rows}, indent=1))
    if args.write:
        path = write_dispatch(args.write, env, "jfa", won)
        print(f"wrote {path}: {len(won)} class(es) for {env['device']} / torch {env['torch']}")


if __name__ == "__main__":
    main()
