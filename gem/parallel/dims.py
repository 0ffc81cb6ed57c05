"""One object that turns the `parallel:` config into validated degrees, device meshes and process groups.

Dense side: mesh ("dp_replicate", "dp_shard"); FSDP2 shards over dp_shard and replicates over dp_replicate (HSDP).
Expert parallelism borrows its degree from dp_shard (dp_shard = dp_shard_mod_ep x ep): experts are split over
"ep" (consecutive ranks, so the all-to-all stays inside a host) and their weights FSDP-sharded over the
remaining ("dp_replicate", "dp_shard_mod_ep") dims.
Sparse side: embedding sharding groups of `emb_shard_group` ranks (TorchRec DMP inside each group) replicated
across groups; the replica groups link the ranks that hold the same shard.
Beside it, the groups that `parallelize` and the process group also read: `compile:` (CompileConfig),
`activation_checkpoint:` (ActivationCheckpointConfig) and `comm:` (CommConfig).
"""

from __future__ import annotations

import dataclasses
import datetime
import os
import typing
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from gem.config import Checker, ConfigError, build, check_moved, one_of, to_plain

SHARDING_TYPES = ("table_wise", "row_wise", "column_wise", "table_row_wise", "table_column_wise")
_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
CompileBackend = Literal["inductor", "aot_eager", "eager"]
ACMode = Literal["none", "full", "selective"]
COMPILE_BACKENDS = typing.get_args(CompileBackend)
AC_MODES = typing.get_args(ACMode)


class ParallelConfigError(ConfigError):
    """A `parallel:` config that cannot be laid out on this world; the message names the key."""


@dataclass
class ParallelConfig:
    dp_replicate: int = 1
    dp_shard: int = -1  # -1: the rest of the world
    ep: int = 1
    emb_shard_group: int = -1  # ranks per embedding sharding group; -1: the whole world
    emb_sync_every: int = 1  # steps between embedding replica syncs (only with > 1 group)
    emb_group_layout: Literal["host_local", "strided"] = "host_local"  # strided: group = rank % n_groups
    # planner constraints: a list for every table, or {table_name: [types]}; None: defaults for the device
    sharding_types: Any = None
    # auto: fsdp when the degrees need it (dp_replicate > 1: HSDP, ep > 1), else ddp
    dense: Literal["auto", "ddp", "fsdp"] = "auto"
    reshard_after_forward: bool | int = True  # or an int: reshard to a smaller group

    @classmethod
    def from_any(cls, cfg: Any) -> ParallelConfig:
        """Build from a ParallelConfig, a mapping, an OmegaConf DictConfig or None; unknown keys are errors."""
        return _from_any(cls, cfg, "parallel", ParallelConfigError)


@dataclass
class CompileConfig:
    """`compile:` regional torch.compile of the dense parts of each block (gem.parallel.parallelize applies it)."""

    enabled: bool | Literal["auto"] = "auto"  # auto: on CUDA
    # inductor (fused kernels); aot_eager / eager trace the same graphs without code generation (debugging, CPU tests)
    backend: CompileBackend = "inductor"

    def __post_init__(self) -> None:
        need = Checker("compile").need
        need(isinstance(self.enabled, bool) or self.enabled == "auto", "enabled", "expected auto, true or false",
             self.enabled)
        need(self.backend in COMPILE_BACKENDS, "backend", f"must be {one_of(COMPILE_BACKENDS)}", self.backend)

    def on(self, device: torch.device) -> bool:
        return self.enabled is True or (self.enabled == "auto" and device.type == "cuda")

    @classmethod
    def from_any(cls, cfg: Any) -> CompileConfig:
        return _from_any(cls, cfg, "compile")


