"""Atomic distributed checkpoints (torch.distributed.checkpoint), read as untrusted input, and what a run's
checkpoint holds (model, optimizer, progress, data position, per-rank RNG): `Checkpointer` writes and reads the files,
`TrainCheckpointer` saves and resumes one rank's training state through it.

Every rank writes its shards into `<dir>/.tmp-step_N`; after a barrier rank 0 writes the run's config beside them
(`gem_config.json`) and renames the directory to `<dir>/step_N`, so a `step_N` directory is always complete (a crash
mid-save leaves only a `.tmp-*` directory, removed by the next save).

A checkpoint directory may come from anyone: state values are tensors only (DCP reads them with torch's
weights-only loader), and DCP's `.metadata` pickle is read by an unpickler that builds only the classes DCP writes
(`SafeFileSystemReader`); anything else is refused with one line before it is built. Before loading, the
checkpoint's tensors are matched against the model's, and a mismatch names the config values that differ.
"""

from __future__ import annotations

import dataclasses
import io
import json
import os
import pickle
import re
import shutil
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint import metadata as dcp_md
from torch.distributed.checkpoint.api import CheckpointException

from gem.config import UserError, show

_STEP_DIR = re.compile(r"^step_(\d+)$")
_TMP_PREFIX = ".tmp-"
CONFIG_FILE = "gem_config.json"


class CheckpointError(UserError):
    """A checkpoint that cannot be used: unsafe or unreadable metadata, or state that does not fit this run."""


def _rank() -> int:
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def _barrier() -> None:
    if dist.is_available() and dist.is_initialized():
        dist.barrier()


# ---- reading DCP metadata without running code -------------------------------------------------------------------

# What DCP's FileSystemWriter pickles into `.metadata` (torch 2.11 .. 2.13): its own dataclasses, torch.Size, dtypes
# and layouts, the checkpoint id (a path).
_ALLOWED = {
    "torch.distributed.checkpoint.metadata": {
        "Metadata",
        "MetadataIndex",
        "ChunkStorageMetadata",
        "TensorProperties",
        "TensorStorageMetadata",
        "BytesStorageMetadata",
        "StorageMeta",
        "_MEM_FORMAT_ENCODING",
    },
    "torch.distributed.checkpoint.filesystem": {"_StorageInfo"},
    "torch.serialization": {"_get_layout"},
    "torch": {"Size"},
    "pathlib": {"Path", "PosixPath", "WindowsPath", "PurePath", "PurePosixPath", "PureWindowsPath"},
    "collections": {"OrderedDict"},
}


class _MetadataUnpickler(pickle.Unpickler):
    def __init__(self, file, where: str) -> None:
        super().__init__(file)
        self.where = where

    def find_class(self, module: str, name: str) -> Any:
        if name in _ALLOWED.get(module, ()):
            return super().find_class(module, name)
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        raise CheckpointError(self.where, "not a DCP checkpoint's metadata: it names a disallowed object",
                              f"{module}.{name}")


def load_metadata(path: str | os.PathLike, data: bytes | None = None) -> dcp_md.Metadata:
    """DCP metadata of the checkpoint `path` (a directory), unpickled with the allow-list above and checked: tensor
    entries only (a bytes entry would be read with the unrestricted torch.load), storage files inside the
    directory."""
    where = str(Path(path) / ".metadata")
    try:
        if data is None:
            data = (Path(path) / ".metadata").read_bytes()
        md = _MetadataUnpickler(io.BytesIO(data), where).load()
    except CheckpointError:
        raise
    except Exception as e:  # noqa: BLE001 - truncated or foreign files fail in many ways
        raise CheckpointError(where, "unreadable DCP metadata", f"{type(e).__name__}: {e}") from None
    if not isinstance(md, dcp_md.Metadata) or not isinstance(md.state_dict_metadata, dict):
        raise CheckpointError(where, "not a DCP checkpoint's metadata", type(md).__name__)
    for fqn, entry in md.state_dict_metadata.items():
        if not isinstance(entry, dcp_md.TensorStorageMetadata):
            raise CheckpointError(where, f"entry '{fqn}' is not a tensor", type(entry).__name__)
    for info in (md.storage_data or {}).values():
        rel = getattr(info, "relative_path", None)
        if not isinstance(rel, str) or not rel or rel != os.path.basename(rel) or rel in (".", ".."):
            raise CheckpointError(where, "a storage file outside the checkpoint directory", rel)
    return md


