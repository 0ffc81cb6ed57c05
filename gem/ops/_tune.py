"""The launch-config tuner of every Triton op: host side, since a grid may depend on the config (tile height ->
work table), and a launch after the first costs a dictionary lookup."""

from __future__ import annotations

import os
import time
from collections.abc import Callable

import torch

from gem.ops._common import triton_interpreting


class ConfigTuner:
    """Best config per (kind, key), each candidate timed once on the first call with that key and remembered.

    `launch(cfg)` must be idempotent (the kernels only store), since timing runs it repeatedly. With GEM_AUTOTUNE=0
    (the `env` variable) the first candidate that compiles and launches is kept without timing (fp32 tiles can
    exceed shared memory).
    """

    def __init__(self, name: str, env: str = "GEM_AUTOTUNE"):
        self.name, self.env = name, env
        self.best: dict = {}

    def bench(self, fn: Callable[[], None]) -> float:
        """Milliseconds per call: triton's do_bench on the GPU; one wall-clock run elsewhere (CPU tests)."""
        if torch.cuda.is_available() and not triton_interpreting():
            from triton.testing import do_bench

            return do_bench(fn, warmup=5, rep=20)
        t0 = time.perf_counter()
        fn()
        return (time.perf_counter() - t0) * 1e3

    def pick(self, kind: str, key: tuple, cands: list | Callable[[], list], launch: Callable, device: torch.device):
        """The config to launch; `cands` (or a function making them, called only when the key is new) in order."""
        full_key = (kind,) + key
        best = self.best.get(full_key)
        if best is not None:
            return best
        if callable(cands):
            cands = cands()
        if torch.compiler.is_compiling() or (device.type == "cuda" and torch.cuda.is_current_stream_capturing()):
            return cands[0]  # no timing (syncs) while tracing or capturing a graph; tune on a later eager call
        if len(cands) == 1 or os.environ.get(self.env, "1") == "0":
            for i, cfg in enumerate(cands):
                try:
                    launch(cfg)
                except Exception as e:
                    if i == len(cands) - 1 or not _config_error(e):
                        raise
                    continue
                self.best[full_key] = cfg
                return cfg
        times = []
        for cfg in cands:
            try:
                times.append((self.bench(lambda cfg=cfg: launch(cfg)), cfg))
            except Exception as e:  # e.g. out of shared memory or registers for this tile shape
                if not _config_error(e):
                    raise
                print(f"{self.name}: config {cfg} for {kind} unusable: {type(e).__name__}")
        if not times:
            raise RuntimeError(f"{self.name}: no {kind} config in {cands} launches for {key}")
        times.sort(key=lambda x: x[0])
        best = times[0][1]
        self.best[full_key] = best
        if os.environ.get("GEM_TUNE_LOG", "0") == "1":  # benchmarks print what the tuner chose, and by how much
            ranked = ", ".join(f"{c} {t:.3f}" for t, c in times[:4])
            print(f"{self.name} tuned {kind} {key}: {ranked} ms", flush=True)
        return best


def _config_error(e: Exception) -> bool:
    """True when a config cannot compile or launch (resources, compile errors); False for a fault on the device,
    which leaves the CUDA context unusable and must surface at once, not be retried with the next config."""
    accel = getattr(torch, "AcceleratorError", None)
    if accel is not None and isinstance(e, accel):
        return False
    msg = str(e)
    # torch reports "CUDA error: ...", Triton's launcher "Triton Error [CUDA]: ..."
    return not any(m in msg for m in ("CUDA error", "[CUDA]", "illegal memory access", "launch failure"))


def reg_cap(cfg: tuple) -> dict:
    """Launch option of a config tuple's optional 5th entry after (BLOCK_M, BLOCK_N, num_warps, num_stages): ptxas's
    per-thread register cap, so that more programs share an SM (GPU only: the interpreter has no registers)."""
    return {"maxnreg": cfg[4]} if len(cfg) > 4 and not triton_interpreting() else {}
