"""Atomic distributed checkpoints (torch.distributed.checkpoint).

Every rank writes its shards into `<dir>/.tmp-step_N`; after a barrier rank 0 renames it to `<dir>/step_N`, so a
`step_N` directory is always complete (a crash mid-save leaves only a `.tmp-*` directory, removed by the next
save). State values are tensors only (sharded tables as ShardedTensor/DTensor), so loading never unpickles
anything but DCP's own metadata.
"""

from __future__ import annotations

import os
import re
import shutil
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

_STEP_DIR = re.compile(r"^step_(\d+)$")
_TMP_PREFIX = ".tmp-"


def _rank() -> int:
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def _barrier() -> None:
    if dist.is_available() and dist.is_initialized():
        dist.barrier()


def check_tensor_leaves(state: Any, path: str = "") -> None:
    """Raise if a state leaf is not a tensor (DCP would pickle it, and loading would unpickle it)."""
    if isinstance(state, Mapping):
        for k, v in state.items():
            check_tensor_leaves(v, f"{path}.{k}" if path else str(k))
    elif isinstance(state, (list, tuple)):
        for i, v in enumerate(state):
            check_tensor_leaves(v, f"{path}[{i}]")
    elif not isinstance(state, torch.Tensor):  # ShardedTensor / DTensor are tensors too
        from torch.distributed._shard.sharded_tensor import ShardedTensor

        if not isinstance(state, ShardedTensor):
            raise TypeError(f"checkpoint state '{path}' is a {type(state).__name__}, not a tensor")


def list_checkpoints(ckpt_dir: str | os.PathLike) -> list[tuple[int, Path]]:
    """Complete checkpoints in `ckpt_dir` as (step, path), oldest first."""
    root = Path(ckpt_dir)
    if not root.is_dir():
        return []
    found = []
    for p in root.iterdir():
        m = _STEP_DIR.match(p.name)
        if m and p.is_dir() and (p / ".metadata").is_file():
            found.append((int(m.group(1)), p))
    return sorted(found)


def latest_checkpoint(ckpt_dir: str | os.PathLike) -> tuple[int, Path] | None:
    found = list_checkpoints(ckpt_dir)
    return found[-1] if found else None


class Checkpointer:
    """Saves and loads training state under `ckpt_dir` (the same path on every rank); keeps the newest `keep`."""

    def __init__(self, ckpt_dir: str | os.PathLike, keep: int = 2) -> None:
        if keep < 1:
            raise ValueError(f"train.checkpoint.keep must be >= 1, got {keep}")
        self.dir = Path(ckpt_dir)
        self.keep = keep

    def save(self, step: int, state: dict[str, Any]) -> Path:
        check_tensor_leaves(state)
        final = self.dir / f"step_{step}"
        tmp = self.dir / f"{_TMP_PREFIX}step_{step}"
        if _rank() == 0:
            self.dir.mkdir(parents=True, exist_ok=True)
            for p in self.dir.iterdir():  # leftovers of an interrupted save
                if p.name.startswith(_TMP_PREFIX):
                    shutil.rmtree(p, ignore_errors=True)
        _barrier()
        dcp.save(state, checkpoint_id=str(tmp))
        _barrier()
        if _rank() == 0:
            if final.exists():  # a save of the same step (e.g. after a resume): replace it
                shutil.rmtree(final)
            os.replace(tmp, final)
            for _, old in list_checkpoints(self.dir)[: -self.keep]:
                shutil.rmtree(old, ignore_errors=True)
        _barrier()
        return final

    def load(self, path: str | os.PathLike, state: dict[str, Any]) -> None:
        """Load in place into `state` (its tensors / shards give the layout to read into)."""
        check_tensor_leaves(state)
        dcp.load(state, checkpoint_id=str(path))
