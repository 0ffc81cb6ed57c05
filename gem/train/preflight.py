"""Checks before the first step (`gem-train --check`, and at start-up on rank 0): what would otherwise fail minutes
into a job. Each failure raises one UserError naming the key or path."""

from __future__ import annotations

import os
from typing import Any

from gem.train.rundir import check_writable


def checkpoint_dir(cfgs: Any, run_dir: str | None) -> str | None:
    """`train.checkpoint.dir`, else `<run dir>/checkpoints` (None: no run dir to default to)."""
    d = cfgs.train.checkpoint.dir
    return d if d else (os.path.join(run_dir, "checkpoints") if run_dir else None)


def check_data(cfgs: Any) -> None:
    """`data.paths` / `data.eval_paths` each name at least one readable file whose columns and types are those the
    schema declares (the Parquet reader's own up-front checks)."""
    data = cfgs.data
    if data.source == "synthetic":
        return
    from gem.data import build_dataset
    from gem.data.parquet import check_files

    check_files(data)  # every file's metadata, eval files included

    for split in ("train", "eval"):
        if split == "eval" and data.eval_batches == 0:
            continue
        build_dataset(data, 0, 1, split=split)  # resolves the globs, opens every file, checks its columns


def check_resume(cfgs: Any, ckpt_dir: str | None) -> None:
    """The checkpoint a run would resume from was saved by a model of this shape (the config values that decide
    the state's tensors, compared without loading anything)."""
    from gem.train.checkpoint import FREE_KEYS, latest_checkpoint, mismatch_error, no_checkpoint_error, run_config

    resume = cfgs.train.resume
    if resume is False or ckpt_dir is None:
        return
    found = latest_checkpoint(ckpt_dir)
    if found is None:
        if resume is True:
            raise no_checkpoint_error(ckpt_dir)
        return
    from gem.train.checkpoint import config_diff, read_config

    now = run_config(cfgs)
    if [d for d in config_diff(read_config(found[1]), now) if not d.startswith(FREE_KEYS)]:
        raise mismatch_error(found[1], now, FREE_KEYS, "does not fit this model")


def preflight(cfgs: Any, run_dir: str | None) -> None:
    """Every check above; `run_dir` None: the run dir is chosen at launch (a new one: nothing to resume)."""
    check_data(cfgs)
    if run_dir is not None:
        check_writable(run_dir, "hydra.run.dir")
    ckpt = checkpoint_dir(cfgs, run_dir)
    if ckpt is not None and (cfgs.train.checkpoint.every > 0 or cfgs.train.resume is not False):
        key = "train.checkpoint.dir" if cfgs.train.checkpoint.dir else "hydra.run.dir"
        check_writable(ckpt, key)
    check_resume(cfgs, ckpt)
