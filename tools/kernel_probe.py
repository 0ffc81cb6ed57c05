"""Per-kernel device time of gem's attention ops on one GPU: where a case's milliseconds go.

    python tools/kernel_probe.py [--cases gdpa,gdpa_short,jfa,block,block_small] [--match TEXT] [--iters 20] [--host]
    bash tools/ncu_probe.sh --cases jfa --match causal      # hardware counters of the same calls (ncu)

For each case it times the eager call (forward, and forward + backward) with CUDA events, then records the same
calls under torch.profiler and prints each kernel's mean device time per call, so a slow case shows whether one
kernel, the host (launch gaps) or small helper kernels (work tables, offsets checks) dominate. Bench shapes as in
gem.bench.attention (bf16, H 4, D 128, ~64K tokens). Needs CUDA.
--host adds the host time per call (the calls are queued behind a GPU sleep, so the host never waits for the
device) and the top Python functions by own time under cProfile: a call whose host time exceeds its device time
is launch-bound.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import os
import pstats
import sys
import time
from collections import defaultdict

import torch

from gem.bench.kernels import bench_ms, jagged_lengths, offsets_of

H, D = 4, 128


def _qkv(lq, lk, dtype=torch.bfloat16):
    tq, tk = int(lq.sum()), int(lk.sum())
    q = torch.randn(tq, H, D, device="cuda", dtype=dtype, requires_grad=True)
    k = torch.randn(tk, H, D, device="cuda", dtype=dtype, requires_grad=True)
    v = torch.randn(tk, H, D, device="cuda", dtype=dtype, requires_grad=True)
    return q, k, v, offsets_of(lq), int(lq.max()), offsets_of(lk), int(lk.max())


def _gdpa_cases():
    from gem.ops.gdpa import gdpa

    out = []
    for n, causal, approx in ((512, True, None), (512, False, None), (512, True, "poly6"), (2048, True, None)):
        lq = jagged_lengths(n, 65536, seed=n)
        q, k, v, oq, mq, ok, mk = _qkv(lq, lq)
        name = f"gdpa self silu N={n} {'causal' if causal else 'full'}{' poly6' if approx else ''}"
        out.append((name, (q, k, v), lambda q=q, k=k, v=v, oq=oq, mq=mq, ok=ok, mk=mk, causal=causal, approx=approx:
                    gdpa(q, k, v, oq, mq, ok, mk, activation="silu", causal=causal, approx=approx, kernel="triton")))
    lq = jagged_lengths(256, 8 * 65536, seed=256)
    g = torch.Generator().manual_seed(64)
    lk = torch.randint(1, 65, (lq.numel(),), generator=g).to("cuda")
    q, k, v, oq, mq, ok, mk = _qkv(lq, lk)
    out.append(("gdpa cross gelu_tanh N=256 M=64", (q, k, v), lambda: gdpa(
        q, k, v, oq, mq, ok, mk, activation="gelu_tanh", kernel="triton")))
    return out


def _gdpa_short_cases():
    """The short-K/V paths (whole K/V in one tile) by default and forced on or off."""
    from gem.ops.gdpa import gdpa

    out = []
    for name, (q, k, v, oq, mq, ok, mk), kw in _gdpa_inputs(("c64", "c256")):
        for short in (None, True, False):
            out.append((f"gdpa {name} short_kv={short}", (q, k, v),
                        lambda q=q, k=k, v=v, oq=oq, mq=mq, ok=ok, mk=mk, kw=kw, short=short:
                        gdpa(q, k, v, oq, mq, ok, mk, kernel="triton", short_kv=short, **kw)))
    return out


def _gdpa_inputs(names):
    """The GDPA bench shapes by name: (case label, _qkv inputs, gdpa keyword arguments)."""
    def cross(n, m):
        lq = jagged_lengths(n, 8 * 65536, seed=n)
        lk = torch.randint(1, m + 1, (lq.numel(),), generator=torch.Generator().manual_seed(m)).to("cuda")
        return _qkv(lq, lk)

    def causal_self(n):
        ls = jagged_lengths(n, 65536, seed=n)
        return _qkv(ls, ls)

    shapes = {"c64": ("cross gelu_tanh N=256 M=64", lambda: cross(256, 64), {"activation": "gelu_tanh"}),
              "c128": ("cross gelu_tanh N=512 M=128", lambda: cross(512, 128), {"activation": "gelu_tanh"}),
              "c256": ("cross gelu_tanh N=1024 M=256", lambda: cross(1024, 256), {"activation": "gelu_tanh"}),
              "s2k": ("self silu N=2048 causal", lambda: causal_self(2048), {"activation": "silu", "causal": True}),
              "s512": ("self silu N=512 causal", lambda: causal_self(512), {"activation": "silu", "causal": True})}
    return [(shapes[n][0], shapes[n][1](), shapes[n][2]) for n in names]


def _jfa_cases():
    from gem.ops.jfa import jagged_attention

    out = []
    for n, causal in ((1024, True), (1024, False)):
        lq = jagged_lengths(n, 131072, seed=n)
        q, k, v, oq, mq, _, _ = _qkv(lq, lq)
        out.append((f"jfa N={n} {'causal' if causal else 'full'}", (q, k, v),
                    lambda q=q, k=k, v=v, oq=oq, mq=mq, causal=causal:
                    jagged_attention(q, k, v, oq, mq, causal=causal, kernel="triton")))
    lq = jagged_lengths(16384, 65536, low=8192, seed=16384)
    q, k, v, oq, mq, _, _ = _qkv(lq, lq)
    out.append(("swa w512 N=16384", (q, k, v), lambda: jagged_attention(q, k, v, oq, mq, window=(511, 0),
                                                                      kernel="triton")))
    return out


def _block_cases():
    from gem.ops.block import block_attention
    from gem.ops.rotary import RopeConfig

    out = []
    for n in (1024, 8192, 32768, 65536):
        lq = jagged_lengths(n, 65536, low=n // 2, seed=n)
        q, k, v, oq, mq, _, _ = _qkv(lq, lq)
        out.append((f"block L={n} b512 rope", (q, k, v), lambda q=q, k=k, v=v, oq=oq, mq=mq: block_attention(
            q, k, v, oq, mq, block_size=512, rope=RopeConfig(), kernel="triton")))
        if n >= 32768:  # the kernels without RoPE at the longest lengths
            out.append((f"block L={n} b512 no rope", (q, k, v), lambda q=q, k=k, v=v, oq=oq, mq=mq: block_attention(
                q, k, v, oq, mq, block_size=512, kernel="triton")))
    lq = jagged_lengths(1024, 65536, low=512, seed=1024)
    q, k, v, oq, mq, _, _ = _qkv(lq, lq)
    out.append(("block L=1024 b512 rope", (q, k, v), lambda: block_attention(
        q, k, v, oq, mq, block_size=512, rope=RopeConfig(), kernel="triton")))
    out.append(("block L=1024 b512 no rope", (q, k, v), lambda: block_attention(q, k, v, oq, mq, block_size=512,
                                                                              kernel="triton")))
    return out


def _block_small_cases():
    """Block sizes 128 and 256 at L 16K: the fused RoPE against the rope op + the block kernel without RoPE (the
    bench's "block + rope op"), by device time."""
    from gem.ops.block import block_attention
    from gem.ops.rotary import RopeConfig, rope

    out = []
    lq = jagged_lengths(16384, 65536, low=8192, seed=16384)
    q, k, v, oq, mq, _, _ = _qkv(lq, lq)
    cfg = RopeConfig()
    for bs in (128, 256):
        out.append((f"block L=16384 b{bs} rope", (q, k, v), lambda bs=bs: block_attention(
            q, k, v, oq, mq, block_size=bs, rope=cfg, kernel="triton")))
        out.append((f"block L=16384 b{bs} rope op + block", (q, k, v), lambda bs=bs: block_attention(
            rope(q, oq, mq, config=cfg, kernel="triton"), rope(k, oq, mq, config=cfg, kernel="triton"), v, oq, mq,
            block_size=bs, kernel="triton")))
    return out


CASES = {"gdpa": _gdpa_cases, "gdpa_short": _gdpa_short_cases, "jfa": _jfa_cases, "block": _block_cases,
         "block_small": _block_small_cases}


def _kernel_table(fn, iters: int) -> list[tuple[str, float, int]]:
    from torch.profiler import ProfilerActivity, profile

    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(iters):
            fn()
        torch.cuda.synchronize()
    tot: dict[str, float] = defaultdict(float)
    cnt: dict[str, int] = defaultdict(int)
    for ev in prof.events():
        if ev.device_type == torch.autograd.DeviceType.CUDA:
            tot[ev.name] += ev.device_time
            cnt[ev.name] += 1
    rows = sorted(((n[:70], t / iters, cnt[n] // iters) for n, t in tot.items()), key=lambda r: -r[1])
    return rows


def _host_us(fn, n: int = 20) -> float:
    """Host microseconds per call with the device busy: the calls queue behind a GPU sleep, so none waits."""
    torch.cuda.synchronize()
    torch.cuda._sleep(2_000_000_000)  # ~1 s of GPU clock cycles, longer than n calls' host time
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    dt = time.perf_counter() - t0
    torch.cuda.synchronize()
    return dt / n * 1e6


def _host_us_no_launch(fn, n: int = 20) -> float:
    """_host_us with every Triton launch a no-op (JITFunction.run patched): the host time of everything but the
    launches themselves (Python glue, autograd, allocations, torch kernels' launches)."""
    from triton.runtime.jit import JITFunction

    real = JITFunction.run
    JITFunction.run = lambda self, *a, **k: None
    try:
        return _host_us(fn, n)
    finally:
        JITFunction.run = real


def _host_profile(fn, n: int = 20, top: int = 12) -> str:
    torch.cuda.synchronize()
    torch.cuda._sleep(2_000_000_000)
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(n):
        fn()
    prof.disable()
    torch.cuda.synchronize()
    buf = io.StringIO()
    pstats.Stats(prof, stream=buf).sort_stats("tottime").print_stats(top)
    lines = [ln for ln in buf.getvalue().splitlines() if ln.strip()]
    start = next((i for i, ln in enumerate(lines) if ln.lstrip().startswith("ncalls")), 0)
    return "\n".join("   " + ln for ln in lines[start:])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cases", default="gdpa,jfa,block")
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--host", action="store_true", help="also host time per call and a cProfile of the host path")
    ap.add_argument("--match", default="", help="only the cases whose name contains one of these (comma-separated)")
    ap.add_argument("--ncu", action="store_true",
                    help="no timing: one fwd+bwd per case between cudaProfilerStart/Stop, after the warm-up that "
                         "compiles and tunes, for `ncu --profile-from-start off` (tools/ncu_probe.sh)")
    a = ap.parse_args()
    if not torch.cuda.is_available():
        print("kernel_probe: needs CUDA")
        return 2
    os.environ.setdefault("GEM_TUNE_LOG", "1")  # what the tuners chose, and by how much
    for group in a.cases.split(","):
        for name, inputs, fwd in CASES[group]():
            if a.match and not any(m in name for m in a.match.split(",")):
                continue

            def both(fwd=fwd, inputs=inputs):
                o = fwd()
                torch.autograd.grad(o, inputs, torch.ones_like(o))

            try:
                fwd()  # compile / tune outside the timing
                both()
                if a.ncu:
                    torch.cuda.synchronize()
                    torch.cuda.profiler.start()
                    both()
                    torch.cuda.synchronize()
                    torch.cuda.profiler.stop()
                    print(f"## {name}: profiled one fwd+bwd", flush=True)
                else:
                    _time_case(name, fwd, both, a)
            except Exception as e:  # noqa: BLE001 - one failing case must not hide the others
                print(f"\n## {name}: FAILED {type(e).__name__}: {str(e)[:300]}")
            torch.cuda.empty_cache()
    return 0


def _time_case(name, fwd, both, a) -> None:
    """Event times of the case, then each kernel's device time per call (and the host time with --host)."""
    f_ms, fb_ms = bench_ms(fwd), bench_ms(both)
    print(f"\n## {name}: fwd {f_ms:.3f} ms, fwd+bwd {fb_ms:.3f} ms (events)")
    for label, fn in (("fwd", fwd), ("fwd+bwd", both)):
        rows = _kernel_table(fn, a.iters)
        dev = sum(r[1] for r in rows) / 1000
        print(f"{label}: device {dev:.3f} ms per call in {sum(r[2] for r in rows)} kernels")
        for kname, us, c in rows[:8]:
            print(f"   {us:9.1f} us  x{c:<3d} {kname}")
        if a.host:
            print(f"{label}: host {_host_us(fn):.1f} us per call, "
                  f"{_host_us_no_launch(fn):.1f} with Triton launches as no-ops")
    if a.host:
        print(f"fwd+bwd host profile (20 calls, by own time):\n{_host_profile(both)}")


if __name__ == "__main__":
    sys.exit(main())