class SafeFileSystemReader(FileSystemReader):
    """DCP's FileSystemReader with `read_metadata` through `load_metadata` (no arbitrary unpickling)."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> dcp_md.Metadata:
        rank = kwargs.get("rank")
        if rank is not None and hasattr(self, "_get_metadata_path"):
            with self.fs.create_stream(self._get_metadata_path(rank), "rb") as f:
                md = load_metadata(self.path, f.read())
        else:
            md = load_metadata(self.path)
        if getattr(md, "storage_meta", None) is None:
            md.storage_meta = dcp_md.StorageMeta()
        md.storage_meta.load_id = getattr(self, "load_id", None)
        return md


# ---- state and config checks --------------------------------------------------------------------------------------


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


def flat_config(obj: Any, prefix: str = "") -> dict[str, Any]:
    """Dotted key -> JSON value of a (nested) dataclass or mapping, e.g. {'model.tower.num_blocks': 2}."""
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        obj = {f.name: getattr(obj, f.name) for f in dataclasses.fields(obj)}
    if isinstance(obj, Mapping):
        out: dict[str, Any] = {}
        for k, v in obj.items():
            out.update(flat_config(v, f"{prefix}.{k}" if prefix else str(k)))
        return out
    if isinstance(obj, (list, tuple)) and any(dataclasses.is_dataclass(v) or isinstance(v, Mapping) for v in obj):
        out = {}
        for i, v in enumerate(obj):
            out.update(flat_config(v, f"{prefix}[{i}]"))
        return out
    return {prefix: list(obj) if isinstance(obj, tuple) else obj}


def read_config(path: str | os.PathLike) -> dict[str, Any] | None:
    """The flat config saved beside a checkpoint (None: an older checkpoint without one)."""
    p = Path(path) / CONFIG_FILE
    if not p.is_file():
        return None
    try:
        data = json.loads(p.read_text())
    except (OSError, ValueError) as e:
        raise CheckpointError(str(p), "unreadable", e) from None
    if not isinstance(data, dict):
        raise CheckpointError(str(p), "expected a JSON object", type(data).__name__)
    return data


# Config values a checkpoint may be resumed under freely: DCP reshards across world sizes and degrees, and the kernel
# choice does not change the state.
FREE_KEYS = (
    "parallel.dp_replicate",
    "parallel.dp_shard",
    "parallel.emb_shard_group",
    "parallel.emb_sync_every",
    "parallel.emb_group_layout",
    "parallel.sharding_types",
    "parallel.reshard_after_forward",
    "model.kernel",
)


def run_config(cfgs: Any) -> dict[str, Any]:
    """The config values saved beside a run's checkpoints: the model and parallel groups and the sparse optimizer
    (they decide which tensors the state holds and their shapes)."""
    out = flat_config({"model": cfgs.model, "parallel": cfgs.parallel})
    out.update(flat_config({"train": {"sparse_optimizer": cfgs.train.sparse_optimizer}}))
    return out


def config_diff(saved: Mapping[str, Any] | None, now: Mapping[str, Any]) -> list[str]:
    """`key=<checkpoint's> (got <now>)` for every key whose value differs (keys absent on one side included)."""
    if not saved:
        return []
    out = []
    for k in sorted(set(saved) | set(now)):
        a, b = saved.get(k, "<unset>"), now.get(k, "<unset>")
        if json.dumps(a, sort_keys=True) != json.dumps(b, sort_keys=True):
            out.append(f"{k}={show(a)} (got {show(b)})")
    return out


def _global_shape(t: Any) -> tuple[int, ...] | None:
    if isinstance(t, torch.Tensor):
        return tuple(t.shape)  # a DTensor's shape is the global one
    size = getattr(t, "size", None)  # ShardedTensor
    return tuple(size()) if callable(size) else None


def check_fits(path: str | os.PathLike, md: dcp_md.Metadata, tensors: Mapping[str, Any],
               config: Mapping[str, Any] | None, ignore: tuple[str, ...] = ()) -> None:
    """Raise one CheckpointError if a tensor in `tensors` (flat DCP keys -> tensors) is missing from the checkpoint
    or has another global shape there, naming the config values that differ from the checkpoint's (`ignore`:
    config keys that may change freely, e.g. parallel degrees: DCP reshards)."""
    problem = None
    for key, t in tensors.items():
        entry = md.state_dict_metadata.get(key)
        if entry is None:
            problem = f"'{key}' is not in the checkpoint"
            break
        shape = _global_shape(t)
        if shape is not None and tuple(entry.size) != shape:
            problem = f"'{key}' has shape {list(entry.size)} in the checkpoint, {list(shape)} here"
            break
    if problem is not None:
        raise mismatch_error(path, config, ignore, f"does not fit this model: {problem}")


def mismatch_error(path: str | os.PathLike, config: Mapping[str, Any] | None, ignore: tuple[str, ...],
                   fallback: str) -> CheckpointError:
    """The config values that differ from the checkpoint's, in one line; `fallback` when none is known to differ."""
    diff = [d for d in config_diff(read_config(path), config) if not d.startswith(ignore)] if config else []
    if diff:
        return CheckpointError(str(path), "saved with other config values: " + ", ".join(diff))
    return CheckpointError(str(path), fallback)


