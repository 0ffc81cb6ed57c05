"""Host time per call of the attention ops (Python, checks, tables, launches) beside their kernels' own time, on one
GPU.

    python scripts/bench_host.py [--batch 512] [--len 256] [--heads 2] [--dim 64] [--calls 100] [--ops jfa,varlen]

For each op and pass (forward; backward from saved forward outputs) it prints, per call:
  host:   CPU time to issue the call while the GPU is kept busy by a spin kernel queued first, so the CPU never
          waits for the GPU (perf_counter around `--calls` back-to-back calls). `gpu busy` says whether the spin
          kernel was still running when the last call had been issued (else the figure is capped by the GPU).
  device: CUDA events around the same back-to-back calls queued behind the spin: the kernels' own time, gaps
          between one call's kernels included.
  call:   CUDA events around back-to-back calls on an idle GPU, what a caller waits for: about max(host, device)
          for short kernels.
Rows are one process; run it several times for a spread. bf16, causal, fixed-length jagged rows (every sequence
`--len` tokens). gem's ops get one gem.ops.JaggedBatch for all calls, as a model's layers do ("jfa-plain": a plain
offsets tensor, whose per-call batch builds its own tables and checks). Needs gem importable (pip install -e . or PYTHONPATH=.).
"""

from __future__ import annotations

import argparse
import time

import torch

SPIN_CYCLES_PER_US = 2000  # GPU clock cycles per microsecond of the spin kernel, an upper bound for H100 / H200


def _ops(args, q, k, v, off, n):
    from gem.ops import JaggedBatch, block_attention, gdpa, jagged_attention

    batch = JaggedBatch(off, n)  # built once per batch and handed to every layer, as the model does
    ops = {
        "jfa": lambda: jagged_attention(q, k, v, batch, causal=True, kernel="triton"),
        "jfa-plain": lambda: jagged_attention(q, k, v, off, n, causal=True, kernel="triton"),
        "jfa-auto": lambda: jagged_attention(q, k, v, batch, causal=True),
        "gdpa": lambda: gdpa(q, k, v, batch, n, batch, n, causal=True, activation="silu", normalize="max_len_k",
                             kernel="triton"),
        "block": lambda: block_attention(q, k, v, batch, block_size=64, kernel="triton"),
    }
    try:
        import inspect

        from torch.nn.attention.varlen import varlen_attn

        causal = ({"window_size": (-1, 0)} if "window_size" in inspect.signature(varlen_attn).parameters
                  else {"is_causal": True})
        off32 = off.to(torch.int32)
        ops["varlen"] = lambda: varlen_attn(q, k, v, off32, off32, n, n, **causal)  # torch's own, for scale
    except ImportError:
        pass
    return {name: ops[name] for name in args.ops.split(",") if name in ops}


def _spin(us: float) -> None:
    torch.cuda._sleep(int(us * SPIN_CYCLES_PER_US))


def _host(issue, calls: int, budget_us: float) -> tuple[float, bool]:
    """(host microseconds per call, whether the GPU was still busy with the spin when the last call was issued)."""
    torch.cuda.synchronize()
    _spin(budget_us)
    done = torch.cuda.Event()
    t0 = time.perf_counter()
    for i in range(calls):
        issue(i)
    t1 = time.perf_counter()
    done.record()
    busy = not done.query()
    torch.cuda.synchronize()
    return (t1 - t0) * 1e6 / calls, busy


def _device(issue, calls: int, budget_us: float) -> float:
    """Microseconds per call of the kernels alone: events around calls queued behind a spin."""
    torch.cuda.synchronize()
    _spin(budget_us)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for i in range(calls):
        issue(i)
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1e3 / calls


def _whole(issue, calls: int) -> float:
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for i in range(calls):
        issue(i)
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1e3 / calls


def measure(fn, inputs, calls: int) -> dict:
    """{pass: (host us, device us, call us, gpu busy)} for the forward and the backward of fn."""
    for _ in range(3):  # compile, tune, build the per-batch tables
        out = fn()
        torch.autograd.grad(out, inputs, torch.ones_like(out))
    budget = 2000.0 * calls  # spin long enough for the slowest host path we expect (2 ms a call)
    rows = {}
    host, busy = _host(lambda i: fn(), calls, budget)
    rows["fwd"] = (host, _device(lambda i: fn(), calls, budget), _whole(lambda i: fn(), calls), busy)
    grad = torch.ones_like(fn())

    def backward_calls():
        outs = [fn() for _ in range(calls)]  # the graphs to run backward through, made before the timing
        torch.cuda.synchronize()
        return lambda i: torch.autograd.grad(outs[i], inputs, grad)

    host, busy = _host(backward_calls(), calls, budget)
    device = _device(backward_calls(), calls, budget)
    rows["bwd"] = (host, device, _whole(backward_calls(), calls), busy)
    return rows


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batch", type=int, default=512)
    p.add_argument("--len", type=int, default=256)
    p.add_argument("--heads", type=int, default=2)
    p.add_argument("--dim", type=int, default=64)
    p.add_argument("--calls", type=int, default=100)
    p.add_argument("--ops", default="jfa,jfa-plain,jfa-auto,varlen,gdpa,block", help="comma list")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        p.error("needs a CUDA device")
    b, n, h, d = args.batch, args.len, args.heads, args.dim
    off = torch.arange(0, (b + 1) * n, n, device="cuda")
    q, k, v = (torch.randn(b * n, h, d, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}; B {b} x N {n}, H {h}, D {d}, bf16 causal; "
          f"{args.calls} back-to-back calls, microseconds per call")
    print("| op | pass | host | device | call | gpu busy |")
    print("|---|---|---|---|---|---|")
    for name, fn in _ops(args, q, k, v, off, n).items():
        for pass_, (host, device, whole, busy) in measure(fn, (q, k, v), args.calls).items():
            print(f"| {name} | {pass_} | {host:.1f} | {device:.1f} | {whole:.1f} | {'yes' if busy else 'NO'} |",
                  flush=True)


if __name__ == "__main__":
    main()
