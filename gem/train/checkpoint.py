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
import threading
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint import metadata as dcp_md
from torch.distributed.checkpoint.api import CheckpointException

from gem.config import MOVED_KEYS, UserError, show

_STEP_DIR = re.compile(r"^step_(\d+)$")
_TMP_PREFIX = ".tmp-"
CONFIG_FILE = "gem_config.json"


class CheckpointError(UserError):
    """A checkpoint that cannot be used: unsafe or unreadable metadata, or state that does not fit this run."""


def _rank() -> int:
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def _barrier() -> None:
    if dist.is_available() and dist.is_initialized():
        if dist.get_backend() == "nccl":  # name the device, else c10d guesses it and warns on every barrier
            dist.barrier(device_ids=[torch.cuda.current_device()])
        else:
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
# choice does not change the state; checkpoints of the older form also carry the keys that left `parallel`.
FREE_KEYS = (
    *MOVED_KEYS,
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


def _first_error(e: BaseException) -> str:
    """The first line of the first rank's error inside DCP's CheckpointException (or of `e` itself)."""
    failures = getattr(e, "failures", None)
    if isinstance(failures, Mapping):
        first = next((exc for exc, _ in failures.values() if isinstance(exc, BaseException)), None)
        if first is not None:
            e = first
    text = str(e).strip().splitlines()[0] if str(e).strip() else ""
    return f"{type(e).__name__}: {text}" if text else type(e).__name__


def no_checkpoint_error(ckpt_dir: str | os.PathLike) -> CheckpointError:
    """`train.resume=true` where there is nothing to resume (a typo in the run dir must not restart training)."""
    return CheckpointError(
        "train.resume", f"no complete checkpoint in {ckpt_dir} (use train.resume=auto to start fresh there)", True
    )


class Checkpointer:
    """Saves and loads training state under `ckpt_dir` (the same path on every rank); keeps the newest `keep`
    complete checkpoints and those of `keep_steps`.

    `config`: flat config values saved beside each checkpoint and compared on load (see `check_fits`).
    `async_save`: `save` copies the state to host memory (pinned on CUDA) and returns; DCP writes it from a
    background thread over a CPU (gloo) group of its own, and rank 0 renames the directory once every rank's shards
    and the metadata are written. At most one save is in flight: the next `save` (or `wait`) waits for it. A
    background save that fails leaves only its `.tmp-` directory; `poll` / `wait` report it once."""

    def __init__(self, ckpt_dir: str | os.PathLike, keep: int = 2, config: Mapping[str, Any] | None = None,
                 ignore: tuple[str, ...] = FREE_KEYS, keep_steps: tuple[int, ...] | list[int] = (),
                 async_save: bool = False) -> None:
        if keep < 1:
            raise ValueError(f"train.checkpoint.keep must be >= 1, got {keep}")
        self.dir = Path(ckpt_dir)
        self.keep = keep
        self.keep_steps = frozenset(keep_steps)
        self.config = dict(config) if config is not None else None
        self.ignore = ignore
        self.async_save = async_save
        self._pending: tuple[int, Any, threading.Event] | None = None  # (step, future, published) in flight
        self._failure: str | None = None  # set by the background thread, reported by poll / wait
        self._unsynced = False  # a background save ended (seen by poll) with no barrier since
        self._group = None
        self._stager = None

    def save(self, step: int, state: dict[str, Any]) -> Path:
        """Write the checkpoint of `step` (in the background with `async_save`); returns its final path."""
        check_tensor_leaves(state)
        self.wait()
        final = self.dir / f"step_{step}"
        tmp = self.dir / f"{_TMP_PREFIX}step_{step}"
        if _rank() == 0:
            self.dir.mkdir(parents=True, exist_ok=True)
            for p in self.dir.iterdir():  # leftovers of an interrupted save
                if p.name.startswith(_TMP_PREFIX):
                    shutil.rmtree(p, ignore_errors=True)
        _barrier()
        if self.async_save:
            future = dcp.async_save(state, checkpoint_id=str(tmp), process_group=self._process_group(),
                                    async_stager=self._async_stager())
            done = threading.Event()
            self._pending = (step, future, done)
            future.add_done_callback(lambda f: self._finished(step, f, done))
            return final
        dcp.save(state, checkpoint_id=str(tmp))
        _barrier()
        if _rank() == 0:
            self._publish(step)
        _barrier()
        return final

    def _publish(self, step: int) -> None:
        """Rank 0, once every shard and the metadata of `step` are written: config file, atomic rename, pruning."""
        final = self.dir / f"step_{step}"
        tmp = self.dir / f"{_TMP_PREFIX}step_{step}"
        if self.config is not None:
            (tmp / CONFIG_FILE).write_text(json.dumps(self.config, indent=1, sort_keys=True) + "\n")
        if final.exists():  # a save of the same step (e.g. after a resume): replace it
            shutil.rmtree(final)
        os.replace(tmp, final)
        old = [(s, p) for s, p in list_checkpoints(self.dir)[: -self.keep] if s not in self.keep_steps]
        for _, p in old:
            shutil.rmtree(p, ignore_errors=True)

    def _finished(self, step: int, future, done: threading.Event) -> None:
        """The background save's end (on DCP's thread): publish it, or note why not."""
        try:
            future.result()  # DCP's last collective: every rank's shards and the metadata are written
            if _rank() == 0:
                self._publish(step)
        except BaseException as e:  # noqa: BLE001 - CheckpointException is a BaseException
            self._failure = f"checkpoint step_{step} failed in the background ({_first_error(e)})"
        finally:
            done.set()

    def poll(self) -> str | None:
        """Without waiting: the failure of a finished background save, once (None: none, or still running).
        No collective: ranks see the save end after different steps; `wait` holds the barrier."""
        if self._pending is not None and self._pending[2].is_set():
            self._pending = None
            self._unsynced = True
            failure, self._failure = self._failure, None
            return failure
        return None

    def wait(self) -> str | None:
        """Wait for the save in flight; returns its failure (once), else None. Every rank calls it at the same
        points (the next save, the end of training), so its barrier is collective."""
        if self._pending is not None:
            _, _, done = self._pending
            self._pending = None
            done.wait()  # the future's result and the publishing callback after it
            self._unsynced = True
        if self._unsynced:
            self._unsynced = False
            _barrier()  # rank 0's rename is done everywhere before anyone looks for the newest checkpoint
        failure, self._failure = self._failure, None
        return failure

    def close(self, wait: bool = True) -> None:
        """Release the staging memory and the group (`wait`: for the save in flight first)."""
        if wait:
            self.wait()
        elif self._pending is not None:
            return  # its thread still uses the staging memory and the group
        if self._stager is not None:
            self._stager.close()
            self._stager = None
        if self._group is not None:
            dist.destroy_process_group(self._group)
            self._group = None

    def _process_group(self):
        if self._group is None and dist.is_available() and dist.is_initialized():
            self._group = dist.new_group(backend="gloo")  # DCP's background collectives stay off the training group
        return self._group

    def _async_stager(self):
        """Copies the state to host memory before `save` returns: on CUDA into pinned buffers made at the first
        save and reused (faster copies out of the GPU). DCP's blocking stager: it copies torchrec's ShardedTensors,
        which the default stager of torch 2.13 refuses."""
        if self._stager is None:
            from torch.distributed.checkpoint.staging import BlockingAsyncStager

            self._stager = BlockingAsyncStager(cache_staged_state_dict=torch.cuda.is_available())
        return self._stager

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
    """Saves and resumes one rank's training state. `info` / `warn`: rank 0's log line writers; `batch_size`: per
    rank (for the line a resume at another world size prints)."""

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
        warn: Callable[[str], None] | None = None,
        batch_size: int = 0,
    ) -> None:
        self.checkpointer, self.par, self.optimizer = checkpointer, par, optimizer
        self.rank, self.world_size, self.device, self.info = rank, world_size, device, info
        self.warn = warn or info
        self.batch_size = batch_size

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
                "batch_size": torch.tensor(self.batch_size, dtype=torch.int64),
            },
            "data": {k: torch.tensor(int(v), dtype=torch.int64) for k, v in data_state.items()},
            f"rng_rank{self.rank}": rng,
        }

    def save(self, step: int, data_state: Mapping[str, int]) -> str:
        if self.par.embeddings is not None and self.par.embeddings.n_replicas > 1:
            self.par.sync_embeddings()  # every replica holds the same tables in the checkpoint
        self.report(self.checkpointer.wait())  # at most one save in flight
        path = self.checkpointer.save(step, self.state(step, data_state))
        self.info(f"checkpoint: {path}" + (" (writing in the background)" if self.checkpointer.async_save else ""))
        return str(path)

    def report(self, failure: str | None) -> bool:
        """One line for a failed background save, naming the checkpoint that stays the newest; True if it failed."""
        if failure is None:
            return False
        found = latest_checkpoint(self.checkpointer.dir)
        self.warn(f"{failure}; the newest complete checkpoint stays {found[1].name if found else 'none'}")
        return True

    def poll(self) -> None:
        """After a step: report a background save that failed meanwhile (never waits)."""
        self.report(self.checkpointer.poll())

    def finish(self) -> str | None:
        """Wait for the save in flight; the newest complete checkpoint's path afterwards (None: none)."""
        self.report(self.checkpointer.wait())
        found = latest_checkpoint(self.checkpointer.dir)
        return str(found[1]) if found else None

    def _newest_intact(self) -> tuple[int, list[str]]:
        """Rank 0: the newest checkpoint whose metadata reads and whose storage files are all there and long
        enough (-1: none), and a line for each newer one skipped."""
        skipped = []
        for step, path in reversed(list_checkpoints(self.checkpointer.dir)):
            why = damage(path)
            if why is None:
                return step, skipped
            skipped.append(f"resume: skipped {path.name}: {why}")
        return -1, skipped

    def resume(self, train_data, report_none: bool = True, require: bool = False) -> int | None:
        """Load the newest intact checkpoint (the same on every rank) into the model, optimizer, RNG and
        `train_data`'s position; returns its step, or None when there is none (an error when `require`)."""
        choice = [self._newest_intact() if self.rank == 0 else None]
        if self.world_size > 1:  # every rank must pick the same checkpoint
            dist.broadcast_object_list(choice, src=0)
        step0, skipped = choice[0]
        for line in skipped:
            self.warn(line)
        if step0 < 0:
            if require:
                raise no_checkpoint_error(self.checkpointer.dir)
            if report_none:
                self.info(f"resume: no checkpoint in {self.checkpointer.dir}, starting from step 0")
            return None
        path = self.checkpointer.dir / f"step_{step0}"
        self.optimizer.init_state()
        meta = {"progress": {"step": torch.tensor(0, dtype=torch.int64), "world_size": torch.tensor(0)}}
        has_batch = "progress.batch_size" in load_metadata(path).state_dict_metadata
        if has_batch:
            meta["progress"]["batch_size"] = torch.tensor(0, dtype=torch.int64)
        self.checkpointer.load(path, meta)
        old_world = int(meta["progress"]["world_size"])
        same_world = old_world == self.world_size
        state = self.state(0, train_data.state_dict())
        if not has_batch:
            state["progress"].pop("batch_size")
        if not same_world:  # per-rank RNG streams only carry over to the same world size
            state.pop(f"rng_rank{self.rank}")
        self.checkpointer.load(path, state)
        from gem.parallel.embedding import zch_resume_problem

        problems = [zch_resume_problem(self.par.model, state["model"])]
        if self.world_size > 1:  # one rank's shard may fit while another's does not: every rank stops
            problems = [None] * self.world_size
            dist.all_gather_object(problems, zch_resume_problem(self.par.model, state["model"]))
        problem = next((p for p in problems if p is not None), None)
        if problem is not None:
            raise CheckpointError(str(path), problem)
        self.par.model.load_state_dict(state["model"])
        step = int(state["progress"]["step"])
        self.optimizer.load_state_dict(state["optim"], step_count=step)
        saved_position = {k: int(v) for k, v in state["data"].items()}
        train_data.load_state_dict(saved_position)
        if same_world:
            rng = state[f"rng_rank{self.rank}"]
            torch.set_rng_state(rng["torch"])
            if self.device.type == "cuda" and "cuda" in rng:
                torch.cuda.set_rng_state(rng["cuda"], self.device)
        else:
            old_batch = int(meta["progress"]["batch_size"]) if has_batch else self.batch_size
            now = int(train_data.state_dict().get("batch_index", -1))
            read = saved_position.get("batch_index", 0) * old_world * old_batch
            self.warn(f"resume: world size {old_world} -> {self.world_size}: global batch {old_world * old_batch} -> "
                      f"{self.world_size * self.batch_size}; data position {read} examples (each rank continues at "
                      f"its batch {now})")
        restart = f" (torchrun restart {restart_count()})" if restart_count() else ""
        self.info(f"resumed from {path} at step {step}{restart}")
        return step


def damage(path: str | os.PathLike) -> str | None:
    """Why the checkpoint at `path` cannot be read (None: it looks intact): unreadable metadata, a storage file
    missing or shorter than the metadata says."""
    try:
        md = load_metadata(path)
    except CheckpointError as e:
        return str(e)
    ends: dict[str, int] = {}
    for info in (md.storage_data or {}).values():
        rel = info.relative_path
        ends[rel] = max(ends.get(rel, 0), int(getattr(info, "offset", 0)) + int(getattr(info, "length", 0)))
    for rel, end in sorted(ends.items()):
        f = Path(path) / rel
        if not f.is_file():
            return f"{rel}: missing"
        if f.stat().st_size < end:
            return f"{rel}: {f.stat().st_size} bytes, the metadata expects {end}"
    return None
