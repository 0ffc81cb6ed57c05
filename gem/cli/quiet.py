"""The one place where gem silences third-party warnings it cannot fix, each with the reason. The command-line tools
call `quiet_third_party()` first."""

from __future__ import annotations

import logging
import warnings


def quiet_third_party() -> None:
    # torchrec's planner warns on constructing its default storage reservation; the replacement it recommends
    # (FixedPercentageStorageReservation) plans differently and is missing from older torchrec releases gem supports.
    warnings.filterwarnings("ignore", message="HeuristicalStorageReservation is known to cause issues",
                            category=FutureWarning)
    # torch >= 2.13 deprecates DDP's `broadcast_buffers` for `forward_sync_buffers`, which the GPU stack's torch
    # (2.11) does not accept; gem passes what both understand.
    warnings.filterwarnings("ignore", message="`broadcast_buffers` is deprecated", category=FutureWarning)
    # torchrec's sharded embedding tables are ShardedTensors (torchrec has not moved them to DTensor); reading their
    # size or state for a checkpoint warns that ShardedTensor is deprecated.
    warnings.filterwarnings("ignore", message="Please use DTensor instead and we are deprecating ShardedTensor",
                            category=FutureWarning)
    # fbgemm's embedding backward announces, once per process, that its Blackwell-only TBE path is off on this GPU.
    warnings.filterwarnings("ignore", message="TBE B200 optimization", category=UserWarning)
    # torchrec 1.6 calls c10d's _get_pg_default_device, which torch 2.11 deprecates; torchrec 1.8 no longer does.
    warnings.filterwarnings("ignore", message="`_get_pg_default_device` will be deprecated", category=UserWarning)
    # Inductor notes fp32 matmuls that could use TF32; gem keeps fp32 matmuls (routers, fp32 runs) at full precision.
    warnings.filterwarnings("ignore", message="TensorFloat32 tensor cores for float32 matrix multiplication",
                            category=UserWarning)
    # KeyedJaggedTensor's is_fx_tracing() check makes torch.fx log a notice about torch.export once per process.
    logging.getLogger("torch.fx._symbolic_trace").setLevel(logging.ERROR)
