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
    # KeyedJaggedTensor's is_fx_tracing() check makes torch.fx log a notice about torch.export once per process.
    logging.getLogger("torch.fx._symbolic_trace").setLevel(logging.ERROR)
