"""Block-scaled FP8 on one GPU: the quantize kernels' GB/s against a torch copy of the same tensor, and the
block-scaled GEMMs (torch._scaled_mm, 1x128 x 128x128 and 1x128 x 1x128) against bf16 `mm` and row-wise fp8.

    python tools/bench_fp8_block.py [--sections quant,gemm,layer,fused,block,sweep] [--tokens 65536]

CUDA events, warmup excluded; bytes moved = input + codes + scales (both layouts when transposed).
fused: RMSNorm / SwiGLU writing 1x128 blocks (both layouts) against the op compiled by Inductor, then the quantizer.
block: a dense block's GEMM path, forward + backward (norm -> QKV; norm -> w1, w3 -> SwiGLU -> w2) in bf16,
fp8_block quantizing each GEMM input itself, with the fused forward producers, and with the SwiGLU backward
writing FP8 gradients too (the model's path).
"""

from __future__ import annotations

import argparse
from functools import partial

import torch
import torch.nn.functional as F

from gem.model import precision as prec
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
        copy = _ms(partial(y.copy_, x))
        copy_gbs = 2 * x.nbytes / copy / 1e6
        nb = x.numel() // 128
        for name, fn, nbytes in (
            ("1x128", partial(tfb.quantize_1x128_triton, x), x.nbytes + x.numel() + 4 * nb),
            ("1x128 + transposed", partial(tfb.quantize_1x128_triton, x, True), x.nbytes + 2 * x.numel() + 8 * nb),
            ("dequantize 1x128", None, x.numel() + 4 * nb + x.nbytes),
        ):
            if fn is None:
                q, s = tfb.quantize_1x128_triton(x)
                fn = partial(tfb.dequantize_triton, q, s, torch.bfloat16, weight=False)
            ms = _ms(fn)
            gbs = nbytes / ms / 1e6
            print(f"| [{tokens}, {k}] bf16 | {name} | {ms:.3f} | {gbs:.0f} | {copy_gbs:.0f} | {gbs / copy_gbs:.2f} |")
    w = torch.randn(4096, 1024, device="cuda", dtype=torch.bfloat16)
    wc = torch.empty_like(w)
    copy = _ms(partial(wc.copy_, w))
    ms = _ms(partial(tfb.quantize_128x128_triton, w))
    gbs = (w.nbytes + 2 * w.numel()) / ms / 1e6
    print(f"| [4096, 1024] bf16 | 128x128 + transposed | {ms:.4f} | {gbs:.0f} | {2 * w.nbytes / copy / 1e6:.0f} | |")


def _then_quantize(op, a, b):
    return tfb.quantize_1x128_triton(op(a, b), True)


def _block_step(fn, x, g1, g2):
    a, b = fn(x)
    torch.autograd.backward((a, b), (g1, g2))


def fused(tokens: int) -> None:
    """Producers fused with the 1x128 quantizer (both layouts) against Inductor's op + the quantizer."""
    print("| producer [tokens, K] | unfused ms (Inductor op + quantizer) | fused ms | x | fused GB/s |")
    print("|---|---|---|---|---|")
    rms = torch.compile(lambda x, w: torch.nn.functional.rms_norm(x, (x.shape[-1],), w, 1e-6))
    swiglu = torch.compile(lambda a, b: torch.nn.functional.silu(a) * b)
    for k in (1024, 2048):
        x = torch.randn(tokens, k, device="cuda", dtype=torch.bfloat16)
        w = torch.randn(k, device="cuda", dtype=torch.bfloat16)
        unf = _ms(partial(_then_quantize, rms, x, w))
        fus = _ms(partial(tfb.norm_quant_triton, x, w, None, 1e-6, False, True, False))
        nbytes = x.nbytes + 2 * x.numel() + 8 * x.numel() // 128
        print(f"| RMSNorm [{tokens}, {k}] | {unf:.3f} | {fus:.3f} | {unf / fus:.2f} | {nbytes / fus / 1e6:.0f} |")
    for k in (4096, 8192):
        a = torch.randn(tokens, k, device="cuda", dtype=torch.bfloat16)
        b = torch.randn_like(a)
        unf = _ms(partial(_then_quantize, swiglu, a, b))
        fus = _ms(partial(tfb.swiglu_quant_triton, a, b, True, False))
        nbytes = 2 * a.nbytes + 2 * a.numel() + 8 * a.numel() // 128
        print(f"| SwiGLU [{tokens}, {k}] | {unf:.3f} | {fus:.3f} | {unf / fus:.2f} | {nbytes / fus / 1e6:.0f} |")


