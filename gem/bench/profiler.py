"""torch.profiler over the training benchmark's last steps: the top ops and kernels, the device time grouped into
buckets (matmul / attention / communication / embedding / other) and, on request, ops split by their gem call
sites."""

from __future__ import annotations

import os
import re
from pathlib import Path

from gem.train.mfu import COMM_PATTERNS

BUCKETS = ("matmul/gemm", "attention", "nccl/comm", "embedding", "elementwise/other")
# Substrings of op and kernel names (lower case). Our attention ops are gem::jfa_*, gem::gdpa_*,
# gem::block_attention_*, gem::rope; their Triton kernels have generic names (_fwd_kernel), so a kernel also takes
# the bucket of the op that launched it. "block" alone would catch CUB kernels (BLOCK_LOAD_* template arguments).
_EMB = ("fbgemm", "embedding", "tbe")
_ATTN = ("jfa", "gdpa", "block_attention", "blockattention", "attn", "attention", "gem::rope", "ropefn")
# fbgemm holds "gemm": before mm
_OP_BUCKETS = (("nccl/comm", COMM_PATTERNS), ("embedding", _EMB), ("attention", _ATTN))
_MM = re.compile(r"gemm|matmul|cutlass|nvjet|sm90|xmma|cublas|(?<![a-z])(?:add|addb|baddb|b|_scaled_)?mm(?![a-z])")
# Inductor's pointwise / reduction kernels are named after the ops they fuse ("triton_poi_fused__grouped_mm_mul_silu"):
# never matmul, whatever their names hold.
_FUSED_ELEMENTWISE = re.compile(r"^triton_(?:poi|per|red)_")


def _self_device_us(e) -> float:
    v = getattr(e, "self_device_time_total", None)  # torch >= 2.4; self_cuda_time_total before
    return float(v if v is not None else getattr(e, "self_cuda_time_total", 0) or 0)


def _name_bucket(name: str, table) -> str | None:
    n = name.lower()
    return next((b for b, pats in table if any(p in n for p in pats)), None)


def _op_bucket(e, memo: dict) -> str | None:
    """Communication / embedding / attention from the op or its nearest ancestor op that names one."""
    key = id(e)
    if key not in memo:
        b = _name_bucket(e.name, _OP_BUCKETS)
        parent = getattr(e, "cpu_parent", None)
        memo[key] = b if b is not None or parent is None else _op_bucket(parent, memo)
    return memo[key]


def _bucket(kernel: str | None, op, memo: dict) -> str:
    """The bucket of a kernel launched by `op` (None: not launched inside any op), or of op's own CPU time."""
    if kernel is not None and _name_bucket(kernel, _OP_BUCKETS[:1]):
        return "nccl/comm"
    b = _op_bucket(op, memo) if op is not None else None
    if b is None and any(_FUSED_ELEMENTWISE.match(n) for n in (kernel, getattr(op, "name", None)) if n):
        return "elementwise/other"
    if b is None and kernel is not None:
        b = _name_bucket(kernel, _OP_BUCKETS[1:]) or ("matmul/gemm" if _MM.search(kernel.lower()) else None)
    if b is None and op is not None and _MM.search(op.name.lower()):
        b = "matmul/gemm"
    return b or "elementwise/other"


TOP_ROWS = 25  # rows of the profile tables (ops and kernels: --profile-top; call sites: always)
_GEM_FRAME = re.compile(r"(?:^|/)(gem/[\w/]+\.py\(\d+\): \w+)")  # a profiler frame inside the gem package


def _gem_frames(e) -> str:
    """The innermost gem frames (up to 3) of a profiler event's Python stack, "a < b < c", or ""."""
    frames = list(getattr(e, "stack", None) or ())
    if not frames:  # newer torch records the stack as python_function events: the op's ancestors
        q = e.cpu_parent
        while q is not None and len(frames) < 3:
            if _GEM_FRAME.search(q.name):
                frames.append(q.name)
            q = q.cpu_parent
    return " < ".join([m.group(1) for m in map(_GEM_FRAME.search, frames) if m][:3])


_PY_FRAME = re.compile(r"([\w.-]+/[\w/.-]+\.py\(\d+\): [\w<>]+)$")  # a python_function event: "path.py(line): fn"


