"""Mutation check: does the test suite catch small deliberate bugs?

    python tools/mutants.py                    # every mutant of tools/mutants.toml
    python tools/mutants.py -k plan            # those whose name contains "plan"
    python tools/mutants.py --check            # only check the list (snippets occur once, tests exist)

Each mutant replaces one exact snippet of one file (`old` -> `new`) in a temporary copy of the working tree (the
files git tracks plus untracked, unignored ones), runs the mutant's tests there (`pytest -x`) and reports whether
they caught it (some test failed) or it survived (all passed). Exit status 1 if any mutant survived or the list is
broken. The list: tools/mutants.toml.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import tomllib

ROOT = Path(__file__).resolve().parents[1]
LIST = ROOT / "tools" / "mutants.toml"


@dataclass
class Mutant:
    name: str
    file: str
    old: str
    new: str
    tests: list[str]


def load(path: Path = LIST) -> list[Mutant]:
    with open(path, "rb") as f:
        entries = tomllib.load(f)["mutant"]
    return [Mutant(e["name"], e["file"], e["old"], e["new"], list(e["tests"])) for e in entries]


def problems(mutants: list[Mutant], root: Path = ROOT) -> list[str]:
    """What is wrong with the list: a snippet that is not exactly once in its file, a test that does not exist."""
    out = []
    names = [m.name for m in mutants]
    for n in {n for n in names if names.count(n) > 1}:
        out.append(f"{n}: duplicate name")
    for m in mutants:
        path = root / m.file
        if not path.is_file():
            out.append(f"{m.name}: no file {m.file}")
            continue
        count = path.read_text().count(m.old)
        if count != 1:
            out.append(f"{m.name}: the old snippet occurs {count} times in {m.file} (must be once)")
        if m.old == m.new:
            out.append(f"{m.name}: new is the same as old")
        if not m.tests:
            out.append(f"{m.name}: no tests named")
        for node in m.tests:
            file, _, test = node.partition("::")
            tpath = root / file
            if not tpath.is_file():
                out.append(f"{m.name}: no test file {file}")
            elif test and not re.search(rf"^def {re.escape(test.split('[')[0])}\(", tpath.read_text(), re.MULTILINE):
                out.append(f"{m.name}: no test {test} in {file}")
    return out


def _tree_files(root: Path) -> list[str]:
    out = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=root,
                         capture_output=True, text=True, check=True).stdout
    return [p for p in out.split("\0") if p and (root / p).is_file()]


def copy_tree(root: Path, dest: Path) -> None:
    for rel in _tree_files(root):
        target = dest / rel
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(root / rel, target)


def run_mutant(m: Mutant, tree: Path, timeout: float) -> tuple[str, str, float]:
    """(caught | survived | error, the failing tests or why, seconds) for one mutant applied in `tree`."""
    path = tree / m.file
    original = path.read_text()
    path.write_text(original.replace(m.old, m.new, 1))
    env = dict(os.environ, PYTHONPATH=str(tree), TRITON_INTERPRET=os.environ.get("TRITON_INTERPRET", "1"),
               OMP_NUM_THREADS="1", GLOO_SOCKET_IFNAME=os.environ.get("GLOO_SOCKET_IFNAME", "lo"))
    env.pop("PYTEST_ADDOPTS", None)
    t0 = time.perf_counter()
    try:
        r = subprocess.run([sys.executable, "-m", "pytest", "-x", "-q", "-p", "no:cacheprovider", "-rf",
                            "-m", "not gpu", *m.tests],  # either tier: a named test runs
                           cwd=tree, env=env, capture_output=True, text=True, timeout=timeout, check=False)
    except subprocess.TimeoutExpired:
        return "error", f"timed out after {timeout:.0f} s", time.perf_counter() - t0
    finally:
        path.write_text(original)
    dt = time.perf_counter() - t0
    if r.returncode == 0:
        return "survived", "all passed", dt
    failed = [line.split(" ", 2)[1] for line in r.stdout.splitlines() if line.startswith(("FAILED ", "ERROR "))]
    if r.returncode == 1 and failed:
        return "caught", ", ".join(failed), dt
    return "error", f"pytest exit {r.returncode}: {(r.stdout + r.stderr).strip().splitlines()[-1:]}", dt


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("-k", default="", help="only mutants whose name contains this text")
    ap.add_argument("--check", action="store_true", help="only check the list")
    ap.add_argument("--timeout", type=float, default=900, help="seconds per mutant's test run")
    a = ap.parse_args(argv)
    mutants = load()
    bad = problems(mutants)
    for p in bad:
        print(f"mutants.toml: {p}", file=sys.stderr)
    if bad or a.check:
        if not bad:
            print(f"mutants.toml: {len(mutants)} mutants, every snippet once, every test present")
        return 1 if bad else 0
    chosen = [m for m in mutants if a.k.lower() in m.name.lower()]
    survived = 0
    with tempfile.TemporaryDirectory(prefix="gem-mutants-") as tmp:
        tree = Path(tmp)
        copy_tree(ROOT, tree)
        for m in chosen:
            status, detail, dt = run_mutant(m, tree, a.timeout)
            survived += status != "caught"
            print(f"{status:8s} {dt:6.0f} s  {m.name}  [{m.file}]  {detail}", flush=True)
    print(f"{len(chosen) - survived} of {len(chosen)} mutants caught")
    return 1 if survived else 0


if __name__ == "__main__":
    sys.exit(main())
