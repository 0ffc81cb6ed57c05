"""The images' Dockerfiles: valid, FROM first, and pinned by requirements/ (the files scripts/_env.sh installs for
the tests) rather than by versions of their own. No container engine runs here; hadolint lints where installed."""

from __future__ import annotations

import re
import shutil
import subprocess
from importlib import metadata
from pathlib import Path

import pytest
import torch

from tests.ship._dockerfile import parse, pip_installs

ROOT = Path(__file__).resolve().parents[2]
REQ = ROOT / "requirements"
# image -> (requirements resolved normally, requirements installed with --no-deps)
IMAGES = {
    "Dockerfile": ({"gpu.txt"}, {"gpu-no-deps.txt"}),
    "Dockerfile.cpu": ({"cpu.txt", "dev.txt"}, {"cpu-no-deps.txt"}),
}


def pins(name: str) -> dict[str, str]:
    """package -> version for every `name==version` line of a requirements file."""
    out = {}
    for line in (REQ / name).read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if "==" in line:
            pkg, ver = line.split("==")
            out[pkg.strip().lower()] = ver.strip()
        elif line:
            assert re.fullmatch(r"[A-Za-z0-9._-]+", line), f"{name}: '{line}' is neither a pin nor a bare name"
    return out


def stack(kind: str) -> dict[str, str]:
    return {**pins(f"{kind}.txt"), **pins(f"{kind}-no-deps.txt")}


def installs(commands: list[str]) -> tuple[set[str], set[str]]:
    """(requirements files installed normally, those installed with --no-deps) by these shell commands; no other
    package may be named with a version, so that the pins have one home."""
    normal, no_deps = set(), set()
    for args in pip_installs(commands):
        files = {Path(args[i + 1]).name for i, a in enumerate(args) if a == "-r"}
        named = [a for i, a in enumerate(args) if not a.startswith("-") and (i == 0 or args[i - 1] != "-r")
                 and not a.startswith("$") and a not in (".", "pip")]
        assert not named and not any("==" in a for a in args), f"pip install names packages itself: {args}"
        (no_deps if "--no-deps" in args else normal).update(files)
    return normal, no_deps


@pytest.mark.parametrize("name", sorted(IMAGES))
def test_dockerfile_is_valid_and_pinned_by_requirements(name):
    path = ROOT / "docker" / name
    steps = parse(path)
    runs = [s.args for s in steps if s.keyword == "RUN"]
    assert installs(runs) == IMAGES[name]
    for s in steps:
        if s.keyword == "COPY":
            for src in [a for a in s.args.split() if not a.startswith("--")][:-1]:
                assert (ROOT / src).exists(), f"{name}:{s.line}: COPY source {src} is not in the checkout"
    # The package is installed from the copied source, after the stack, without re-resolving anything.
    assert any(args[-1:] == ["."] and "--no-deps" in args for args in pip_installs(runs))
    base = next(s.args for s in steps if s.keyword == "FROM")
    if name == "Dockerfile":
        assert re.fullmatch(r"nvidia/cuda:13\.\d+\.\d+-(cudnn-)?runtime-ubuntu\d\d\.04", base), base
    else:
        assert re.fullmatch(r"python:3\.1[0-3][-.\w]*", base), base


def test_env_script_installs_the_cpu_image_requirements():
    """scripts/_env.sh (the tests' environment) and docker/Dockerfile.cpu install the same files the same way."""
    text = (ROOT / "scripts/_env.sh").read_text().replace('"$REQ/', '"requirements/')
    assert installs(text.splitlines()) == IMAGES["Dockerfile.cpu"]


def test_stacks_are_matched_triples():
    gpu, cpu = stack("gpu"), stack("cpu")
    assert (gpu["torch"], gpu["fbgemm-gpu"], gpu["torchrec"]) == ("2.11.0", "1.6.0", "1.6.1")
    assert (cpu["torch"], cpu["fbgemm-gpu-cpu"], cpu["torchrec"]) == ("2.13.0", "1.8.0", "1.8.0")
    for torch_v, fbgemm_v in ((gpu["torch"], gpu["fbgemm-gpu"]), (cpu["torch"], cpu["fbgemm-gpu-cpu"])):
        # fbgemm-gpu 1.x is built for torch 2.(x + 5): a mismatch fails at import with an undefined symbol
        assert int(torch_v.split(".")[1]) == int(fbgemm_v.split(".")[1]) + 5, (torch_v, fbgemm_v)
    assert gpu["torchrec"].split(".")[:2] == gpu["fbgemm-gpu"].split(".")[:2]
    assert cpu["torchrec"].split(".")[:2] == cpu["fbgemm-gpu-cpu"].split(".")[:2]


def test_tests_run_with_the_pinned_stack():
    """The installed stack is the one requirements/ pins: the CPU stack here, the GPU one on a CUDA build."""
    kind = "gpu" if torch.version.cuda else "cpu"
    want = stack(kind)
    have = {pkg: metadata.version(pkg).split("+")[0] for pkg in want}
    assert have == want


@pytest.mark.skipif(shutil.which("hadolint") is None, reason="hadolint is not installed (requirements/dev.txt)")
def test_hadolint():
    p = subprocess.run(["hadolint", *(str(ROOT / "docker" / n) for n in sorted(IMAGES))],
                       capture_output=True, text=True, timeout=60, check=False)
    assert p.returncode == 0, p.stdout + p.stderr


@pytest.mark.parametrize(
    "text, problem",
    [
        ("RUN echo hi\nFROM x\n", ":1: the first instruction (after ARGs) must be FROM"),
        ("ARG V=1\nFROM x:$V\nRUNN echo\n", ":3: unknown instruction 'RUNN'"),
        ("FROM x\nCMD [\"a\", 1]\n", ":2: CMD: not a JSON array of strings"),
        ("FROM x\nRUN a \\\n  && b \\\n", ":2: the file ends inside a continued line"),
        ("FROM x\nCOPY \\\n  # only a comment\n  src\n", ":2: COPY needs a source and a destination"),
    ],
)
def test_parser_names_the_bad_line(tmp_path, text, problem):
    path = tmp_path / "Dockerfile"
    path.write_text(text)
    with pytest.raises(ValueError) as e:
        parse(path)
    assert str(e.value) == f"{path}{problem}"


def test_parser_joins_continuations_and_finds_pip_installs(tmp_path):
    path = tmp_path / "Dockerfile"
    path.write_text("# c\nARG A=1\nFROM base\nRUN apt-get update \\\n  # note\n  && python3 -m pip install -r r.txt"
                    " \\\n  && pip install --no-deps torchrec==1.0; echo done\n")
    steps = parse(path)
    assert [(s.line, s.keyword) for s in steps] == [(2, "ARG"), (3, "FROM"), (4, "RUN")]
    assert pip_installs([steps[2].args]) == [["-r", "r.txt"], ["--no-deps", "torchrec==1.0"]]
    with pytest.raises(AssertionError, match="names packages itself"):
        installs([steps[2].args])
