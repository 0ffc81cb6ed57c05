"""The benchmark's compiled competitors: one static graph per case, never symbolic sizes."""

import torch
from torch._dynamo.testing import CompileCounterWithBackend

from gem.bench.kernels import compile_static


def _f(a):
    return (a @ a.T).relu()


def _sizes(counter: CompileCounterWithBackend) -> list[str]:
    """The traced inputs of each graph: a symbolic size shows as a name (s0, ...), a static one as a number."""
    return [str(p.meta["example_value"]) for g in counter.graphs for p in g.graph.nodes if p.op == "placeholder"]


def test_every_case_gets_its_own_static_graph():
    # more cases than Dynamo's recompile limit (8): without the reset, the later cases would run eagerly
    for n in range(2, 14):

        def f(a):  # a new closure per case from one code object, as the bench sections build theirs
            return _f(a)

        counter = CompileCounterWithBackend("eager")
        assert compile_static(f, backend=counter)(torch.randn(n, 8)).shape == (n, n)
        assert counter.frame_count == 1, f"case {n}: {counter.frame_count} compiled frames"
        sizes = _sizes(counter)
        assert len(sizes) == 1 and f"size=({n}, 8)" in sizes[0], sizes


def test_a_second_shape_recompiles_static():
    counter = CompileCounterWithBackend("eager")
    fn = compile_static(_f, backend=counter)
    fn(torch.randn(4, 8))
    fn(torch.randn(6, 8))  # plain torch.compile would trace this one with a symbolic row count
    assert counter.frame_count == 2
    sizes = _sizes(counter)
    assert len(sizes) == 2 and "size=(4, 8)" in sizes[0] and "size=(6, 8)" in sizes[1], sizes
