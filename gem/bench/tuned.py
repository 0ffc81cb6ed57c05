"""The one writer of the data gem ships from measurements: the tuned kernel configs (gem/ops/tuned/defaults.json),
the attention dispatch table (gem/ops/tuned/dispatch.json) and the reference step of `gem plan`
(gem/plan/reference.json). Every file is written whole to a temporary name and moved into place, so a reader never
sees half of one."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from gem.plan.estimate import REFERENCE_FILE


def write_json(path: str | Path, body: Any) -> Path:
    path = Path(path)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        tmp.write_text(json.dumps(body, indent=1, sort_keys=True) + "\n")
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    return path


def write_reference(step_ms: float, experiment: str, *, device: str, versions: dict[str, str], processes: int,
                    statistic: str, command: str, measured: str, path: str | Path = REFERENCE_FILE) -> Path:
    """The reference step `gem plan` scales compute from: `experiment` as shipped, one GPU."""
    if not step_ms > 0:
        raise ValueError(f"reference step must be > 0 ms, got {step_ms}")
    return write_json(path, {"experiment": experiment, "step_ms": round(float(step_ms), 1), "device": device,
                             "versions": versions, "processes": processes, "statistic": statistic,
                             "command": command, "measured": measured})


def write_dispatch(path: str | Path, env: dict, op: str, won: dict) -> Path:
    """Merge one GPU and software stack's winners of `op` into the dispatch table at `path` (gem.ops.dispatch's
    format); refuses a file that is not a dispatch table."""
    from gem.ops import dispatch

    path = Path(path)
    body = json.loads(path.read_text()) if path.exists() else None
    if body is not None:
        dispatch.parse(body, str(path))
    return write_json(path, dispatch.merged(body, env, op, won))


def ship_tuned(cache_dir: str | Path, out: str | Path | None = None) -> tuple[int, int]:
    """Fold tuning-cache files (GEM_TUNE_CACHE=DIR after a run) into the shipped defaults (gem/ops/tuned/
    defaults.json): an entry replaces the shipped one with the same op and environment, the others are kept.
    Returns (files read, entries written); ValueError naming a file that is not a tuning file."""
    from gem.ops._tune import FORMAT, SHIPPED, _valid

    out = Path(out or SHIPPED)
    files = sorted(Path(cache_dir).rglob("*.json"))
    if not files:
        raise ValueError(f"{cache_dir}: no tuning files")
    shipped = json.loads(out.read_text()) if out.exists() else {"format": FORMAT, "entries": []}
    entries = {(json.dumps(e["env"], sort_keys=True), e["op"]): e for e in shipped["entries"]}
    for f in files:
        body = json.loads(f.read_text())
        if not (_valid(body) and body.get("format") == FORMAT):
            raise ValueError(f"{f}: not a tuning file of format {FORMAT}")
        entries[(json.dumps(body["env"], sort_keys=True), body["op"])] = {
            "env": body["env"], "op": body["op"], "configs": body["configs"]}
    write_json(out, {"format": FORMAT, "entries": [entries[k] for k in sorted(entries)]})
    return len(files), len(entries)


def save_reference(path: str | Path, step_ms: float, conf: dict, processes: int, statistic: str,
                   argv: list[str]) -> Path:
    """gem plan's reference step from a training benchmark run (`conf`: the run's "config" block of its --json
    result; its one override is experiment=NAME, as the options require)."""
    import datetime
    import shlex

    out = write_reference(step_ms, conf["overrides"][0].split("=", 1)[1], device=conf["device"],
                          versions={k: conf[k] for k in ("torch", "triton") if k in conf}, processes=processes,
                          statistic=statistic, command=shlex.join(["python", "scripts/bench_train.py", *argv]),
                          measured=datetime.date.today().isoformat(), path=path)
    print(f"reference step {step_ms:.1f} ms written to {out}", flush=True)
    return out