class _DenseBlock(torch.nn.Module):
    """The GEMM path of a dense pre-norm block, without attention: norm -> QKV; norm -> w1, w3 -> SwiGLU -> w2.
    As in gem.model.attention.TransformerBlock, the FP8 weight copies are looked up in eager code and the rest runs
    as one compiled region."""

    def __init__(self, d: int, d_ff: int):
        super().__init__()
        self.n1, self.n2 = torch.nn.RMSNorm(d, eps=1e-6), torch.nn.RMSNorm(d, eps=1e-6)
        self.qkv = torch.nn.Linear(d, 3 * d, bias=False)
        self.w1, self.w3 = torch.nn.Linear(d, d_ff, bias=False), torch.nn.Linear(d, d_ff, bias=False)
        self.w2 = torch.nn.Linear(d_ff, d, bias=False)
        self.fuse = True

    def region(self, x, w8):
        if self.fuse == "forward":  # the producers' forward only: the FFN's gradients quantized by its layers
            qkv = self.qkv(prec.block_fp8_norm(self.n1, x, self.qkv), **prec.fp8_kw(w8[0]))
            h = prec.block_fp8_norm(self.n2, x, self.w1, self.w3)
            a, b = self.w1(h, **prec.fp8_kw(w8[1])), self.w3(h, **prec.fp8_kw(w8[2]))
            return qkv, self.w2(fb.swiglu_1x128(a, b, transposed=True), **prec.fp8_kw(w8[3]))
        if self.fuse:
            qkv = self.qkv(prec.block_fp8_norm(self.n1, x, self.qkv), **prec.fp8_kw(w8[0]))
            return qkv, prec.block_fp8_ffn(prec.block_fp8_norm(self.n2, x, self.w1, self.w3), self.w1, self.w3,
                                           self.w2, w8[1:])
        h = self.n2(x)
        w8 = w8 or (None,) * 4
        a, b = self.w1(h, **prec.fp8_kw(w8[1])), self.w3(h, **prec.fp8_kw(w8[2]))
        return self.qkv(self.n1(x), **prec.fp8_kw(w8[0])), self.w2(F.silu(a) * b, **prec.fp8_kw(w8[3]))

    def forward(self, x):
        return self.region(x, prec.fp8_weights(self.qkv, self.w1, self.w3, self.w2))


