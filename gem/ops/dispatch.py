"""kernel="auto" across backends: gem's Triton kernel, unless a measurement shipped for this GPU and torch says a
torch alternative is faster on the call's class.

A class is (mask, length bucket, head-dim tile, dtype): mask "full", "causal" or "window" (a left bound, or a
right bound past the diagonal); the length bucket is max_len_q rounded up to a power of two; the head-dim tile is
the Triton kernel's width for that head dim. gem/ops/tuned/dispatch.json holds, per (GPU name, torch version),
the classes where an alternative beat the Triton kernel on forward + backward in every one of >= 3 fresh
benchmark processes, by more than MARGIN at the median, in kernel time (scripts/bench_dispatch.py measures and
writes it). Kernel time, not the time of a lone call: in a training step the host runs ahead of the GPU, while a
lone call with rows of <= 512 tokens is timed by its host work (Python, autograd, launches; ~0.65-1.4 ms per
forward + backward on the H200 for Triton and varlen_attn alike), which varies from process to process. Every
other class, GPU or torch runs Triton. The file is plain JSON, never unpickled; a malformed one is an error naming
the file.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from functools import cache
from pathlib import Path

import torch

from gem.ops._common import next_pow2, tile_head_dim

FORMAT = 1
SHIPPED = Path(__file__).parent / "tuned" / "dispatch.json"
ALTERNATIVES = {"jfa": ("varlen", "sdpa")}  # op -> the torch backends its "auto" may pick
MARGIN = 0.03  # an alternative must be this much faster (median over processes) to be listed


def call_class(left: int, right: int, max_len_q: int, head_dim: int, dtype: torch.dtype) -> str:
    """The class key of one call, from its normalized window (-1 = unbounded side; causal is right = 0)."""
    mask = "window" if left >= 0 or right > 0 else "causal" if right == 0 else "full"
    return f"{mask}/{max(16, next_pow2(max(max_len_q, 1)))}/{tile_head_dim(head_dim, pow2=True)}/{str(dtype)[6:]}"


def environment(device: torch.device) -> dict:
    """What a measured class depends on: the GPU model and the torch that holds the alternatives."""
    return {"device": _device_name(device.type, device.index), "torch": torch.__version__.split("+")[0]}


@cache
def _device_name(kind: str, index: int | None) -> str:
    return torch.cuda.get_device_name(index) if kind == "cuda" else kind


def parse(body, source: str) -> dict:
    """{(device, torch, op): {class: backend}} from a dispatch file's JSON body; ValueError naming `source` and the
    problem otherwise."""
    if not isinstance(body, dict) or body.get("format") != FORMAT or not isinstance(body.get("entries"), list):
        raise ValueError(f"{source}: not a gem dispatch table (format {FORMAT} with an 'entries' list)")
    out: dict = {}
    for i, e in enumerate(body["entries"]):
        where = f"{source}: entry {i}"
        if not isinstance(e, dict) or not isinstance(e.get("env"), dict) or not isinstance(e.get("classes"), dict):
            raise ValueError(f"{where}: needs 'env', 'op' and 'classes'")
        op, env = e.get("op"), e["env"]
        if op not in ALTERNATIVES:
            raise ValueError(f"{where}: op {op!r} has no alternatives (known: {sorted(ALTERNATIVES)})")
        if not all(isinstance(env.get(k), str) for k in ("device", "torch")):
            raise ValueError(f"{where}: env needs 'device' and 'torch' strings")
        table = out.setdefault((env["device"], env["torch"], op), {})
        for cls, rec in e["classes"].items():
            use = rec.get("use") if isinstance(rec, dict) else None
            if use not in ALTERNATIVES[op]:
                raise ValueError(f"{where}: class {cls!r} uses {use!r}; {op} can use {ALTERNATIVES[op]}")
            if len(str(cls).split("/")) != 4:
                raise ValueError(f"{where}: class {cls!r} is not 'mask/length bucket/head dim tile/dtype'")
            table[cls] = use
    return out


@cache
def _shipped() -> dict:
    return parse(json.loads(SHIPPED.read_text()), str(SHIPPED)) if SHIPPED.exists() else {}


def choose(op: str, device: torch.device, key: Callable[[], str], table: dict | None = None) -> str:
    """"triton", or the alternative measured faster for the call's class (key() gives it, only computed when this
    device and torch have measured classes) on this device and torch."""
    if torch.compiler.is_compiling():  # compiled graphs run the Triton custom op
        return "triton"
    table = _shipped() if table is None else table
    if not table:
        return "triton"
    env = environment(device)
    classes = table.get((env["device"], env["torch"], op))
    return classes.get(key(), "triton") if classes else "triton"


def winners(results: list[dict], margin: float = MARGIN, key: str = "ms") -> dict:
    """From timings [{"class": c, "backend": b, "process": p, key: fwd+bwd ms}, ...] (one per process, class and
    backend): {class: (backend, median speedup, [speedup per process])} for the classes where one alternative
    beat "triton" in every process and by more than `margin` at the median (the fastest such alternative).
    key: "ms" (CUDA-event time of the whole call) or "device_ms" (its kernels' time)."""
    by: dict = {}
    for r in results:
        by.setdefault(r["class"], {}).setdefault(r["backend"], {})[r["process"]] = r[key]
    out = {}
    for cls, backends in by.items():
        ours = backends.get("triton", {})
        best = None
        for name, times in backends.items():
            if name == "triton" or not ours or set(times) != set(ours):
                continue
            ups = sorted(ours[p] / times[p] for p in times)
            med = ups[len(ups) // 2] if len(ups) % 2 else 0.5 * (ups[len(ups) // 2 - 1] + ups[len(ups) // 2])
            if min(ups) > 1.0 and med > 1.0 + margin and (best is None or med > best[1]):
                best = (name, med, ups)
        if best is not None:
            out[cls] = best
    return out


def merged(body: dict | None, env: dict, op: str, won: dict) -> dict:
    """A dispatch file's body with this (env, op)'s entry replaced by the classes in `won` (winners()' output)."""
    entries = [e for e in (body or {}).get("entries", []) if not (e.get("env") == env and e.get("op") == op)]
    classes = {cls: {"use": use, "speedup": round(med, 3), "processes": len(ups)}
               for cls, (use, med, ups) in sorted(won.items())}
    if classes:
        entries.append({"env": dict(env), "op": op, "classes": classes})
    return {"format": FORMAT, "entries": sorted(entries, key=lambda e: (e["env"]["device"], e["env"]["torch"],
                                                                        e["op"]))}
