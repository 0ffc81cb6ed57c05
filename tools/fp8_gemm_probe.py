"""FP8 GEMM probe at gpu_base shapes (65,536 tokens): nn.Linear forward + backward, compiled with static shapes, in
bf16 (autocast), gem's train.precision=fp8 Linear and torchao's Float8Linear (recipes rowwise and
rowwise_with_gw_hp); then the MoE experts' grouped GEMMs (bf16 torch._grouped_mm, torchao's fp8 grouped GEMM, and
the raw forward of torch._scaled_grouped_mm against torch._grouped_mm). Writes $OUT/fp8probe.json (or ./).

    T=65536 python tools/fp8_gemm_probe.py
"""
import json, os, sys, traceback
import torch, torch.nn as nn
from triton.testing import do_bench
torch.backends.cuda.matmul.allow_tf32 = True
T = int(os.environ.get("T", 65536))
res = {}
def bench(name, fn, flops):
    try:
        fn(); torch.cuda.synchronize()
        ms = do_bench(fn, warmup=25, rep=200)
        res[name] = ms
        print(f"{name:48s} {ms:8.3f} ms  {flops / ms / 1e9:7.1f} TFLOP/s", flush=True)
    except Exception as e:
        print(f"{name:48s} FAILED {type(e).__name__}: {str(e)[:300]}", flush=True)

def linear_case(kind, K, N):
    torch._dynamo.reset()
    lin = nn.Linear(K, N, bias=False, device="cuda")
    if kind == "gem":
        from gem.model.precision import FP8Linear
        new = FP8Linear.__new__(FP8Linear); new.__dict__ = dict(lin.__dict__); lin = new
    elif kind == "torchao":
        from torchao.float8 import convert_to_float8_training, Float8LinearConfig
        m = nn.Sequential(lin); convert_to_float8_training(m, config=Float8LinearConfig.from_recipe_name("rowwise")); lin = m[0]
    elif kind == "torchao_gwhp":
        from torchao.float8 import convert_to_float8_training, Float8LinearConfig
        m = nn.Sequential(lin); convert_to_float8_training(m, config=Float8LinearConfig.from_recipe_name("rowwise_with_gw_hp")); lin = m[0]
    f = torch.compile(lin, dynamic=False)
    x = torch.randn(T, K, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    g = torch.randn(T, N, device="cuda", dtype=torch.bfloat16)
    def step():
        with torch.autocast("cuda", torch.bfloat16):
            y = f(x)
        y.backward(g)
        x.grad = None; lin.weight.grad = None
    bench(f"linear {kind} T{T} {K}->{N} fwd+bwd", step, 6 * T * K * N)

for K, N in [(1024, 3072), (1024, 1024), (1024, 4096), (4096, 1024)]:
    for kind in ("bf16", "gem", "torchao", "torchao_gwhp"):
        linear_case(kind, K, N)

# grouped experts: 8 experts, 2T assignments, padded groups
E = 8
for K, N in [(1024, 2048), (2048, 1024)]:
    M = 2 * T
    offs = torch.arange(1, E + 1, device="cuda", dtype=torch.int32) * (M // E)
    A = torch.randn(M, K, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    W = (torch.randn(E, K, N, device="cuda") / K ** 0.5).requires_grad_()
    G = torch.randn(M, N, device="cuda", dtype=torch.bfloat16)
    def bf16_step():
        y = torch._grouped_mm(A, W.to(torch.bfloat16), offs=offs); y.backward(G); A.grad = None; W.grad = None
    torch._dynamo.reset()
    bench(f"grouped bf16 M{M} {K}->{N} fwd+bwd", torch.compile(bf16_step, dynamic=False) if False else bf16_step, 6 * M * K * N)
    try:
        from torchao.prototype.moe_training.fp8_grouped_mm import _to_fp8_rowwise_then_scaled_grouped_mm as tg
        Wt = (torch.randn(E, N, K, device="cuda") / K ** 0.5).requires_grad_()
        def ao_step():
            y = tg(A, Wt.to(torch.bfloat16).transpose(-2, -1), offs); y.backward(G); A.grad = None; Wt.grad = None
        bench(f"grouped torchao fp8 M{M} {K}->{N} fwd+bwd", ao_step, 6 * M * K * N)
        torch._dynamo.reset()
        bench(f"grouped torchao fp8 compiled M{M} {K}->{N} fwd+bwd", torch.compile(ao_step, dynamic=False), 6 * M * K * N)
    except Exception:
        traceback.print_exc()
    # raw scaled grouped mm forward only
    try:
        a8 = A.detach().to(torch.float8_e4m3fn); w8 = Wt.detach().to(torch.float8_e4m3fn).transpose(-2, -1)
        sa = torch.ones(M, device="cuda"); sw = torch.ones(E, N, device="cuda")
        bench(f"raw _scaled_grouped_mm fwd M{M} {K}->{N}", lambda: torch._scaled_grouped_mm(a8, w8, sa, sw, offs=offs, out_dtype=torch.bfloat16), 2 * M * K * N)
        bench(f"raw _grouped_mm bf16 fwd M{M} {K}->{N}", lambda: torch._grouped_mm(A.detach(), W.detach().to(torch.bfloat16), offs=offs), 2 * M * K * N)
    except Exception:
        traceback.print_exc()
json.dump(res, open(os.path.join(os.environ.get("OUT", "."), "fp8probe.json"), "w"), indent=1)
