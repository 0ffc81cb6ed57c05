"""Helpers for benchmarks that re-run themselves in fresh child processes."""

from __future__ import annotations


def strip_options(argv: list[str], options: tuple[str, ...]) -> list[str]:
    """argv without `options` and their values (also as --opt=value or an abbreviation argparse accepted: the
    parse already rejected ambiguous ones): what a parent passes on to its children."""
    out, i = [], 0
    while i < len(argv):
        name = argv[i].split("=", 1)[0]
        if name.startswith("--") and len(name) > 2 and any(o.startswith(name) for o in options):
            i += 1 if "=" in argv[i] else 2
            continue
        out.append(argv[i])
        i += 1
    return out


def stderr_tail(text: str, chars: int = 300) -> str:
    """The last lines of a failed child's stderr, on one line."""
    lines = [ln.strip() for ln in text.strip().splitlines() if ln.strip()]
    return " / ".join(lines[-3:])[-chars:] or "no stderr"