def _outer_frames(e, n: int = 2) -> str:
    """The innermost n Python frames above an op outside gem (torch, torchrec, ...), as "pkg/file.py(line): fn",
    for ops called from library code: which library and where."""
    frames, q = [], e.cpu_parent
    while q is not None and len(frames) < n:
        m = _PY_FRAME.search(q.name)
        if m:
            path = m.group(1)
            frames.append(path.split("site-packages/")[-1])
        q = q.cpu_parent
    return " < ".join(frames)


def _inputs_of(e, n: int = 2) -> str:
    """The first n tensor inputs' shapes and dtypes ("[65536, 1024] bf16, [65536, 1024] f32"), as the profiler
    records them; "" when it recorded none."""
    shapes = list(getattr(e, "input_shapes", None) or ())
    dtypes = list(getattr(e, "input_dtypes", None) or ())
    short = {"c10::BFloat16": "bf16", "float": "f32", "c10::Half": "f16", "long int": "i64", "int": "i32"}
    out = [f"{list(sh)} {short.get(dt, dt)}" for sh, dt in zip(shapes, dtypes + [""] * len(shapes)) if sh][:n]
    return ", ".join(out)


class StepProfiler:
    """torch.profiler over the last `k` of `total` trainer steps, advanced by StepRecorder at each step's end.

    Step total-k runs under the profiler's warmup (tracer started, events dropped) so that the start-up cost stays
    out of the recorded steps total-k+1 .. total."""

    def __init__(self, total: int, k: int, cuda: bool, sources: tuple[str, ...] = ()) -> None:
        from torch.profiler import ProfilerActivity, profile, schedule

        self.first, self.last, self.k, self.cuda, self.sources = total - k + 1, total, k, cuda, tuple(sources)
        acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
        self.activities = [a.name for a in acts]
        # schedule(n) is the action during trainer step n (start() takes one step first)
        self.prof = profile(activities=acts, schedule=schedule(wait=total - k, warmup=1, active=k, repeat=1),
                            record_shapes=bool(self.sources), with_stack=bool(self.sources), profile_memory=False)
        self.running = False

    def start(self) -> None:
        self.prof.start()
        self.prof.step()  # so the trace's ProfilerStep#n is trainer step n
        self.running = True

    def step(self) -> None:
        self.prof.step()

    def stop(self) -> None:
        if self.running:
            self.running = False
            self.prof.stop()

    def recorded(self) -> bool:
        return getattr(self.prof, "profiler", None) is not None

    def export(self, out_dir: str, rank: int) -> str:
        d = Path(out_dir)
        d.mkdir(parents=True, exist_ok=True)
        final, tmp = d / f"trace_rank{rank}.json", d / f".trace_rank{rank}.json.{os.getpid()}.tmp"
        try:
            self.prof.export_chrome_trace(str(tmp))
            os.replace(tmp, final)  # readers never see a half-written trace
        finally:
            tmp.unlink(missing_ok=True)
        return str(final)

    def summary(self, rank: int, top: int = TOP_ROWS) -> dict:
        """Per step of the recorded steps: the top ops by self device time (self CPU time without CUDA), device time
        per bucket and, with CUDA, the top kernels. An op's self device time is the kernels it launched itself."""
        from torch.autograd import DeviceType

        n, memo = self.k, {}
        events = self.prof.events()
        buckets = dict.fromkeys(BUCKETS, 0.0)
        cpu_us = sum(e.self_cpu_time_total for e in events if e.device_type == DeviceType.CPU)
        kernels: dict[str, list] = {}  # name -> [us, count], device side (user annotations are ranges, not work)
        orphans: list[dict] = []
        if self.cuda:
            for e in events:
                if e.device_type != DeviceType.CPU and not getattr(e, "is_user_annotation", False):
                    acc = kernels.setdefault(e.name, [0.0, 0])
                    acc[0] += _self_device_us(e)
                    acc[1] += 1
            launched: dict[str, list] = {}
            for e in events:
                if e.device_type == DeviceType.CPU:
                    for k in getattr(e, "kernels", None) or ():
                        buckets[_bucket(k.name, e, memo)] += k.duration
                        acc = launched.setdefault(k.name, [0.0, 0])
                        acc[0] += k.duration
                        acc[1] += 1
            for name, (us, cnt) in kernels.items():  # device work no op launched (kept so the totals add up)
                us_left = us - launched.get(name, [0.0, 0])[0]
                if us_left > 0.5:
                    buckets[_bucket(name, None, memo)] += us_left
                    orphans.append({"name": f"[no op] {name}", "calls": cnt - launched.get(name, [0.0, 0])[1],
                                    "dev_us": us_left, "cpu_us": 0.0})
            total = sum(v[0] for v in kernels.values())
        else:
            for e in events:
                if e.device_type == DeviceType.CPU:
                    buckets[_bucket(None, e, memo)] += e.self_cpu_time_total
            total = cpu_us
        ops = [{"name": a.key, "calls": a.count, "dev_us": _self_device_us(a), "cpu_us": a.self_cpu_time_total}
               for a in self.prof.key_averages() if a.device_type == DeviceType.CPU]
        key = (lambda r: (r["dev_us"], r["cpu_us"])) if self.cuda else (lambda r: r["cpu_us"])
        rows = sorted(ops + orphans, key=key, reverse=True)[:top]
        pct = (lambda us: us / total) if total > 0 else (lambda us: None)
        return {
            "rank": rank,
            "unit": "device" if self.cuda else "cpu",
            "recorded_steps": [self.first, self.last],
            "ms_per_step": total / 1e3 / n,  # the unit's total: device kernel time, or self CPU time (all threads)
            "cpu_ms_per_step": cpu_us / 1e3 / n,
            "rows": [{"name": r["name"][:300], "calls_per_step": r["calls"] / n,
                      "self_device_ms_per_step": r["dev_us"] / 1e3 / n if self.cuda else None,
                      "pct": pct(r["dev_us"] if self.cuda else r["cpu_us"]),
                      "self_cpu_ms_per_step": r["cpu_us"] / 1e3 / n} for r in rows],
            "buckets": {b: {"ms_per_step": us / 1e3 / n, "pct": pct(us)} for b, us in buckets.items()},
            "kernels": [{"name": name[:300], "calls_per_step": c / n, "ms_per_step": us / 1e3 / n, "pct": pct(us)}
                        for name, (us, c) in sorted(kernels.items(), key=lambda kv: -kv[1][0])[:top]],
            "sources": self._sources(events, TOP_ROWS),
        }

    def _sources(self, events, top: int) -> list[dict]:
        """For each op named in `sources`: its time (the kernels it launched, or self CPU time without CUDA) per
        calling site, the innermost gem frames of its Python stack. An op that autograd's backward runs is put at
        the forward site of the node it runs for ("backward of ..."): the engine's evaluate_function event and the
        forward op that recorded the node share a sequence number (on CUDA the engine's thread has no Python
        stack at all)."""
        from torch.autograd import DeviceType

        if not self.sources:
            return []
        forward_site: dict[int, str] = {}  # sequence number -> the gem frames of the forward op that recorded it
        for e in events:
            seq = getattr(e, "sequence_nr", -1)
            if e.device_type == DeviceType.CPU and seq >= 0 and seq not in forward_site \
                    and not e.name.startswith("autograd::engine"):
                site = _gem_frames(e)
                if site:
                    forward_site[seq] = site
        sites: dict[tuple[str, str], list] = {}
        for e in events:
            if e.device_type != DeviceType.CPU or e.name not in self.sources:
                continue
            node = e.cpu_parent
            while node is not None and not node.name.startswith("autograd::engine::evaluate_function: "):
                node = node.cpu_parent
            if node is not None:
                grad_fn = node.name.split(": ", 1)[1]
                fwd = forward_site.get(getattr(node, "sequence_nr", -1))
                site = f"backward of {fwd} ({grad_fn})" if fwd else f"backward ({grad_fn}, no gem frame)"
            else:
                site = _gem_frames(e) or f"(no gem frame) {_outer_frames(e) or 'torch internals'}"
            us = sum(k.duration for k in (getattr(e, "kernels", None) or ())) if self.cuda else e.self_cpu_time_total
            acc = sites.setdefault((e.name, site, _inputs_of(e)), [0.0, 0])
            acc[0] += us
            acc[1] += 1
        rows = sorted(sites.items(), key=lambda kv: -kv[1][0])[:top]
        return [{"op": op, "site": site, "inputs": inputs, "calls_per_step": c / self.k, "ms_per_step": us / 1e3 / self.k}
                for (op, site, inputs), (us, c) in rows]

