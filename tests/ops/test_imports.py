"""gem.ops imports one way: no module reaches itself through its imports, lazy (function-level) ones included."""

import ast
from pathlib import Path

import gem.ops

OPS = Path(gem.ops.__file__).parent


def _imports(path: Path) -> set[str]:
    """The gem.ops modules a file imports anywhere in it (module names without the package)."""
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module:
            if node.module == "gem.ops":  # from gem.ops import mx, triton_utils as tu
                out |= {a.name for a in node.names if (OPS / f"{a.name}.py").exists()}
            elif node.module.startswith("gem.ops."):
                out.add(node.module.split(".")[2])
        elif isinstance(node, ast.Import):
            out |= {a.name.split(".")[2] for a in node.names if a.name.startswith("gem.ops.")}
    return out


def test_no_import_circle_in_gem_ops():
    graph = {p.stem: _imports(p) - {p.stem} for p in OPS.glob("*.py") if p.stem != "__init__"}
    assert graph["fp8"] and graph["triton_jfa"], "the walk finds the imports it should"
    state: dict[str, int] = {}  # 1 on the current path, 2 done

    def visit(m, path):
        state[m] = 1
        for n in sorted(graph.get(m, ())):
            assert state.get(n) != 1, f"import circle: {' -> '.join(path + [n])}"
            if n not in state:
                visit(n, path + [n])
        state[m] = 2

    for m in sorted(graph):
        if m not in state:
            visit(m, [m])
