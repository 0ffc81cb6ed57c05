"""Block-scaled FP8 on one GPU: the quantize kernels' GB/s against a torch copy of the same tensor, and the
block-scaled GEMMs (torch._scaled_mm, 1x128 x 128x128 and 1x128 x 1x128) against bf16 `mm` and row-wise fp8.

    python tools/bench_fp8_block.py [--sections quant,gemm,sweep] [--tokens 65536]

CUDA events, warmup excluded; bytes moved = input + codes + scales (both layouts when transposed).
"""

from __future__ import annotations

import argparse

import torch

from gem.ops import fp8_block as fb
from gem.ops import triton_fp8_block as tfb


def _ms(fn, iters=50, warmup=5):
    for _ in range(warmup):
        fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / iters


def quant(tokens: int) -> None:
    print("| tensor | kernel | ms | GB/s | copy GB/s | vs copy |")
    print("|---|---|---|---|---|---|")
    for k in (1024, 3072, 4096):
        x = torch.randn(tokens, k, device="cuda", dtype=torch.bfloat16)
        y = torch.empty_like(x)
        copy = _ms(lambda: y.copy_(x))
        copy_gbs = 2 * x.nbytes / copy / 1e6
        nb = x.numel() // 128
        for name, fn, nbytes in (
            ("1x128", lambda: tfb.quantize_1x128_triton(x), x.nbytes + x.numel() + 4 * nb),
            ("1x128 + transposed", lambda: tfb.quantize_1x128_triton(x, True), x.nbytes + 2 * x.numel() + 8 * nb),
            ("dequantize 1x128", None, x.numel() + 4 * nb + x.nbytes),
        ):
            if fn is None:
                q, s = tfb.quantize_1x128_triton(x)
                fn = lambda q=q, s=s: tfb.dequantize_triton(q, s, torch.bfloat16, weight=False)  # noqa: E731
            ms = _ms(fn)
            gbs = nbytes / ms / 1e6
            print(f"| [{tokens}, {k}] bf16 | {name} | {ms:.3f} | {gbs:.0f} | {copy_gbs:.0f} | {gbs / copy_gbs:.2f} |")
    w = torch.randn(4096, 1024, device="cuda", dtype=torch.bfloat16)
    wc = torch.empty_like(w)
    copy = _ms(lambda: wc.copy_(w))
    ms = _ms(lambda: tfb.quantize_128x128_triton(w))
    gbs = (w.nbytes + 2 * w.numel()) / ms / 1e6
    print(f"| [4096, 1024] bf16 | 128x128 + transposed | {ms:.4f} | {gbs:.0f} | {2 * w.nbytes / copy / 1e6:.0f} | |")


def sweep(tokens: int) -> None:
    x = torch.randn(tokens, 1024, device="cuda", dtype=torch.bfloat16)
    y = torch.empty_like(x)
    copy_gbs = 2 * x.nbytes / _ms(lambda: y.copy_(x)) / 1e6
    for bm in (8, 16, 32, 64, 128):
        for warps in (2, 4, 8):
            tfb.ROWS_BLOCK_M, tfb.ROWS_WARPS = bm, warps
            gbs = (x.nbytes + x.numel() * 1.03) / _ms(lambda: tfb.quantize_1x128_triton(x)) / 1e6
            print(f"rows BLOCK_M={bm} warps={warps}: {gbs:.0f} GB/s ({gbs / copy_gbs:.2f} of copy)")
    for warps in (4, 8, 16):
        tfb.TRANS_WARPS = warps
        gbs = (x.nbytes + 2.06 * x.numel()) / _ms(lambda: tfb.quantize_1x128_triton(x, True)) / 1e6
        print(f"transposed warps={warps}: {gbs:.0f} GB/s ({gbs / copy_gbs:.2f} of copy)")


def gemm(tokens: int) -> None:
    print("| GEMM (M x K -> N) | bf16 ms | row-wise fp8 ms | block fp8 ms | block rel. error |")
    print("|---|---|---|---|---|")
    for m, k, n, what in ((tokens, 1024, 3072, "fwd qkv"), (tokens, 4096, 1024, "fwd w2"),
                          (tokens, 1024, 4096, "fwd w1"), (1024, tokens, 4096, "wgrad w1 (K = tokens)"),
                          (tokens - 77, 1024, 1024, "ragged M")):
        a = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        b = torch.randn(n, k, device="cuda", dtype=torch.bfloat16)
        bf = _ms(lambda: a @ b.t())
        qa, sa = fb.quantize_1x128(a)
        ra = torch.rand(m, 1, device="cuda")
        rb = torch.rand(1, n, device="cuda")
        qbr = fb.quantize_1x128(b)[0]
        row = _ms(lambda: torch._scaled_mm(qa, qbr.t(), scale_a=ra, scale_b=rb, out_dtype=torch.bfloat16,
                                           use_fast_accum=True))
        if what.startswith("wgrad"):
            qb, sb = fb.quantize_1x128(b)  # 1x128 x 1x128
            scale_b = sb.t()
        else:
            qb, _, sbw = fb.quantize_128x128(b)
            scale_b = sbw.t()
        err = ms = None
        for name, sa_, sb_ in (("as given", sa, scale_b), ("a outer-major", sa.t().contiguous().t(), scale_b),
                               ("both contiguous", sa, scale_b.contiguous()),
                               ("a outer, b contiguous", sa.t().contiguous().t(), scale_b.contiguous())):
            try:
                fn = lambda sa_=sa_, sb_=sb_: torch._scaled_mm(qa, qb.t(), scale_a=sa_, scale_b=sb_,  # noqa: E731
                                                             out_dtype=torch.bfloat16)
                out = fn().float()
                ref = fb.dequantize_1x128(qa, sa, torch.float32).double() @ (
                    fb.dequantize_1x128(qb, sb, torch.float32) if what.startswith("wgrad")
                    else fb.dequantize_128x128(qb, sbw, torch.float32)).double().t()
                err = ((out.double() - ref).norm() / ref.norm()).item()
                ms = _ms(fn)
                print(f"  {what}: scales {name}: ok, rel err {err:.2e}, {ms:.3f} ms")
            except Exception as e:  # the probe reports which scale layouts cuBLAS takes
                print(f"  {what}: scales {name}: {type(e).__name__}: {str(e).splitlines()[0][:200]}")
        flops = 2 * m * k * n
        print(f"| {what} {m} x {k} -> {n} | {bf:.3f} ({flops / bf / 1e9:.0f} TF) | {row:.3f} | "
              f"{ms if ms is None else f'{ms:.3f} ({flops / ms / 1e9:.0f} TF)'} | {err} |")


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--sections", default="gemm,quant")
    p.add_argument("--tokens", type=int, default=65536)
    args = p.parse_args()
    print(torch.__version__, torch.version.cuda, torch.cuda.get_device_name())
    for s in args.sections.split(","):
        {"quant": quant, "gemm": gemm, "sweep": sweep}[s](args.tokens)


if __name__ == "__main__":
    main()
