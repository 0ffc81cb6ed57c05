"""FP8 GEMM probe at gpu_base shapes (65,536 tokens): nn.Linear forward + backward, compiled with static shapes, in
bf16 (autocast), gem's train.precision=fp8 Linear and torchao's Float8Linear (recipes rowwise and
rowwise_with_gw_hp); then the MoE experts' grouped GEMMs (bf16 torch._grouped_mm, torchao's fp8 grouped GEMM, and
the raw forward of torch._scaled_grouped_mm against torch._grouped_mm). Writes $OUT/fp8probe.json (or ./).

    T=65536 python tools/fp8_gemm_probe.py
    SECTIONS=raw T=65536 python tools/fp8_gemm_probe.py   # only the GEMMs alone, bf16 against row-wise fp8

Sections (SECTIONS, comma list): linear, grouped, raw (the dense GEMMs alone: operands quantized beforehand, so
the figure is the GEMM's own speed-up, the most fp8 can buy at these shapes).
"""

import json
import os
import traceback

import torch
from torch import nn
from triton.testing import do_bench

torch.backends.cuda.matmul.allow_tf32 = True
T = int(os.environ.get("T", "65536"))
E = 8  # experts
res = {}


def bench(name, fn, flops):
    try:
        fn()
        torch.cuda.synchronize()
        ms = do_bench(fn, warmup=25, rep=200)
        res[name] = ms
        print(f"{name:48s} {ms:8.3f} ms  {flops / ms / 1e9:7.1f} TFLOP/s", flush=True)
    except Exception as e:  # noqa: BLE001 (a recipe this stack cannot run is reported, not fatal)
        print(f"{name:48s} FAILED {type(e).__name__}: {str(e)[:300]}", flush=True)


def make_linear(kind, k, n):
    lin = nn.Linear(k, n, bias=False, device="cuda")
    if kind == "gem":
        from gem.model.precision import FP8Linear

        new = FP8Linear.__new__(FP8Linear)
        new.__dict__ = dict(lin.__dict__)
        return new
    if kind in ("torchao", "torchao_gwhp"):
        from torchao.float8 import Float8LinearConfig, convert_to_float8_training

        m = nn.Sequential(lin)
        recipe = "rowwise" if kind == "torchao" else "rowwise_with_gw_hp"
        convert_to_float8_training(m, config=Float8LinearConfig.from_recipe_name(recipe))
        return m[0]
    return lin


def linear_case(kind, k, n):
    torch._dynamo.reset()
    lin = make_linear(kind, k, n)
    f = torch.compile(lin, dynamic=False)
    x = torch.randn(T, k, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    g = torch.randn(T, n, device="cuda", dtype=torch.bfloat16)

    def step():
        with torch.autocast("cuda", torch.bfloat16):
            y = f(x)
        y.backward(g)
        x.grad = None
        lin.weight.grad = None

    bench(f"linear {kind} T{T} {k}->{n} fwd+bwd", step, 6 * T * k * n)


def grouped_case(k, n):
    m = 2 * T
    offs = torch.arange(1, E + 1, device="cuda", dtype=torch.int32) * (m // E)
    a = torch.randn(m, k, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    w = (torch.randn(E, k, n, device="cuda") / k ** 0.5).requires_grad_()
    g = torch.randn(m, n, device="cuda", dtype=torch.bfloat16)

    def bf16_step():
        torch._grouped_mm(a, w.to(torch.bfloat16), offs=offs).backward(g)
        a.grad = None
        w.grad = None

    bench(f"grouped bf16 M{m} {k}->{n} fwd+bwd", bf16_step, 6 * m * k * n)
    wt = (torch.randn(E, n, k, device="cuda") / k ** 0.5).requires_grad_()
    try:
        from torchao.prototype.moe_training.fp8_grouped_mm import _to_fp8_rowwise_then_scaled_grouped_mm as tao_mm

        def ao_step():
            tao_mm(a, wt.to(torch.bfloat16).transpose(-2, -1), offs).backward(g)
            a.grad = None
            wt.grad = None

        bench(f"grouped torchao fp8 M{m} {k}->{n} fwd+bwd", ao_step, 6 * m * k * n)
        torch._dynamo.reset()
        bench(f"grouped torchao fp8 compiled M{m} {k}->{n} fwd+bwd", torch.compile(ao_step, dynamic=False),
              6 * m * k * n)
    except Exception:  # noqa: BLE001
        traceback.print_exc()
    try:  # the GEMMs alone: forward with unit scales
        a8 = a.detach().to(torch.float8_e4m3fn)
        w8 = wt.detach().to(torch.float8_e4m3fn).transpose(-2, -1)
        sa, sw = torch.ones(m, device="cuda"), torch.ones(E, n, device="cuda")
        bench(f"raw _scaled_grouped_mm fwd M{m} {k}->{n}",
              lambda: torch._scaled_grouped_mm(a8, w8, sa, sw, offs=offs, out_dtype=torch.bfloat16), 2 * m * k * n)
        bench(f"raw _grouped_mm bf16 fwd M{m} {k}->{n}",
              lambda: torch._grouped_mm(a.detach(), w.detach().to(torch.bfloat16), offs=offs), 2 * m * k * n)
    except Exception:  # noqa: BLE001
        traceback.print_exc()


def raw_dense_case(k, n):
    """Forward x·Wᵀ and input gradient dy·W at one layer's shape: bf16 torch.mm against torch._scaled_mm with
    row-wise scales (per token, per output or input channel), E4M3 operands laid out as _scaled_mm wants them."""
    x = torch.randn(T, k, device="cuda", dtype=torch.bfloat16)
    dy = torch.randn(T, n, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16)
    f8 = torch.float8_e4m3fn
    x8, dy8 = x.to(f8), dy.to(f8)
    w8_fwd = w.to(f8).t()  # [k, n], column-major: W as stored
    w8_bwd = w.t().contiguous().to(f8).t()  # [n, k], column-major: Wᵀ stored
    ones = lambda r: torch.ones(r, 1, device="cuda")
    bench(f"raw mm bf16 fwd T{T} {k}->{n}", lambda: torch.mm(x, w.t()), 2 * T * k * n)
    bench(f"raw _scaled_mm fp8 fwd T{T} {k}->{n}",
          lambda: torch._scaled_mm(x8, w8_fwd, ones(T), torch.ones(1, n, device="cuda"), out_dtype=torch.bfloat16, use_fast_accum=True),
          2 * T * k * n)
    bench(f"raw mm bf16 dgrad T{T} {k}->{n}", lambda: torch.mm(dy, w), 2 * T * k * n)
    bench(f"raw _scaled_mm fp8 dgrad T{T} {k}->{n}",
          lambda: torch._scaled_mm(dy8, w8_bwd, ones(T), torch.ones(1, k, device="cuda"), out_dtype=torch.bfloat16, use_fast_accum=True),
          2 * T * k * n)


def main():
    sections = set(os.environ.get("SECTIONS", "linear,grouped,raw").split(","))
    if "raw" in sections:
        for k, n in [(1024, 3072), (1024, 1024), (1024, 4096), (4096, 1024)]:
            raw_dense_case(k, n)
    if "linear" in sections:
        for k, n in [(1024, 3072), (1024, 1024), (1024, 4096), (4096, 1024)]:
            for kind in ("bf16", "gem", "torchao", "torchao_gwhp"):
                linear_case(kind, k, n)
    if "grouped" in sections:
        for k, n in [(1024, 2048), (2048, 1024)]:
            grouped_case(k, n)
    with open(os.path.join(os.environ.get("OUT", "."), "fp8probe.json"), "w") as f:
        json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