# ---- the checkpointer ---------------------------------------------------------------------------------------------


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


def no_checkpoint_error(ckpt_dir: str | os.PathLike) -> CheckpointError:
    """`train.resume=true` where there is nothing to resume (a typo in the run dir must not restart training)."""
    return CheckpointError(
        "train.resume", f"no complete checkpoint in {ckpt_dir} (use train.resume=auto to start fresh there)", True
    )


class Checkpointer:
    """Saves and loads training state under `ckpt_dir` (the same path on every rank); keeps the newest `keep`.

    `config`: flat config values saved beside each checkpoint and compared on load (see `check_fits`)."""

    def __init__(self, ckpt_dir: str | os.PathLike, keep: int = 2, config: Mapping[str, Any] | None = None,
                 ignore: tuple[str, ...] = FREE_KEYS) -> None:
        if keep < 1:
            raise ValueError(f"train.checkpoint.keep must be >= 1, got {keep}")
        self.dir = Path(ckpt_dir)
        self.keep = keep
        self.config = dict(config) if config is not None else None
        self.ignore = ignore

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
            if self.config is not None:
                (tmp / CONFIG_FILE).write_text(json.dumps(self.config, indent=1, sort_keys=True) + "\n")
            if final.exists():  # a save of the same step (e.g. after a resume): replace it
                shutil.rmtree(final)
            os.replace(tmp, final)
            for _, old in list_checkpoints(self.dir)[: -self.keep]:
                shutil.rmtree(old, ignore_errors=True)
        _barrier()
        return final

    def load(self, path: str | os.PathLike, state: dict[str, Any]) -> None:
        """Load in place into `state` (its tensors / shards give the layout to read into); the metadata is read
        safely and the state's model tensors are matched against the checkpoint first."""
        check_tensor_leaves(state)
        md = load_metadata(path)
        model = state.get("model")
        if isinstance(model, Mapping):
            check_fits(path, md, {f"model.{k}": v for k, v in model.items()}, self.config, self.ignore)
        try:
            dcp.load(state, storage_reader=SafeFileSystemReader(str(path)))
        except CheckpointException as e:  # a BaseException carrying each rank's error and trace
            first = next((exc for exc, _ in e.failures.values() if isinstance(exc, BaseException)), None)
            if isinstance(first, CheckpointError):
                raise first from None
            text = str(first).strip().splitlines()[0] if first is not None and str(first).strip() else repr(e)
            raise mismatch_error(path, self.config, self.ignore, f"cannot load it ({text})") from None


