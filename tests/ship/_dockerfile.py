"""A small Dockerfile reader for the image tests (no container engine runs in CI): instructions with their line
numbers, continuation lines joined, comments dropped; and the `pip install` commands of the RUN steps."""

from __future__ import annotations

import json
import re
import shlex
from dataclasses import dataclass
from pathlib import Path

INSTRUCTIONS = {
    "FROM", "RUN", "CMD", "LABEL", "EXPOSE", "ENV", "ADD", "COPY", "ENTRYPOINT", "VOLUME", "USER", "WORKDIR",
    "ARG", "ONBUILD", "STOPSIGNAL", "HEALTHCHECK", "SHELL",
}
JSON_FORM = {"CMD", "ENTRYPOINT", "SHELL"}  # SHELL takes only the JSON form


@dataclass(frozen=True)
class Instruction:
    line: int
    keyword: str
    args: str


def parse(path: Path) -> list[Instruction]:
    """The instructions of a Dockerfile; ValueError naming `file:line` for anything Docker would reject."""
    out: list[Instruction] = []
    pending, start = "", 0
    lines = path.read_text().splitlines()
    for n, raw in enumerate(lines, 1):
        text = raw.strip()
        if not text or text.startswith("#"):  # comments may sit between continuation lines too
            continue
        if not pending:
            start = n
        if text.endswith("\\"):
            pending += text[:-1].rstrip() + " "
            continue
        out.append(_instruction(path, start, pending + text))
        pending = ""
    if pending:
        raise ValueError(f"{path}:{start}: the file ends inside a continued line")
    if not out:
        raise ValueError(f"{path}: no instructions")
    first = next((i for i in out if i.keyword != "ARG"), None)
    if first is None or first.keyword != "FROM":
        where = first.line if first else out[0].line
        raise ValueError(f"{path}:{where}: the first instruction (after ARGs) must be FROM")
    return out


def _instruction(path: Path, line: int, text: str) -> Instruction:
    keyword, _, args = text.partition(" ")
    keyword, args = keyword.upper(), args.strip()
    if keyword not in INSTRUCTIONS:
        raise ValueError(f"{path}:{line}: unknown instruction '{keyword}'")
    if not args:
        raise ValueError(f"{path}:{line}: {keyword} needs arguments")
    if keyword in JSON_FORM and (args.startswith("[") or keyword == "SHELL"):
        try:
            form = json.loads(args)
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}:{line}: {keyword}: not a JSON array of strings ({e.msg})") from None
        if not isinstance(form, list) or not form or not all(isinstance(a, str) for a in form):
            raise ValueError(f"{path}:{line}: {keyword}: not a JSON array of strings")
    if keyword in ("COPY", "ADD") and len([a for a in shlex.split(args) if not a.startswith("--")]) < 2:
        raise ValueError(f"{path}:{line}: {keyword} needs a source and a destination")
    return Instruction(line, keyword, args)


def pip_installs(commands: list[str]) -> list[list[str]]:
    """The argument lists of every `pip install` in these shell commands (split at &&, || and ;)."""
    out = []
    for command in commands:
        words: list[str] = []
        for word in shlex.split(command.replace(";", " ; "), comments=True) + [";"]:
            if word in ("&&", "||", ";"):
                if any(Path(w).name.lower().rstrip("3").endswith("pip") for w in words[:3]) and "install" in words:
                    out.append(words[words.index("install") + 1:])
                words = []
            elif not re.match(r"\d*[<>]", word):  # redirections are not arguments
                words.append(word)
    return out
