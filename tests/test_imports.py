"""gem's import graph, read from the source (AST, every module, imports inside functions included; those under
`if TYPE_CHECKING:` left out): no import circle, and no layer imports a layer above it.

Layers, lowest first: ops -> data -> model -> parallel -> train -> plan -> cli (bench sits at the cli level).
`__main__` modules (`python -m gem.train`) are entry points, at the cli level. Modules directly under gem/ (the
package root, shared config plumbing) belong to no layer; they take part in the
circle check only.
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

GEM = Path(__file__).resolve().parents[1] / "gem"
LAYERS = {"ops": 0, "data": 1, "model": 2, "parallel": 3, "train": 4, "plan": 5, "cli": 6, "bench": 6}


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(GEM.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _imports(tree: ast.AST, module: str, is_package: bool) -> set[tuple[str, str | None]]:
    """What `module` imports, absolute: (name, None) for `import name`; (a, a.b) for `from a import b` (a.b may be
    a module or a name inside a)."""
    out: set[tuple[str, str | None]] = set()
    package = module if is_package else module.rpartition(".")[0]

    def visit(node: ast.AST) -> None:
        if isinstance(node, ast.If) and _is_type_checking(node.test):
            for child in node.orelse:
                visit(child)
            return
        if isinstance(node, ast.Import):
            out.update((a.name, None) for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            out.update((target, f"{target}.{a.name}") for a in node.names)
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(tree)
    return out


def import_graph() -> dict[str, set[str]]:
    """module -> the gem modules it imports. `from pkg import x` is an edge to pkg.x when that is a module, else to
    pkg; a package's __init__ that runs only because a submodule is imported is no edge (Python has the package
    in sys.modules by then, as it does for any parent)."""
    files = {_module_name(p): p for p in GEM.rglob("*.py")}
    graph = {}
    for name, path in files.items():
        deps = set()
        for target, sub in _imports(ast.parse(path.read_text(), str(path)), name, path.name == "__init__.py"):
            deps.add(sub if sub in files else target)
        graph[name] = {d for d in deps if d in files and d != name}
    return graph


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []

    def strong(v: str) -> None:  # recursion depth is bounded by the module count (a few hundred)
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                strong(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            strong(v)
    return sorted(out)


def _layer(module: str) -> str | None:
    parts = module.split(".")
    if parts[-1] == "__main__":  # `python -m gem.<pkg>`: an entry point, an alias of its command
        return "cli"
    return parts[1] if len(parts) > 1 and parts[1] in LAYERS else None


def test_the_walk_sees_every_kind_of_import():
    tree = ast.parse(
        "import gem.ops.jfa\nfrom gem.model import gem as m\nfrom . import flops\nfrom .heads import Head\n"
        "def f():\n    from gem.train.mfu import x\n"
        "if TYPE_CHECKING:\n    from gem.plan import search\nelse:\n    import gem.data\n")
    got = _imports(tree, "gem.model.attention", is_package=False)
    assert got == {("gem.ops.jfa", None), ("gem.model", "gem.model.gem"), ("gem.model", "gem.model.flops"),
                   ("gem.model.heads", "gem.model.heads.Head"), ("gem.train.mfu", "gem.train.mfu.x"),
                   ("gem.data", None)}
    assert _imports(ast.parse("from .dims import X\n"), "gem.parallel", is_package=True) == {
        ("gem.parallel.dims", "gem.parallel.dims.X")}


def test_cycle_finder_on_a_known_graph():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a", "e"}, "e": {"d"}, "f": set()}
    assert _cycles(graph) == [["a", "b", "c"], ["d", "e"]]
    assert _cycles({"a": {"b"}, "b": set()}) == []


def test_no_import_circle_in_gem():
    cycles = _cycles(import_graph())
    assert not cycles, "import circles:\n" + "\n".join(" <-> ".join(c) for c in cycles)


def test_no_layer_imports_a_layer_above_it():
    graph = import_graph()
    assert {_layer(m) for m in graph} - {None} == set(LAYERS), "a layer has no module (or a package is unlisted)"
    unlisted = sorted(m for m in graph if m.count(".") >= 1 and _layer(m) is None and (GEM / m.split(".")[1]).is_dir())
    assert not unlisted, f"packages of gem/ missing from LAYERS: {unlisted}"
    upward = sorted(
        f"{m} ({_layer(m)}) imports {d} ({_layer(d)})"
        for m, deps in graph.items() for d in deps
        if _layer(m) and _layer(d) and LAYERS[_layer(d)] > LAYERS[_layer(m)]
    )
    assert not upward, "upward imports:\n" + "\n".join(upward)


def test_no_module_is_named_after_a_standard_library_module():
    clash = sorted(str(p.relative_to(GEM.parent)) for p in GEM.rglob("*.py")
                   if p.stem in sys.stdlib_module_names and p.stem not in ("__init__", "__main__"))
    assert not clash, f"named as standard-library modules are: {clash}"
