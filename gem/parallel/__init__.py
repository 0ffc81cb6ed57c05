"""Parallelism: one config builds every mesh and process group; appliers for TorchRec embeddings (DMP / 2D),
dense FSDP2 (HSDP) or DDP, and expert parallelism (all-to-all)."""

from gem.parallel.api import Parallelized, parallelize
from gem.parallel.dims import (
    ActivationCheckpointConfig,
    CommConfig,
    CompileConfig,
    ParallelConfig,
    ParallelConfigError,
    ParallelDims,
    init_distributed,
    validate,
)
from gem.parallel.expert import AllToAllDispatcher

__all__ = [
    "ActivationCheckpointConfig",
    "AllToAllDispatcher",
    "CommConfig",
    "CompileConfig",
    "ParallelConfig",
    "ParallelConfigError",
    "ParallelDims",
    "Parallelized",
    "init_distributed",
    "parallelize",
    "validate",
]
