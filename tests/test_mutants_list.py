"""tools/mutants.toml stays runnable: each mutant's snippet occurs exactly once in its file and names existing tests
(the mutants themselves run only through tools/mutants.py, not in the suite)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _tool():
    spec = importlib.util.spec_from_file_location("gem_mutants_tool", ROOT / "tools" / "mutants.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # its dataclasses look their module up
    spec.loader.exec_module(mod)
    return mod


def test_every_mutant_applies_once_and_names_existing_tests():
    tool = _tool()
    mutants = tool.load()
    assert len(mutants) >= 15
    assert tool.problems(mutants) == []


def test_the_check_finds_a_broken_entry(tmp_path):
    tool = _tool()
    (tmp_path / "a.py").write_text("x = 1\nx = 1\n")
    (tmp_path / "test_a.py").write_text("def test_a():\n    pass\n")
    broken = [tool.Mutant("twice", "a.py", "x = 1", "x = 2", ["test_a.py::test_a"]),
              tool.Mutant("gone", "a.py", "y = 1", "y = 2", ["test_a.py::test_b", "test_b.py"])]
    assert tool.problems(broken, tmp_path) == [
        "twice: the old snippet occurs 2 times in a.py (must be once)",
        "gone: the old snippet occurs 0 times in a.py (must be once)",
        "gone: no test test_b in test_a.py",
        "gone: no test file test_b.py",
    ]
