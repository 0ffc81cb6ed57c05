"""Kernels with one dispatcher each (kernel = "auto" | "triton" | "reference"); they know nothing of models."""

from gem.ops import mx
from gem.ops._common import JaggedBatch
from gem.ops.block import block_attention
from gem.ops.gdpa import gdpa
from gem.ops.jfa import jagged_attention
from gem.ops.rotary import rope

__all__ = ["JaggedBatch", "block_attention", "gdpa", "jagged_attention", "mx", "rope"]
