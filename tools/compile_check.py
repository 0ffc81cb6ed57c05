"""Compile every Triton kernel of gem.ops for the H200 (sm_90) on a machine without a GPU.

The ops run their host code on CPU tensors with the GPU's launch configs; each kernel launch is turned into a
compile (Triton's warmup path, against a stand-in driver that reports an sm_90 target), down to a cubin through
ptxas. Catches what the interpreter cannot: compile errors of the real lowering (layouts, pipelining, TMA, dtype
rules) and shared memory over the H200's 227 KB per block. It cannot catch what only shows when a kernel runs.

    python tools/compile_check.py [--ops jfa,gdpa,block,rope,fp8]   # a line per op call, then a summary; exit 1 on failure

Slow on a 2-core machine (ptxas takes 10-60 s per kernel here): run it on the changed ops before taking them to a GPU.

Run without TRITON_INTERPRET (it refuses otherwise): the config lists are the GPU's only then.
"""

from __future__ import annotations

import os
import sys
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SMEM_LIMIT = 232448  # bytes of shared memory one block may use on the H200 (227 KB, opt-in)


class _Sm90Driver:
    """Enough of a Triton driver for compiling: device 0, stream 0, target cuda sm_90."""

    def __init__(self):
        from triton.backends.compiler import GPUTarget

        self.target = GPUTarget("cuda", 90, 32)

    def get_current_target(self):
        return self.target

    def get_current_device(self):
        return 0

    def get_current_stream(self, device=None):
        return 0


COMPILED: list[tuple[str, int, float]] = []
RESOURCES: list[tuple[str, int, int]] = []  # (kernel, registers, spill bytes per thread) with --resources


def _resources(kernel) -> tuple[int, int]:
    """(registers, stack bytes per thread) of a compiled kernel, from cuobjdump on its cubin (stack = spills)."""
    import re
    import subprocess
    import tempfile

    import triton

    tool = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(kernel.asm["cubin"])
        f.flush()
        out = subprocess.run([str(tool), "-res-usage", f.name], check=True, capture_output=True, text=True).stdout
    m = re.search(r"REG:(\d+) STACK:(\d+)", out)
    return (int(m.group(1)), int(m.group(2))) if m else (-1, -1)


def _install(resources: bool = False) -> None:
    from triton.runtime import driver
    from triton.runtime.jit import JITFunction

    driver.set_active(_Sm90Driver())
    run = JITFunction.run

    def compile_only(self, *args, grid, warmup, **kwargs):
        t0 = time.perf_counter()
        kernel = run(self, *args, grid=grid, warmup=True, **kwargs)
        shared = int(getattr(kernel.metadata, "shared", 0)) if kernel is not None else -1
        COMPILED.append((self.fn.__name__, shared, time.perf_counter() - t0))
        if resources and kernel is not None:
            RESOURCES.append((self.fn.__name__, *_resources(kernel)))
        if shared > SMEM_LIMIT:  # what the launch would raise on the GPU: the ops' tuners then try the next config
            from triton.runtime.errors import OutOfResources

            raise OutOfResources(shared, SMEM_LIMIT, "shared memory")
        return kernel

    JITFunction.run = compile_only