@dataclass
class ActivationCheckpointConfig:
    """`activation_checkpoint:` which blocks recompute their activations in backward instead of keeping them."""

    mode: ACMode = "none"  # full: every block; selective: every `every`-th block
    every: int = 1

    def __post_init__(self) -> None:
        need = Checker("activation_checkpoint").need
        need(self.mode in AC_MODES, "mode", f"must be {one_of(AC_MODES)}", self.mode)
        need(not isinstance(self.every, bool) and isinstance(self.every, int), "every", "expected an integer",
             self.every)
        need(self.every >= 1, "every", "must be >= 1", self.every)

    @classmethod
    def from_any(cls, cfg: Any) -> ActivationCheckpointConfig:
        return _from_any(cls, cfg, "activation_checkpoint")


@dataclass
class CommConfig:
    """`comm:` the process group's collectives."""

    timeout_s: float = 600.0  # seconds before a collective that hangs fails (a rank stuck or gone)

    def __post_init__(self) -> None:
        t = self.timeout_s
        Checker("comm").need(not isinstance(t, bool) and isinstance(t, (int, float)) and t > 0, "timeout_s",
                             "must be a number of seconds > 0", t)

    @classmethod
    def from_any(cls, cfg: Any) -> CommConfig:
        return _from_any(cls, cfg, "comm")


def _from_any(cls: type, cfg: Any, key: str, error: type[ConfigError] = ConfigError) -> Any:
    """`cls` from an instance (copied), a mapping, an OmegaConf DictConfig or None (the defaults); unknown keys are
    errors, a key that moved to another group says where it went."""
    if cfg is None:
        return cls()
    if isinstance(cfg, cls):
        return dataclasses.replace(cfg)
    data = to_plain(cfg)
    check_moved(key, data)
    return build(cls, data, key, error)


def _check_int(name: str, value: Any, *, allow_minus_one: bool = False) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ParallelConfigError(f"parallel.{name}", "expected an integer", value)
    if value < 1 and not (allow_minus_one and value == -1):
        raise ParallelConfigError(f"parallel.{name}", "must be >= 1" + (" or -1" if allow_minus_one else ""), value)
    return value


def validate(cfg: ParallelConfig, world_size: int) -> ParallelConfig:
    """Resolve -1 degrees and `dense: auto` against `world_size` and check every constraint; returns a resolved
    copy."""
    c = dataclasses.replace(cfg)
    dp_rep = _check_int("dp_replicate", c.dp_replicate)
    dp_shard = _check_int("dp_shard", c.dp_shard, allow_minus_one=True)
    if dp_shard == -1:
        if world_size % dp_rep:
            raise ParallelConfigError("parallel.dp_replicate", f"must divide the world size {world_size}", dp_rep)
        dp_shard = world_size // dp_rep
    if dp_rep * dp_shard != world_size:
        raise ParallelConfigError(
            "parallel.dp_shard", f"dp_replicate ({dp_rep}) x dp_shard must be the world size {world_size}", dp_shard
        )
    ep = _check_int("ep", c.ep)
    if dp_shard % ep:
        raise ParallelConfigError("parallel.ep", f"must divide dp_shard ({dp_shard})", ep)
    g = _check_int("emb_shard_group", c.emb_shard_group, allow_minus_one=True)
    if g == -1:
        g = world_size
    if world_size % g:
        raise ParallelConfigError("parallel.emb_shard_group", f"must divide the world size {world_size}", g)
    _check_int("emb_sync_every", c.emb_sync_every)
    _choice("emb_group_layout", c.emb_group_layout, ("host_local", "strided"))
    _choice("dense", c.dense, ("auto", "ddp", "fsdp"))
    if c.dense == "auto":  # the degrees imply the layout
        c.dense = "fsdp" if dp_rep > 1 or ep > 1 else "ddp"
    if c.dense == "ddp" and dp_rep > 1:
        raise ParallelConfigError("parallel.dense", f"HSDP (dp_replicate={dp_rep}) needs fsdp or auto", c.dense)
    if c.dense == "ddp" and ep > 1:
        raise ParallelConfigError("parallel.dense", f"expert parallelism (ep={ep}) needs fsdp or auto", c.dense)
    r = c.reshard_after_forward
    if not isinstance(r, bool) and not (isinstance(r, int) and r >= 1):
        raise ParallelConfigError("parallel.reshard_after_forward", "expected true, false or an int >= 1", r)
    _check_sharding_types(c.sharding_types)
    c.dp_shard, c.emb_shard_group = dp_shard, g
    return c