def block(tokens: int, d: int = 1024, d_ff: int = 4096) -> None:
    print(f"| dense block GEMM path, {tokens} tokens, d {d}, d_ff {d_ff}, fwd + bwd | ms | x bf16 |")
    print("|---|---|---|")
    x = torch.randn(tokens, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    g1 = torch.randn(tokens, 3 * d, device="cuda", dtype=torch.bfloat16)
    g2 = torch.randn(tokens, d, device="cuda", dtype=torch.bfloat16)
    base = None
    for name, precision, fuse in (("bf16", "bf16", False), ("fp8_block, quantizer per GEMM", "fp8_block", False),
                                  ("fp8_block, fused forward producers", "fp8_block", "forward"),
                                  ("fp8_block, fused producers + FP8 SwiGLU gradients", "fp8_block", True)):
        torch.manual_seed(0)
        m = _DenseBlock(d, d_ff).cuda().bfloat16()
        prec.apply_precision(m, precision, "cuda", ["qkv", "w1", "w2", "w3"])
        m.fuse = fuse
        m.region = torch.compile(m.region)  # Inductor fuses the unfused paths' norms / SwiGLU as in the model
        ms = _ms(partial(_block_step, m, x, g1, g2), iters=20)
        base = base or ms
        print(f"| {name} | {ms:.3f} | {base / ms:.2f} |", flush=True)


def sweep(tokens: int) -> None:
    """Launch configs of the quantizer and the fused producers on [tokens, 1024] bf16, against a torch copy."""
    x = torch.randn(tokens, 1024, device="cuda", dtype=torch.bfloat16)
    y = torch.empty_like(x)
    copy_gbs = 2 * x.nbytes / _ms(partial(y.copy_, x)) / 1e6
    print(f"copy: {copy_gbs:.0f} GB/s")
    saved = tfb.ROWS_BLOCK_M, tfb.ROWS_WARPS, tfb.TRANS_WARPS, tfb.NORM_WARPS
    for bm in (16, 32, 64):
        for warps in (4, 8):
            tfb.ROWS_BLOCK_M, tfb.ROWS_WARPS = bm, warps
            gbs = (x.nbytes + x.numel() * 1.03) / _ms(partial(tfb.quantize_1x128_triton, x)) / 1e6
            print(f"1x128 BLOCK_M={bm} warps={warps}: {gbs:.0f} GB/s ({gbs / copy_gbs:.2f} of copy)")
    w = torch.randn(1024, device="cuda", dtype=torch.bfloat16)
    for warps in (4, 8, 16):
        tfb.TRANS_WARPS = tfb.NORM_WARPS = warps
        gbs = (x.nbytes + 2.06 * x.numel()) / _ms(partial(tfb.quantize_1x128_triton, x, True)) / 1e6
        print(f"1x128 + transposed warps={warps}: {gbs:.0f} GB/s ({gbs / copy_gbs:.2f} of copy)")
        gbs = (x.nbytes + 2.06 * x.numel()) / _ms(partial(tfb.norm_quant_triton, x, w, None, 1e-6, False, True,
                                                          False)) / 1e6
        print(f"fused RMSNorm warps={warps}: {gbs:.0f} GB/s ({gbs / copy_gbs:.2f} of copy)")
    tfb.ROWS_BLOCK_M, tfb.ROWS_WARPS, tfb.TRANS_WARPS, tfb.NORM_WARPS = saved


def gemm(tokens: int) -> None:
    """The shipped GEMM path (gem.model.precision.block_mm) against bf16 `mm` and row-wise fp8."""
    print("| GEMM (M x K -> N) | bf16 ms | row-wise fp8 ms | block fp8 ms | block TFLOP/s | rel. error vs emulation |")
    print("|---|---|---|---|---|---|")
    for m, k, n, what in ((tokens, 1024, 3072, "qkv"), (tokens, 1024, 4096, "w1"), (tokens, 4096, 1024, "w2"),
                          (tokens - 77, 1024, 1024, "out, ragged M"), (4096, tokens, 1024, "wgrad w2 (K = tokens)")):
        a = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        b = torch.randn(n, k, device="cuda", dtype=torch.bfloat16)
        bf = _ms(partial(torch.mm, a, b.t()))
        qa, sa = fb.quantize_1x128(a)
        tiles = not what.startswith("wgrad")
        if tiles:
            qb, _, sb = fb.quantize_128x128(b)
        else:
            qb, sb = fb.quantize_1x128(b)
        ra, rb = torch.rand(m, 1, device="cuda"), torch.rand(1, n, device="cuda")
        row = _ms(partial(torch._scaled_mm, qa, qb.t(), scale_a=ra, scale_b=rb, out_dtype=torch.bfloat16,
                          use_fast_accum=True))
        fn = partial(prec.block_mm, qa, sa, qb, sb, tiles, torch.bfloat16)
        out = fn().double()
        deq_b = fb.dequantize_128x128 if tiles else fb.dequantize_1x128
        ref = fb.dequantize_1x128(qa, sa, torch.float32).double() @ deq_b(qb, sb, torch.float32).double().t()
        err = ((out - ref).norm() / ref.norm()).item()
        ms = _ms(fn)
        print(f"| {what}: {m} x {k} -> {n} | {bf:.3f} | {row:.3f} | {ms:.3f} | {2 * m * k * n / ms / 1e9:.0f} | "
              f"{err:.1e} |")


def _fwd_bwd(lin, x, gy):
    lin(x).backward(gy)


def layer(tokens: int) -> None:
    """One Linear, forward + backward (quantization included): nn.Linear bf16, fp8 (row-wise), fp8_block."""
    print("| layer (tokens x in -> out) | bf16 ms | fp8 ms | fp8_block ms |")
    print("|---|---|---|---|")
    for k, n in ((1024, 3072), (1024, 1024), (1024, 4096), (4096, 1024)):
        x = torch.randn(tokens, k, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        gy = torch.randn(tokens, n, device="cuda", dtype=torch.bfloat16)
        row = []
        for precision in ("bf16", "fp8", "fp8_block"):
            lin = torch.nn.Sequential(torch.nn.Linear(k, n, bias=False)).cuda().bfloat16()
            prec.apply_precision(lin, precision, "cuda", ["0"])

            row.append(_ms(partial(_fwd_bwd, lin, x, gy), iters=20))
        print(f"| {tokens} x {k} -> {n} | " + " | ".join(f"{t:.3f}" for t in row) + " |")


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--sections", default="gemm,quant,layer")
    p.add_argument("--tokens", type=int, default=65536)
    args = p.parse_args()
    print(torch.__version__, torch.version.cuda, torch.cuda.get_device_name())
    for s in args.sections.split(","):
        {"quant": quant, "gemm": gemm, "sweep": sweep, "layer": layer, "fused": fused, "block": block}[s](args.tokens)


if __name__ == "__main__":
    main()
