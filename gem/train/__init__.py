"""Training: the trainer loop, optimizers, metrics, MFU, TensorBoard logging and DCP checkpoints.

`gem-train` / `python -m gem.train [hydra overrides]` runs it (see gem/cli/train.py).
"""

from gem.train.checkpoint import Checkpointer, CheckpointError, latest_checkpoint, list_checkpoints
from gem.train.config import TrainConfig, TrainConfigError
from gem.train.metrics import TaskMetrics, auc_with_ties
from gem.train.mfu import device_peak_flops, mfu_report
from gem.train.optim import TrainOptimizer, WarmupCosine, clip_grad_norm_

__all__ = [
    "CheckpointError",
    "Checkpointer",
    "TaskMetrics",
    "TrainConfig",
    "TrainConfigError",
    "TrainOptimizer",
    "WarmupCosine",
    "auc_with_ties",
    "clip_grad_norm_",
    "device_peak_flops",
    "latest_checkpoint",
    "list_checkpoints",
    "mfu_report",
]