def _choice(key: str, value: Any, options: tuple) -> None:
    if value not in options:
        raise ParallelConfigError(f"parallel.{key}", f"must be {one_of(options)}", value)


def _check_sharding_types(st: Any) -> None:
    if st is None:
        return
    if isinstance(st, str):
        st = [st]
    lists = st.values() if isinstance(st, Mapping) else [st]
    for lst in lists:
        if isinstance(lst, str):
            lst = [lst]
        if not isinstance(lst, (list, tuple)) or not lst:
            raise ParallelConfigError("parallel.sharding_types", "expected a non-empty list of types", st)
        for t in lst:
            if t == "data_parallel":
                raise ParallelConfigError(
                    "parallel.sharding_types", "data_parallel is not offered (the fused sparse optimizer and the "
                    "replica sync cover sharded tables only)", t
                )
            if t not in SHARDING_TYPES:
                raise ParallelConfigError("parallel.sharding_types", f"must be {one_of(SHARDING_TYPES)}", t)


def init_distributed(timeout_s: float = 600.0, store: dist.Store | None = None) -> torch.device:
    """Create the default process group once (nccl on CUDA, gloo on CPU) and return this rank's device.

    Under torchrun the env:// variables are used; without them a one-rank group is created in-process, so the
    same code path (TorchRec DMP, fused optimizer) serves single-process runs. With torchrun's agent `store`, the
    group's keys go under a prefix per restart attempt: the store keeps a failed attempt's keys, and a restarted
    attempt would otherwise read its dead peers' addresses and fail to connect (pytorch/pytorch#135712).
    `timeout_s`: the collective timeout (the trainer passes `comm.timeout_s`).
    """
    use_cuda = torch.cuda.is_available()
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if use_cuda:
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
    if dist.is_initialized():
        return device
    backend = "nccl" if use_cuda else "gloo"
    timeout = datetime.timedelta(seconds=timeout_s)
    if store is not None:
        attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
        dist.init_process_group(
            backend=backend,
            store=dist.PrefixStore(f"gem/attempt_{attempt}/", store),
            rank=int(os.environ["RANK"]),
            world_size=int(os.environ["WORLD_SIZE"]),
            timeout=timeout,
        )
    elif "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        dist.init_process_group(backend=backend, timeout=timeout)
    else:
        dist.init_process_group(backend=backend, store=dist.HashStore(), rank=0, world_size=1, timeout=timeout)
    return device


