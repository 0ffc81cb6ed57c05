"""The benchmark's compiled competitors: one static graph per case, never symbolic sizes."""

import torch
from torch._dynamo.testing import CompileCounterWithBackend

from scripts.bench.common import compile_static


def _case(n: int) -> CompileCounterWithBackend:
    """A competitor built per case from the same nested function, as the bench sections build theirs."""

    def f(a):
        return (a @ a.T).relu()

    counter = CompileCounterWithBackend("eager")
    out = compile_static(f, backend=counter)(torch.randn(n, 8))
    assert out.shape == (n, n)
    return counter


def _sizes(counter: CompileCounterWithBackend) -> list:
    return [tuple(p.meta["example_value"].shape) for g in counter.graphs for p in g.graph.nodes if p.op == "placeholder"]


def test_every_case_compiles_static_shapes():
    for n in (4, 6, 9):  # plain torch.compile gives the second and third cases a symbolic row count
        counter = _case(n)
        assert counter.frame_count == 1
        assert _sizes(counter) == [(n, 8)]
