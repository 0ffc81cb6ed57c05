"""gem's jagged attention against torch's varlen_attn (FlashAttention varlen), forward and backward kernel time.

    python tools/jfa_vs_varlen.py [--cases full/1024,causal/8192,gpu_base/1024] [--iters 20] [--bwd-form v2|base]

Each case: lengths ~U[1, N] (gpu_base: ~U[0, 1024] with 8 heads, one gpu_base attention layer), ~64K tokens, H 4,
D 128, bf16. Times are torch.profiler device time per call (the kernels only, no host gaps), after a first call
that tunes gem's configs; the forward TFLOP/s counts real tokens only (4·H·D·ΣL², halved when causal). gem's output
and gradients are checked against varlen_attn's first: a case that differs prints MISMATCH instead of times, and
the tool exits 1. Run it in
several fresh processes to see the spread. --bwd-form pins the backward form for every case (by default it
follows gem.ops.triton_jfa._bwd_form). Needs CUDA and a torch with torch.nn.attention.varlen.
"""

from __future__ import annotations

import argparse
import sys

import torch

from gem.bench.kernels import attn_flops, device_ms, disagreement, jagged_lengths, offsets_of
from gem.ops.triton_jfa import jfa_triton

CASES = ("full/1024,full/2048,full/4096,full/8192,causal/1024,causal/2048,causal/4096,causal/8192,gpu_base/1024")


def _case(name: str, n: int, iters: int) -> str:
    from torch.nn.attention.varlen import varlen_attn

    h, d = (8, 128) if name == "gpu_base" else (4, 128)
    causal = name != "full"
    lens = jagged_lengths(n, 65536, low=0 if name == "gpu_base" else 1, seed=0)
    off = offsets_of(lens)
    off32, total, max_len = off.to(torch.int32), int(lens.sum()), int(lens.max())
    right = 0 if causal else -1
    g = torch.Generator(device="cuda").manual_seed(0)
    q, k, v = (torch.randn(total, h, d, device="cuda", dtype=torch.bfloat16, generator=g).requires_grad_()
               for _ in range(3))
    do = torch.randn(total, h, d, device="cuda", dtype=torch.bfloat16, generator=g)
    impls = {"gem": lambda: jfa_triton(q, k, v, off, off, max_len, max_len, d ** -0.5, -1, right, False),
             "varlen": lambda: varlen_attn(q, k, v, off32, off32, max_len, max_len, window_size=(-1, right))}
    ms = {}
    for impl, fwd in impls.items():
        with torch.no_grad():
            ms[impl, "fwd"] = device_ms(fwd, iters)
        out = fwd()
        ms[impl, "bwd"] = device_ms(lambda out=out: torch.autograd.grad(out, (q, k, v), do, retain_graph=True), iters)
    results = {}
    for impl, fwd in impls.items():
        out = fwd()
        results[impl] = (out.detach(), *torch.autograd.grad(out, (q, k, v), do))
    wrong = disagreement(results["gem"], results["varlen"])
    if wrong:
        return f"{name}/{n}: MISMATCH against varlen_attn ({wrong}); no timing reported"
    tflops = attn_flops(lens, h, d, causal=causal) / ms["gem", "fwd"] / 1e9
    return (f"{name}/{n}: gem fwd {ms['gem', 'fwd']:.3f} ms ({tflops:.0f} TFLOP/s) bwd {ms['gem', 'bwd']:.3f} ms | "
            f"varlen_attn fwd {ms['varlen', 'fwd']:.3f} bwd {ms['varlen', 'bwd']:.3f} ms | "
            f"x varlen_attn fwd {ms['varlen', 'fwd'] / ms['gem', 'fwd']:.2f} bwd {ms['varlen', 'bwd'] / ms['gem', 'bwd']:.2f}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cases", default=CASES, help="comma list of full/N, causal/N, gpu_base/N")
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--bwd-form", choices=("v2", "base"), help="pin the backward form (default: the dispatch's)")
    args = ap.parse_args()
    cases = []
    for case in args.cases.split(","):
        name, _, n = case.partition("/")
        if name not in ("full", "causal", "gpu_base") or not n.isdigit() or int(n) < 1:
            sys.exit(f"jfa_vs_varlen: bad case {case!r} (full/N, causal/N or gpu_base/N with N >= 1)")
        cases.append((name, int(n)))
    if not torch.cuda.is_available():
        sys.exit("jfa_vs_varlen: needs a CUDA GPU")
    if args.bwd_form is not None:
        from gem.ops import triton_jfa

        triton_jfa._BWD_DELTA_PRE_MIN_LEN = 0 if args.bwd_form == "base" else 1 << 30
    failed = False
    for name, n in cases:
        line = _case(name, n, args.iters)
        failed |= "MISMATCH" in line
        print(line, flush=True)
    if failed:
        sys.exit("jfa_vs_varlen: gem's result differs from varlen_attn's on some case (above)")


if __name__ == "__main__":
    main()