@dataclass
class ParallelDims:
    """Validated degrees plus every mesh / process group the appliers use (built by `build`)."""

    cfg: ParallelConfig
    world_size: int
    rank: int
    local_world_size: int
    device: torch.device
    dense_mesh: DeviceMesh | None = None  # ("dp_replicate", "dp_shard")
    expert_mesh: DeviceMesh | None = None  # ("dp_replicate", "dp_shard_mod_ep", "ep")
    emb_mesh: DeviceMesh | None = None  # ("emb_replicate", "emb_shard")
    _groups: dict = field(default_factory=dict, repr=False)

    # ---- degrees ----
    @property
    def dp_replicate(self) -> int:
        return self.cfg.dp_replicate

    @property
    def dp_shard(self) -> int:
        return self.cfg.dp_shard

    @property
    def ep(self) -> int:
        return self.cfg.ep

    @property
    def dp_shard_mod_ep(self) -> int:
        return self.cfg.dp_shard // self.cfg.ep

    @property
    def emb_shard_group(self) -> int:
        return self.cfg.emb_shard_group

    @property
    def emb_replicas(self) -> int:
        return self.world_size // self.cfg.emb_shard_group

    @property
    def dp_world(self) -> int:
        """Ranks that see different data (every rank: no tensor/pipeline parallelism here)."""
        return self.world_size

    # ---- layouts (pure functions of the config; no process groups) ----
    def emb_layout(self) -> torch.Tensor:
        """[n_groups, group_size] rank table: row i = the ranks of embedding sharding group i."""
        n, g = self.emb_replicas, self.emb_shard_group
        ranks = torch.arange(self.world_size)
        if self.cfg.emb_group_layout == "host_local":
            return ranks.view(n, g)
        return ranks.view(g, n).t().contiguous()  # strided: group i = {r : r % n == i}

    def emb_group_ranks(self) -> list[int]:
        t = self.emb_layout()
        return t[(t == self.rank).any(dim=1)].flatten().tolist()

    def emb_replica_ranks(self) -> list[int]:
        t = self.emb_layout()
        return t[:, (t == self.rank).any(dim=0)].flatten().tolist()

    # ---- process groups ----
    @property
    def emb_shard_pg(self) -> dist.ProcessGroup:
        if self.emb_mesh is None:
            return dist.group.WORLD
        return self.emb_mesh.get_group("emb_shard")

    @property
    def emb_replica_pg(self) -> dist.ProcessGroup | None:
        if self.emb_mesh is None:
            return None
        return self.emb_mesh.get_group("emb_replicate")

    @property
    def fsdp_mesh(self) -> DeviceMesh:
        """Mesh for non-expert dense params: 2D (HSDP) when dp_replicate > 1, else 1D over dp_shard."""
        assert self.dense_mesh is not None
        return self.dense_mesh if self.dp_replicate > 1 else self.dense_mesh["dp_shard"]

    @property
    def expert_fsdp_mesh(self) -> DeviceMesh | None:
        """Mesh that FSDP-shards the (already ep-split) expert weights; None when ep == 1."""
        if self.expert_mesh is None:
            return None
        if self.dp_replicate > 1:
            return self.expert_mesh["dp_replicate", "dp_shard_mod_ep"]
        return self.expert_mesh["dp_shard_mod_ep"]

    @property
    def ep_pg(self) -> dist.ProcessGroup | None:
        return None if self.expert_mesh is None else self.expert_mesh.get_group("ep")

    @classmethod
    def build(cls, cfg: Any, device: torch.device | None = None) -> ParallelDims:
        """Validate `cfg` against the initialised world and create the meshes (collective: call on every rank)."""
        if not dist.is_initialized():
            raise RuntimeError("gem.parallel: call init_distributed() before ParallelDims.build")
        world, rank = dist.get_world_size(), dist.get_rank()
        c = validate(ParallelConfig.from_any(cfg), world)
        if device is None:
            device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
        local_world = int(os.environ.get("LOCAL_WORLD_SIZE", str(world)))
        dims = cls(cfg=c, world_size=world, rank=rank, local_world_size=local_world, device=device)
        dtype = device.type
        ranks = torch.arange(world)
        dims.dense_mesh = DeviceMesh(
            dtype, ranks.view(c.dp_replicate, c.dp_shard), mesh_dim_names=("dp_replicate", "dp_shard")
        )
        if c.ep > 1:
            dims.expert_mesh = DeviceMesh(
                dtype,
                ranks.view(c.dp_replicate, c.dp_shard // c.ep, c.ep),
                mesh_dim_names=("dp_replicate", "dp_shard_mod_ep", "ep"),
            )
        if dims.emb_replicas > 1:
            dims.emb_mesh = DeviceMesh(dtype, dims.emb_layout(), mesh_dim_names=("emb_replicate", "emb_shard"))
        return dims

    def describe(self) -> str:
        c = self.cfg
        return (
            f"world={self.world_size} dense={c.dense} dp_replicate={c.dp_replicate} dp_shard={c.dp_shard} ep={c.ep} "
            f"emb_shard_group={c.emb_shard_group} (x{self.emb_replicas} replicas, {c.emb_group_layout}, "
            f"sync every {c.emb_sync_every})"
        )


def dtype_of(name: str) -> torch.dtype:
    return _DTYPES[name]