def _cases():
    """(op, name, thunk) per op call; each thunk runs an op's forward and backward host code on CPU tensors."""
    import torch

    from gem.ops import triton_block, triton_gdpa, triton_jfa
    from gem.ops.rotary import RopeConfig

    def offsets(lengths):
        return torch.nn.functional.pad(torch.tensor(lengths).cumsum(0), (1, 0))

    def qkv(lq, lk, h, hk, d, dtype):
        g = torch.Generator().manual_seed(0)
        return (torch.randn(sum(lq), h, d, generator=g).to(dtype), torch.randn(sum(lk), hk, d, generator=g).to(dtype),
                torch.randn(sum(lk), hk, d, generator=g).to(dtype))

    lens = [300, 1, 0, 77, 129]
    cases = []
    # JFA's backward forms: "auto" as dispatched for these short rows (v2), "base" as for rows of 8K and more, and
    # "pointer" with pointer loads (tensors TMA cannot take)
    forms = {"auto": {}, "base": {"_BWD_DELTA_PRE_MIN_LEN": 0}, "pointer": {"_tma_ok": lambda *t: False}}
    for form, patch in forms.items():
        # bf16 only: ptxas spent minutes on the fp32 (ieee-dot) forward here; the GPU tests cover fp32
        for d, dtype in ((128, torch.bfloat16), (64, torch.bfloat16)):
            for left, right in ((-1, -1), (-1, 0), (19, 0)):
                if form == "base" and left >= 0:
                    continue  # the base backward runs without a left window only
                def jfa(patch=patch, d=d, dtype=dtype, left=left, right=right):
                    from gem.bench.kernels import patched

                    with patched(triton_jfa, patch):
                        q, k, v = qkv(lens, lens, 4, 2, d, dtype)
                        off = offsets(lens)
                        out, lse = triton_jfa._fwd(q, k, v, off, off, 300, 300, 0.1, left, right, False)
                        triton_jfa._bwd(torch.randn_like(out), q, k, v, out, lse, off, off, 300, 300, 0.1, left,
                                        right, False)
                cases.append(("jfa", f"jfa {form} d={d} {str(dtype)[6:]} window=({left},{right})", jfa))
    # the HSTU mask (targets, contextual tokens, max_attn_len) in JFA's dispatched and base forms and GDPA's paths
    targets = torch.tensor([40, 1, 0, 77, 3])
    for form in ("auto", "base"):
        def jfa_hstu(patch=forms[form]):
            from gem.bench.kernels import patched

            with patched(triton_jfa, patch):
                q, k, v = qkv(lens, lens, 4, 2, 128, torch.bfloat16)
                off = offsets(lens)
                out, lse = triton_jfa._fwd(q, k, v, off, off, 300, 300, 0.1, -1, -1, False, targets, 3, 64)
                triton_jfa._bwd(torch.randn_like(out), q, k, v, out, lse, off, off, 300, 300, 0.1, -1, -1, False,
                                targets, 3, 64)
        cases.append(("jfa", f"jfa {form} d=128 bfloat16 hstu", jfa_hstu))
    for short, lq, nt in ((1, [9, 4, 0, 50, 1], [2, 4, 0, 9, 1]), (0, lens, targets.tolist())):
        def gdpa_hstu(short=short, lq=lq, nt=nt):  # short: sequences of up to 64 tokens, as the dispatch takes it
            q, k, v = qkv(lq, lq, 4, 2, 128, torch.bfloat16)
            off = offsets(lq)
            args = (off, off, max(lq), max(lq), "silu", "", -1, 0, 0.1, 1.0, True, short, torch.tensor(nt), 3, 16)
            out = triton_gdpa._gdpa_fwd(q, k, v, *args)
            triton_gdpa._gdpa_bwd(torch.randn_like(out), q, k, v, *args)
        cases.append(("gdpa", f"gdpa short_kv={short} silu hstu", gdpa_hstu))
    # short: a 64-key tile (a sequence past 32 keys), so the narrow 16- and 32-key branches compile too
    for short, lk in ((1, [9, 4, 0, 50, 1]), (0, [300, 70, 5, 1, 0])):
        for left, right in ((-1, -1), (-1, 0)):
            for act, approx in (("gelu_tanh", ""), ("silu", "poly6")):
                def gdpa(short=short, lk=lk, left=left, right=right, act=act, approx=approx):
                    q, k, v = qkv(lens, lk, 4, 2, 128, torch.bfloat16)
                    oq, ok = offsets(lens), offsets(lk)
                    args = (oq, ok, 300, max(lk), act, approx, left, right, 0.1, 1.0, True)
                    out = triton_gdpa._gdpa_fwd(q, k, v, *args, short)
                    triton_gdpa._gdpa_bwd(torch.randn_like(out), q, k, v, *args, short)
                label = f"gdpa short_kv={short} {act}{'/' + approx if approx else ''} window=({left},{right})"
                cases.append(("gdpa", label, gdpa))

    def gdpa_short_d64():  # the short forward on a 256-key tile at D 64 (narrow bodies of 64 and 128 keys)
        lk = [9, 200, 0, 70, 1]
        q, k, v = qkv(lens, lk, 4, 2, 64, torch.bfloat16)
        args = (offsets(lens), offsets(lk), 300, max(lk), "gelu_tanh", "", -1, -1, 0.1, 1.0, True)
        out = triton_gdpa._gdpa_fwd(q, k, v, *args, 1)
        triton_gdpa._gdpa_bwd(torch.randn_like(out), q, k, v, *args, 1)

    cases.append(("gdpa", "gdpa short_kv=1 d=64 keys=200 gelu_tanh", gdpa_short_d64))

    def gdpa_one_pass(longest, d=128):  # the one-pass backward alone, its widest K/V tile set by the longest sequence
        lk = [9, 4, 0, longest, 1]
        q, k, v = qkv(lens, lk, 4, 4, d, torch.bfloat16)
        args = (offsets(lens), offsets(lk), 300, max(lk), "gelu_tanh", "", -1, -1, 0.1, 1.0, True)
        triton_gdpa._gdpa_bwd(torch.randn_like(q), q, k, v, *args, 1)

    for longest in (14, 30, 50):  # 16-, 32- and 64-key tiles
        cases.append(("gdpa", f"gdpa one-pass bwd d=128 longest key {longest}",
                      lambda longest=longest: gdpa_one_pass(longest)))
    cases.append(("gdpa", "gdpa one-pass bwd d=64 longest key 100", lambda: gdpa_one_pass(100, 64)))  # 128-key tile

    def gdpa_long():  # an unmasked long-K/V forward of up to 256 keys (the fused q-tile loop) and backward
        lk = [200, 70, 5, 1, 0]
        q, k, v = qkv(lens, lk, 4, 2, 128, torch.bfloat16)
        args = (offsets(lens), offsets(lk), 300, 200, "gelu_tanh", "", -1, -1, 0.1, 1.0, True, 0)
        out = triton_gdpa._gdpa_fwd(q, k, v, *args)
        triton_gdpa._gdpa_bwd(torch.randn_like(out), q, k, v, *args)

    cases.append(("gdpa", "gdpa gelu_tanh long K/V", gdpa_long))
    for d, dtype, rope, causal in ((128, torch.bfloat16, RopeConfig(), True), (128, torch.bfloat16, None, False),
                                   (64, torch.bfloat16, RopeConfig(rotary_dim=32, interleaved=True), True),
                                   (128, torch.float32, RopeConfig(rotary_dim=64), False),
                                   (96, torch.float32, RopeConfig(rotary_dim=48), True)):
        def block(d=d, dtype=dtype, rope=rope, causal=causal):
            q, k, v = qkv(lens, lens, 4, 2, d, dtype)
            off = offsets(lens)
            rd = rope.resolve_dim(d) if rope else 0
            args = (off, 300, 128, causal, 0.1, 10000.0, rd, bool(rope and rope.interleaved))
            out, lse = triton_block._fwd(q, k, v, *args)
            triton_block._bwd(torch.randn_like(out), q, k, v, out, lse, *args)
        cases.append(("block", f"block d={d} {str(dtype)[6:]} rope={rope is not None} causal={causal}", block))
    # Every rope launch candidate (the tuner would only print "unusable" for one that fails to compile).
    from gem.ops import rotary

    for d, rd, interleaved in ((128, 128, False), (64, 32, True)):
        for i, cfg in enumerate(rotary.gpu_configs(rd, interleaved)):
            def rope_case(d=d, rd=rd, interleaved=interleaved, cfg=cfg):
                x = torch.randn(sum(lens), 4, d).to(torch.bfloat16)
                off = offsets(lens)
                pos = rotary.positions_of(off, x.shape[0]).to(torch.int32)
                cos, sin = rotary.cos_sin_table(300, rd, 10000.0, x.device)
                rotary._rope_launch(cfg, x, torch.empty_like(x), pos, cos, sin, rd, interleaved, False)
            cases.append(("rope", f"rope cfg{i} {cfg} d={d} rd={rd} interleaved={interleaved} bfloat16", rope_case))
    # fp8_block's quantizer and fused producers (ragged 333 tokens: a partial 128-token block in both layouts)
    from gem.ops import triton_fp8_block as tf

    for dtype in (torch.bfloat16, torch.float32):
        def fp8(dtype=dtype):
            g = torch.Generator().manual_seed(0)
            x, a, b = (torch.randn(333, 1024, generator=g).to(dtype) for _ in range(3))
            w = torch.randn(1024, generator=g).to(dtype)
            for transposed in (False, True):
                q, s, *_ = tf.quantize_1x128_triton(x, transposed)
                tf.dequantize_triton(q, s, dtype, False)
                tf.swiglu_quant_triton(a, b, transposed, True)
                tf.swiglu_bwd_quant_triton(a, b, x, transposed)
                for layer in (False, True):
                    *_, mean, rstd = tf.norm_quant_triton(x, w, w if layer else None, 1e-6, layer, transposed,
                                                             True)
                    tf.norm_bwd_triton(x, w, x, mean, rstd, layer)
            q, _, s = tf.quantize_128x128_triton(x[:256])
            tf.dequantize_triton(q, s, dtype, True)
            tf.swiglu_bwd_triton(a, b, x)
        cases.append(("fp8", f"fp8 block quantizers and producers {str(dtype)[6:]}", fp8))
    return cases