# ---- a run's training state ------------------------------------------------------------------------------------


def restart_count() -> int:
    """How many times torchrun has restarted this job's workers (0: the first attempt, or not under torchrun)."""
    return int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") or 0)


class TrainCheckpointer:
    """Saves and resumes one rank's training state. `info`: rank 0's log line writer."""

    def __init__(
        self,
        checkpointer: Checkpointer,
        par,
        optimizer,
        *,
        rank: int,
        world_size: int,
        device: torch.device,
        info: Callable[[str], None],
    ) -> None:
        self.checkpointer, self.par, self.optimizer = checkpointer, par, optimizer
        self.rank, self.world_size, self.device, self.info = rank, world_size, device, info

    def state(self, step: int, data_state: Mapping[str, int]) -> dict[str, Any]:
        rng = {"torch": torch.get_rng_state()}
        if self.device.type == "cuda":
            rng["cuda"] = torch.cuda.get_rng_state(self.device)
        return {
            "model": self.par.model.state_dict(),
            "optim": self.optimizer.state_dict(),
            "progress": {
                "step": torch.tensor(step, dtype=torch.int64),
                "world_size": torch.tensor(self.world_size),
            },
            "data": {k: torch.tensor(int(v), dtype=torch.int64) for k, v in data_state.items()},
            f"rng_rank{self.rank}": rng,
        }

    def save(self, step: int, data_state: Mapping[str, int]) -> str:
        if self.par.embeddings is not None and self.par.embeddings.n_replicas > 1:
            self.par.sync_embeddings()  # every replica holds the same tables in the checkpoint
        path = self.checkpointer.save(step, self.state(step, data_state))
        self.info(f"checkpoint: {path}")
        return str(path)

    def resume(self, train_data, report_none: bool = True, require: bool = False) -> int | None:
        """Load the newest complete checkpoint (the same on every rank) into the model, optimizer, RNG and
        `train_data`'s position; returns its step, or None when there is none (an error when `require`)."""
        found = latest_checkpoint(self.checkpointer.dir)
        steps = [found[0] if found else -1]
        if self.world_size > 1:  # every rank must pick the same checkpoint
            dist.broadcast_object_list(steps, src=0)
        if steps[0] < 0:
            if require:
                raise no_checkpoint_error(self.checkpointer.dir)
            if report_none:
                self.info(f"resume: no checkpoint in {self.checkpointer.dir}, starting from step 0")
            return None
        path = self.checkpointer.dir / f"step_{steps[0]}"
        self.optimizer.init_state()
        meta = {"progress": {"step": torch.tensor(0, dtype=torch.int64), "world_size": torch.tensor(0)}}
        self.checkpointer.load(path, meta)
        same_world = int(meta["progress"]["world_size"]) == self.world_size
        state = self.state(0, train_data.state_dict())
        if not same_world:  # per-rank RNG streams only carry over to the same world size
            state.pop(f"rng_rank{self.rank}")
        self.checkpointer.load(path, state)
        self.par.model.load_state_dict(state["model"])
        step = int(state["progress"]["step"])
        self.optimizer.load_state_dict(state["optim"], step_count=step)
        train_data.load_state_dict({k: int(v) for k, v in state["data"].items()})
        if same_world:
            rng = state[f"rng_rank{self.rank}"]
            torch.set_rng_state(rng["torch"])
            if self.device.type == "cuda" and "cuda" in rng:
                torch.cuda.set_rng_state(rng["cuda"], self.device)
        restart = f" (torchrun restart {restart_count()})" if restart_count() else ""
        self.info(f"resumed from {path} at step {step}{restart}")
        return step
