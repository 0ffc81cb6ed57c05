"""Every supported call of the attention ops, one after another in one process on the GPU: none may end the CUDA
context (a device-side assert or a fault would make every later call fail), each matches its reference, and the
context still runs work afterwards."""

from __future__ import annotations

import pytest
import torch

from gem.ops import block_attention, gdpa, jagged_attention, rope
from gem.ops._common import triton_interpreting

pytestmark = pytest.mark.gpu


def _need_gpu():
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    if triton_interpreting():
        pytest.skip("TRITON_INTERPRET=1 is set: run the GPU tests with TRITON_INTERPRET=0")


def _offsets(lengths):
    return torch.nn.functional.pad(torch.tensor(lengths).cumsum(0), (1, 0)).cuda()


def _tensors(rows, heads, d, dtype, g):
    return torch.randn(rows, heads, d, generator=g, device="cuda").to(dtype).requires_grad_()


def _calls():
    """(name, fn(kernel) -> output, inputs): every form a user can call."""
    g = torch.Generator(device="cuda").manual_seed(0)
    lk = [0, 1, 37, 300, 5, 129]
    lq_cached = [2, 1, 9, 16, 8, 129]  # the last tokens; more queries than keys in the first and fifth
    targets = torch.tensor([0, 1, 4, 20, 5, 0], device="cuda")
    mk, mq = max(lk), max(lq_cached)
    off_k, off_q = _offsets(lk), _offsets(lq_cached)
    calls = []
    for dtype in (torch.bfloat16, torch.float32):
        q = _tensors(sum(lk), 4, 64, dtype, g)
        k, v = _tensors(sum(lk), 2, 64, dtype, g), _tensors(sum(lk), 2, 64, dtype, g)
        qc = _tensors(sum(lq_cached), 4, 64, dtype, g)
        hstu = {"causal": True, "num_targets": targets, "contextual_len": 3, "max_attn_len": 50}
        same = off_k.clone()  # equal offsets in another tensor: self attention as well
        for name, args in (
            ("self", (q, k, v, off_k, mk)),
            ("self-equal-offsets", (q, k, v, off_k, mk, same, mk)),
            ("cross", (qc, k, v, off_q, mq, off_k, mk)),
        ):
            for mask, kw in (("full", {}), ("causal", {"causal": True}), ("window", {"window": 7}),
                             ("window2", {"window": (5, 3)}), ("hstu", hstu)):
                calls.append((f"jfa-{name}-{mask}-{dtype}",
                              lambda kernel, a=args, kw=kw: jagged_attention(*a, kernel=kernel, **kw), args[:3]))
                gargs = args if len(args) == 7 else args + (args[3], args[4])
                calls.append((f"gdpa-{name}-{mask}-{dtype}",
                              lambda kernel, a=gargs, kw=kw: gdpa(*a, activation="silu", normalize="max_len_k",
                                                                   kernel=kernel, **kw), args[:3]))
        calls.append((f"jfa-lse-{dtype}", lambda kernel, a=(q, k, v, off_k, mk): jagged_attention(
            *a, causal=True, kernel=kernel, return_lse=True)[0], (q, k, v)))
        calls.append((f"block-{dtype}", lambda kernel, a=(q, k, v, off_k, mk): block_attention(
            *a, block_size=64, kernel=kernel), (q, k, v)))
        calls.append((f"rope-{dtype}", lambda kernel, a=(q, off_k, mk): rope(*a, kernel=kernel), (q,)))
    return calls


def test_every_supported_call_in_one_process():
    _need_gpu()
    failures = []
    for name, fn, inputs in _calls():
        out = fn("triton")
        grads = torch.autograd.grad(out, inputs, torch.ones_like(out))
        ref = fn("reference")  # on the same tensors: the references compute in fp32
        ref_grads = torch.autograd.grad(ref, inputs, torch.ones_like(ref))
        for what, a, b in zip(("out", *(f"d{i}" for i in range(len(grads)))), (out, *grads), (ref, *ref_grads)):
            tol = 1e-3 if a.dtype == torch.float32 else 3e-2
            err = (a.float() - b.float()).abs().max().item() if a.numel() else 0.0
            if not (err <= tol * max(1.0, b.float().abs().max().item())):
                failures.append(f"{name} {what}: max error {err:.3e}")
    torch.cuda.synchronize()  # a device-side assert or fault of any call above surfaces here at the latest
    x = torch.arange(10, device="cuda", dtype=torch.float32)
    assert float((x * 2).sum()) == 90.0  # the context still runs work
    assert not failures, failures


@pytest.mark.parametrize("op", ["jfa", "jfa-hstu-cached", "gdpa"])
def test_forward_replays_in_a_cuda_graph(op):
    """Fixed shapes: the forward captured once in a CUDA graph replays on new values in the same buffers and gives
    the eager result (per-batch tables are rebuilt inside the graph, not frozen from a cache)."""
    _need_gpu()
    g = torch.Generator(device="cuda").manual_seed(1)
    lk, lq = [7, 300, 0, 129], [7, 16, 0, 1]
    off_k, off_q = _offsets(lk), _offsets(lq)
    q = torch.randn(sum(lk) if op != "jfa-hstu-cached" else sum(lq), 4, 64, generator=g, device="cuda",
                    dtype=torch.bfloat16)
    k, v = (torch.randn(sum(lk), 2, 64, generator=g, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    hstu = {"causal": True, "num_targets": torch.tensor([1, 5, 0, 2], device="cuda"), "contextual_len": 2}

    def call():
        if op == "jfa":
            return jagged_attention(q, k, v, off_k, max(lk), causal=True, kernel="triton")
        if op == "jfa-hstu-cached":
            return jagged_attention(q, k, v, off_q, max(lq), off_k, max(lk), kernel="triton", **hstu)
        return gdpa(q, k, v, off_k, max(lk), off_k, max(lk), causal=True, activation="silu", kernel="triton")

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(2):  # tune and compile outside the capture
            call()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = call()
    for _ in range(2):
        for x in (q, k, v):
            x.copy_(torch.randn(x.shape, generator=g, device="cuda", dtype=x.dtype))
        graph.replay()
        torch.testing.assert_close(out, call(), atol=0, rtol=0)