def _per_config(op, name, thunk):
    """(op, name, thunk) once per GDPA config index: every autotuned kernel pinned to its index-i config."""
    if op != "gdpa":
        return [(op, name, thunk)]
    from gem.ops import triton_gdpa as tg

    every = dict(tg.CONFIGS)

    def pinned(i):
        try:
            for kind, cfgs in every.items():
                tg.CONFIGS[kind] = [cfgs[i % len(cfgs)]]
            tg._TUNER.best.clear()
            thunk()
        finally:
            tg.CONFIGS.update(every)
            tg._TUNER.best.clear()

    n = max(len(c) for c in every.values())
    return [(op, f"{name} cfg#{i} " + " ".join(f"{k}=[{cfgs[i % len(cfgs)]}]" for k, cfgs in every.items()),
             lambda i=i: pinned(i)) for i in range(n)]


def main() -> int:
    import argparse

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ops", default="jfa,gdpa,block,rope,fp8", help="comma list of jfa, gdpa, block, rope, fp8")
    ap.add_argument("--quick", action="store_true",
                    help="JFA's dispatched forms and bf16 only (the CPU suite's subset, a few minutes cold)")
    ap.add_argument("--resources", action="store_true",
                    help="also report each case's most registers and spill bytes per thread (cuobjdump)")
    ap.add_argument("--match", default="", help="only the cases whose label contains this text (e.g. 'jfa ds')")
    ap.add_argument("--every-config", action="store_true",
                    help="GDPA: each case once per config index i, every kernel on its i-th config (lists cycle, as "
                         "in the GPU every-config test), so --resources shows each candidate's registers")
    a = ap.parse_args()
    ops = set(a.ops.split(","))
    if not ops <= {"jfa", "gdpa", "block", "rope", "fp8"}:
        print(f"compile_check: --ops {sorted(ops)}: expected a comma list of jfa, gdpa, block, rope, fp8")
        return 2
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        print("compile_check: unset TRITON_INTERPRET (the GPU config lists are used only without it)")
        return 2
    os.environ["GEM_AUTOTUNE"] = "0"  # first config: no timing (nothing runs)
    _install(a.resources)
    failed = []
    cases = _cases()
    if a.every_config:
        cases = [c for op, name, thunk in cases for c in _per_config(op, name, thunk)]
    for op, name, thunk in cases:
        if op not in ops or (a.quick and ("float32" in name or (op == "jfa" and name.startswith(("jfa pointer",
                                                                                              "jfa base d=64")))
                                          or (op == "rope" and "cfg0" not in name) or "one-pass bwd" in name
                                          or "hstu" in name)):
            continue
        if a.match and a.match not in name:
            continue
        start, start_res = len(COMPILED), len(RESOURCES)
        t0 = time.perf_counter()
        try:
            thunk()
        except Exception as e:  # noqa: BLE001 - report every case, fail at the end
            failed.append(name)
            print(f"FAIL {name}: {type(e).__name__}: {str(e).splitlines()[0][:300] if str(e) else ''}")
            traceback.print_exc(limit=3)
            continue
        kernels = COMPILED[start:]
        over = sorted({k for k, s, _ in kernels if s > SMEM_LIMIT})
        smem = max((s for _, s, _ in kernels if s <= SMEM_LIMIT), default=0)
        note = f"; configs over the shared-memory limit, skipped as on the GPU: {', '.join(over)}" if over else ""
        if a.resources:
            res = RESOURCES[start_res:]
            spills = sorted({f"{k} {st} B" for k, _, st in res if st > 0})
            note += (f"; max {max((r for _, r, _ in res), default=0)} registers"
                     f"; spills: {', '.join(spills) if spills else 'none'}")
            if a.every_config:  # each kernel's registers / spill bytes, in compile order
                note += "; per kernel: " + ", ".join(f"{k} {r}/{st}" for k, r, st in res)
        print(f"ok   {name}: {len(kernels)} compiles, max shared {smem // 1024} KB, "
              f"{time.perf_counter() - t0:.1f} s{note}")
    print(f"compile_check: {len(COMPILED)} kernel compiles for sm_90, {len(failed)} failed case(s)")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
