"""GEM model: TorchRec embeddings, jagged transformer tower, GDPA target interaction, MoE, multi-task heads."""

from gem.model.config import (
    ConfigError,
    HeadConfig,
    InteractionConfig,
    ModelConfig,
    MoEConfig,
    TowerConfig,
)
from gem.model.gem import GEMModel, ModelOutput
from gem.model.heads import MultiTaskHeads, losses, multitask_loss
from gem.model.moe import LocalDispatcher, MoE

__all__ = [
    "ConfigError",
    "GEMModel",
    "HeadConfig",
    "InteractionConfig",
    "LocalDispatcher",
    "MoE",
    "MoEConfig",
    "ModelConfig",
    "ModelOutput",
    "MultiTaskHeads",
    "TowerConfig",
    "losses",
    "multitask_loss",
]
