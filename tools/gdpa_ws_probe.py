"""Probe: what would GDPA's forward gain from Triton's warp specialization and from a one-instruction tanh?

    python tools/gdpa_ws_probe.py [--quick] [--only persist,True]

A dense micro-kernel with GDPA's forward loop (acc += act(q k^T * scale) v, no softmax), on tensor descriptors (TMA),
so that `tl.range(..., warp_specialize=True)` can split it into a load partition and an MMA/activation partition.
Two loop forms: one program per q tile (the K/V loop is the only loop), and persistent programs that walk q tiles
(the outer loop is the warp-specialized one, so the next tile's q and K/V load during this one's math). Activations:
identity (the MMA ceiling), gelu_tanh as gem's kernels compute it (exp + divide), gelu_tanh through the
`tanh.approx.f32` instruction, and gem's poly6. Each variant's max abs error against fp32 PyTorch is printed beside
its time, and whether the compiled kernel holds a warp_specialize region (Hopper takes it only on 4 warps).
Dense shapes so that only the kernel technique differs: the findings decide what the jagged kernels adopt.
"""

from __future__ import annotations

import argparse
import functools
import math

import torch
import triton
import triton.language as tl

from gem.ops.gdpa import POLY6
from gem.ops.triton_gdpa import _act

# gem's activation codes (gem.ops.triton_gdpa): (ACT, POLY)
ACTS = {"identity": (6, False), "gelu_tanh exp+div": (1, False), "gelu_tanh tanh.approx": (7, False),
        "gelu_tanh poly6": (1, True)}
_P = POLY6["gelu_tanh"]


@triton.jit
def _tile(q_desc, k_desc, v_desc, o_desc, z, m0, N, M, scale, D: tl.constexpr, BLOCK_M: tl.constexpr,
          BLOCK_N: tl.constexpr, ACT: tl.constexpr, POLY: tl.constexpr, C1: tl.constexpr, C2: tl.constexpr,
          C3: tl.constexpr, C4: tl.constexpr, C5: tl.constexpr, C6: tl.constexpr, CLAMP: tl.constexpr,
          WS: tl.constexpr, STAGES: tl.constexpr):
    """One q tile against all its keys; gem's own activation code (gem.ops.triton_gdpa._act)."""
    q = q_desc.load([z * N + m0, 0])
    acc = tl.zeros([BLOCK_M, D], dtype=tl.float32)
    for j in tl.range(0, M, BLOCK_N, num_stages=STAGES, warp_specialize=WS):
        k = k_desc.load([z * M + j, 0])
        v = v_desc.load([z * M + j, 0])
        s = tl.dot(q, k.T) * scale
        a = _act(s, ACT, POLY, C1, C2, C3, C4, C5, C6, CLAMP)
        acc = tl.dot(a.to(v.dtype), v, acc)
    o_desc.store([z * N + m0, 0], acc.to(o_desc.dtype))


@triton.jit
def _fwd(Q, K, V, O, Z, N, M, scale, D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
         ACT: tl.constexpr, POLY: tl.constexpr, WS: tl.constexpr, STAGES: tl.constexpr, PERSIST: tl.constexpr,
         C1: tl.constexpr, C2: tl.constexpr, C3: tl.constexpr, C4: tl.constexpr, C5: tl.constexpr,
         C6: tl.constexpr, CLAMP: tl.constexpr):
    q_desc = tl.make_tensor_descriptor(Q, shape=[Z * N, D], strides=[D, 1], block_shape=[BLOCK_M, D])
    k_desc = tl.make_tensor_descriptor(K, shape=[Z * M, D], strides=[D, 1], block_shape=[BLOCK_N, D])
    v_desc = tl.make_tensor_descriptor(V, shape=[Z * M, D], strides=[D, 1], block_shape=[BLOCK_N, D])
    o_desc = tl.make_tensor_descriptor(O, shape=[Z * N, D], strides=[D, 1], block_shape=[BLOCK_M, D])
    tiles_m = N // BLOCK_M
    if PERSIST:  # the q-tile loop is the warp-specialized one
        for t in tl.range(tl.program_id(0), Z * tiles_m, tl.num_programs(0), num_stages=STAGES,
                          warp_specialize=WS):
            _tile(q_desc, k_desc, v_desc, o_desc, t // tiles_m, (t % tiles_m) * BLOCK_M, N, M, scale, D, BLOCK_M,
                  BLOCK_N, ACT, POLY, C1, C2, C3, C4, C5, C6, CLAMP, False, None)  # inner: default stages
    else:  # one q tile per program: its K/V loop is
        t = tl.program_id(0)
        _tile(q_desc, k_desc, v_desc, o_desc, t // tiles_m, (t % tiles_m) * BLOCK_M, N, M, scale, D, BLOCK_M,
              BLOCK_N, ACT, POLY, C1, C2, C3, C4, C5, C6, CLAMP, WS, STAGES)


