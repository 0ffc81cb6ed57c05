"""FP8 quantization fused into its producers (gem.ops.fp8) against producing then quantizing, on one GPU.

    python scripts/bench_quant.py [--tokens 65536] [--norm-widths 1024] [--ffn-widths 4096,2048] [--json out.json]

Forward only, bf16, at the gpu_base shapes (d_model 1024; dense FFN 4096 and MoE expert FFN 2048 wide). Each row
reports the median device time (triton.testing.do_bench), GB/s over the bytes the fused op must move (read the
inputs, write the output, the fp8 data and the scales; the same count for every competitor of a case) and that
rate as a share of x.clone() on the same input. Competitors: our fused kernel; the producer in torch then our
Triton quantize; the producer and torch's row-wise (or MX) quantization formula, eager and under torch.compile.
Every function runs once before it is timed, so Triton's compile and torch.compile's tracing stay out of the times.
"""

from __future__ import annotations

import argparse
import sys

import torch
import torch.nn.functional as F

from gem.bench.kernels import bench_ms, compile_static


def _torch_quant(y, scaling):
    """The quantization in torch ops (the references of gem.ops.fp8 / gem.ops.mx), for eager and compiled rows."""
    from gem.ops import fp8, mx

    y2 = y.reshape(-1, y.shape[-1])
    if scaling == "row":
        return fp8.quantize_rows_reference(y2, mx.FORMATS["e4m3"])
    return mx.mx_quantize_reference(y2, 32, mx.FORMATS["e4m3"])


def _triton_quant(y, scaling):
    from gem.ops import fp8, mx

    return fp8.quantize_rows(y, kernel="triton") if scaling == "row" else mx.quantize(y, kernel="triton")


def _norm_cases(tokens, n, scaling):
    from gem.ops import fp8

    x = torch.randn(tokens, n, device="cuda", dtype=torch.bfloat16)
    w = torch.rand(n, device="cuda", dtype=torch.bfloat16) + 0.5
    scale_bytes = tokens * 4 if scaling == "row" else tokens * (n // 32)
    nbytes = x.numel() * (2 + 2 + 1) + scale_bytes + tokens * 4  # x in; y, data, scales, rstd out

    def unfused(y):
        return y, _torch_quant(y, scaling)

    def torch_ops():
        return unfused(F.rms_norm(x, (n,), w, 1e-6))

    return x, nbytes, {
        "fused rms_norm_quant": lambda: fp8.rms_norm_quant(x, w, 1e-6, scaling=scaling, kernel="triton"),
        "F.rms_norm + triton quantize": lambda: _triton_quant(F.rms_norm(x, (n,), w, 1e-6), scaling),
        "F.rms_norm + torch quantize (eager)": torch_ops,
        "F.rms_norm + torch quantize (compiled)": compile_static(torch_ops),
    }


def _swiglu_cases(tokens, n, scaling):
    from gem.ops import fp8

    a = torch.randn(tokens, n, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(tokens, n, device="cuda", dtype=torch.bfloat16)
    scale_bytes = tokens * 4 if scaling == "row" else tokens * (n // 32)
    nbytes = a.numel() * (2 + 2 + 2 + 1) + scale_bytes  # a, b in; h, data, scales out

    def torch_ops():
        h = F.silu(a) * b
        return h, _torch_quant(h, scaling)

    return a, nbytes, {
        "fused swiglu_quant": lambda: fp8.swiglu_quant(a, b, scaling=scaling, kernel="triton"),
        "silu(a) * b + triton quantize": lambda: _triton_quant(F.silu(a) * b, scaling),
        "silu(a) * b + torch quantize (eager)": torch_ops,
        "silu(a) * b + torch quantize (compiled)": compile_static(torch_ops),
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=65536)
    ap.add_argument("--norm-widths", default="1024", help="RMSNorm widths (gpu_base d_model 1024)")
    ap.add_argument("--ffn-widths", default="4096,2048", help="SwiGLU widths (gpu_base d_ff 4096, MoE d_ff 2048)")
    ap.add_argument("--scalings", default="row,mx")
    ap.add_argument("--json", default=None, help="write the rows here")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("bench_quant: needs a CUDA GPU (it times Triton kernels on the device); none found, nothing measured",
              file=sys.stderr)
        return 1
    rows = []
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, tokens {args.tokens}, bf16, forward")
    print("| case | impl | ms | GB/s | % of copy |")
    print("|---|---|---|---|---|")
    plan = [("rms_norm", int(n), s) for n in args.norm_widths.split(",") if n for s in args.scalings.split(",")]
    plan += [("swiglu", int(n), s) for n in args.ffn_widths.split(",") if n for s in args.scalings.split(",")]
    for op, n, scaling in plan:
        src, nbytes, impls = (_norm_cases if op == "rms_norm" else _swiglu_cases)(args.tokens, n, scaling)
        copy_ms = bench_ms(src.clone)
        copy_gbs = 2 * src.numel() * src.element_size() / copy_ms / 1e6
        case = f"{op} {args.tokens}x{n} {scaling}"
        print(f"| {case} | x.clone() | {copy_ms:.4f} | {copy_gbs:.0f} | 100% |")
        rows.append({"case": case, "impl": "x.clone()", "ms": copy_ms, "gbs": copy_gbs, "pct_copy": 100.0})
        for name, fn in impls.items():
            try:
                fn()  # compile / trace outside the timing
                torch.cuda.synchronize()
                ms = bench_ms(fn)
            except Exception as e:  # noqa: BLE001 - a competitor that cannot run is reported, the rest still run
                print(f"| {case} | {name} | failed: {type(e).__name__}: {str(e).splitlines()[0][:120]} | | |")
                continue
            gbs = nbytes / ms / 1e6
            print(f"| {case} | {name} | {ms:.4f} | {gbs:.0f} | {100 * gbs / copy_gbs:.0f}% |")
            rows.append({"case": case, "impl": name, "ms": ms, "gbs": gbs, "pct_copy": 100 * gbs / copy_gbs})
    if args.json:
        import json

        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