def _reference(q, k, v, scale, act):
    s = torch.einsum("znd,zmd->znm", q.float(), k.float()) * scale
    if act != "identity":
        s = torch.nn.functional.gelu(s, approximate="tanh")
    return torch.einsum("znm,zmd->znd", s, v.float())


def _variants():
    """(activation, (BLOCK_M, BLOCK_N, warps, stages, persistent, warp-specialized)): every activation on the plain
    tile loop; warp specialization (4-warp programs: Hopper takes no other) with the MMA ceiling and the two
    gelu_tanh forms a kernel would ship."""
    plain = [(128, 64, 8, 2, False, False), (128, 128, 8, 2, False, False), (64, 64, 4, 2, False, False),
             (64, 128, 4, 2, False, False), (128, 64, 8, 2, True, False)]
    ws = [(128, 64, 4, 2, False, True), (128, 64, 4, 3, False, True), (128, 128, 4, 2, False, True),
          (64, 64, 4, 2, False, True), (128, 64, 4, 2, True, True), (128, 128, 4, 2, True, True),
          (64, 64, 4, 2, True, True)]
    out = [(act, v) for act in ACTS for v in plain]
    out += [(act, v) for act in ("identity", "gelu_tanh exp+div", "gelu_tanh tanh.approx") for v in ws]
    return out


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--quick", action="store_true")
    p.add_argument("--only", default="",
                   help="comma list: run the variants whose row holds every one (persist,True: persistent and WS)")
    args = p.parse_args()
    triton.set_allocator(lambda size, align, stream: torch.empty(size, dtype=torch.int8, device="cuda"))
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    d = 128
    only = [o.strip() for o in args.only.split(",") if o.strip()]
    shapes = [(4096, 512, 128), (4096, 512, 256)] + ([] if args.quick else [(256, 2048, 2048)])
    print("| Z x N x M | act | BLOCK_M x N | warps | stages | loop | WS | WS in IR | ms | TFLOP/s | max err |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for z, n, m in shapes:
        g = torch.Generator(device="cuda").manual_seed(0)
        q, k, v = (torch.randn(z, rows, d, device="cuda", dtype=torch.bfloat16, generator=g)
                   for rows in (n, m, m))
        scale = 1.0 / math.sqrt(d)
        flops = 4.0 * z * n * m * d
        refs = {}
        for act, (bm, bn, warps, stages, persist, ws) in _variants():
            o = torch.full_like(q, float("nan"))  # a tile the kernel never writes shows as NaN
            consts = dict(zip(("C1", "C2", "C3", "C4", "C5", "C6"), _P.coef), CLAMP=_P.clamp)
            grid = (min(z * (n // bm), 2 * sms),) if persist else (z * (n // bm),)
            loop = "persist" if persist else "tile"
            label = f"| {z}x{n}x{m} | {act} | {bm}x{bn} | {warps} | {stages} | {loop} | {ws} |"
            if not all(o in label for o in only):
                continue
            try:
                fn = functools.partial(_fwd[grid], q, k, v, o, z, n, m, scale, D=d, BLOCK_M=bm, BLOCK_N=bn,
                                       ACT=ACTS[act][0], POLY=ACTS[act][1], WS=ws, STAGES=stages,
                                       PERSIST=persist, num_warps=warps,
                                       **consts)
                kern = fn()
                torch.cuda.synchronize()
                ir_ws = "ttg.warp_specialize" in kern.asm["ttgir"]
                key = act.split()[0] if act != "identity" else "identity"
                if key not in refs:
                    refs[key] = _reference(q, k, v, scale, act)
                err = (o.float() - refs[key]).abs().max().item()
                ms = triton.testing.do_bench(fn, warmup=5, rep=30)
                print(f"{label} {ir_ws} | {ms:.4f} | {flops / ms / 1e9:.0f} | {err:.3g} |", flush=True)
            except Exception as e:  # noqa: BLE001 - a variant the compiler refuses is a finding, not a stop
                print(f"{label} - | - | - | {type(e).__name__}: {str(e).splitlines()[0][:100] if str(e) else ''} |",
                      flush=True)


if __name__ == "__main__":
    main()
