"""`parallelize`: one call that lays a GEM-style model out over the world described by the `parallel:` config."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from gem.model.precision import inductor_options
from gem.parallel.dims import ActivationCheckpointConfig, CompileConfig, ParallelDims, init_distributed
from gem.parallel.embedding import ShardedEmbeddings, shard_embeddings
from gem.parallel.expert import apply_expert_parallel, find_moe_modules
from gem.parallel.fsdp import apply_activation_checkpointing, apply_compile, apply_fsdp, wrap_ddp


@dataclass
class Parallelized:
    """The wrapped model and what the trainer needs around it.

    model: call it as before (`model(batch)`); it is a TorchRec DMP whose inner module is the original model
        (dense part under DDP or FSDP2). `model.state_dict()` holds the tables as ShardedTensor (one embedding
        group) or DTensor (several) and, with FSDP, DTensor dense params: hand it to torch.distributed.checkpoint
        as is (keys do not depend on DDP/FSDP/activation checkpointing). Call `sync_embeddings()` before saving
        when there are several embedding groups, so every replica holds the same tables.
    sparse_optimizer: TorchRec KeyedOptimizer of the fused table optimizer (steps inside backward; its
        `state_dict()` is ShardedTensor based, DCP-ready). Do not call step() on it.
    """

    model: nn.Module
    dims: ParallelDims
    sparse_optimizer: Any
    embeddings: ShardedEmbeddings | None
    inner: nn.Module  # the original model object (now holding sharded / wrapped submodules)
    _dense_params: list[nn.Parameter] = field(default_factory=list, repr=False)
    fp8_all_gather: list[str] = field(default_factory=list)  # fp8_block weights FSDP2 all-gathers in FP8

    def dense_parameters(self) -> list[nn.Parameter]:
        """Parameters for the dense optimizer: everything except the embedding tables."""
        return list(self._dense_params)

    def after_step(self, step: int) -> bool:
        """Call after each optimizer step (`step` counted from 1). Averages the embedding replicas every
        `emb_sync_every` steps; returns whether it synced (never with a single embedding group)."""
        if self.embeddings is None or self.embeddings.n_replicas <= 1:
            return False
        if step % self.dims.cfg.emb_sync_every:
            return False
        self.embeddings.sync(include_optimizer_state=True)
        return True

    def sync_embeddings(self) -> None:
        """Force a replica sync (e.g. before a checkpoint or evaluation, so every replica holds the same tables)."""
        if self.embeddings is not None:
            self.embeddings.sync(include_optimizer_state=True)

    def dense_named_parameters(self) -> dict[str, nn.Parameter]:
        """{name: param} of `dense_parameters()`, named as in the unwrapped model (activation-checkpoint and
        compile wrappers left out), so optimizer-state keys do not depend on those settings."""
        ids = {id(p) for p in self._dense_params}
        return {_canonical(n): p for n, p in self.inner.named_parameters() if id(p) in ids}


def _canonical(name: str) -> str:
    for wrapper in ("_checkpoint_wrapped_module.", "_orig_mod."):
        name = name.replace(wrapper, "")
    return name


def parallelize(model: nn.Module, parallel_cfg: Any, *, compile_cfg: Any = None, ac_cfg: Any = None,
                param_dtype: str = "fp32", reduce_dtype: str = "fp32", sparse_optimizer_cfg: Any = None,
                device: torch.device | None = None, fp8_all_gather: bool = True) -> Parallelized:
    """Shard `model` per `parallel_cfg` (collective: call on every rank with identically initialised models).

    `compile_cfg`, `ac_cfg`: the `compile:` and `activation_checkpoint:` groups (a config, a mapping or None for
    the defaults: compile on CUDA, no checkpointing); they wrap the blocks before FSDP2 shards them.
    `param_dtype`, `reduce_dtype` (train.param_dtype / train.reduce_dtype): FSDP2's mixed precision, the dtype
    parameters are all-gathered and computed in and the dtype gradients are reduced in (DDP keeps fp32).
    `fp8_all_gather`: under FSDP2, the fp8_block (BlockFP8Linear) weights whose row shards are whole 128x128 tiles
    are all-gathered as FP8 codes + tile scales instead (gem.parallel.fsdp.enable_fp8_all_gather); False keeps
    every weight's all-gather in param_dtype (the same numbers, twice or four times the bytes).
    Order: expert parallel dispatchers/weights -> TorchRec DMP for the tables (optimizer fused into their
    backward) -> activation checkpointing / compile per block -> dense DDP or FSDP2 over the world.
    """
    compile_cfg = CompileConfig.from_any(compile_cfg)
    ac_cfg = ActivationCheckpointConfig.from_any(ac_cfg)
    if device is None:
        device = init_distributed()
    else:
        init_distributed()
    dims = ParallelDims.build(parallel_cfg, device)
    cfg = dims.cfg
    model = model.to(device) if next(model.parameters()).device.type != "meta" else model

    moes = find_moe_modules(model)
    expert_modules = apply_expert_parallel(moes, dims) if cfg.ep > 1 else []

    emb = shard_embeddings(model, dims, sparse_optimizer_cfg, device)
    dmp = emb.dmp
    inner = dmp.module
    table_params = _sharded_params(inner)

    blocks = getattr(inner, "blocks", None)
    if blocks is not None and not isinstance(blocks, nn.ModuleList):
        raise TypeError("gem.parallel: model.blocks must be an nn.ModuleList")
    if blocks is not None:
        apply_activation_checkpointing(blocks, ac_cfg.mode, ac_cfg.every)
    if compile_cfg.on(device):
        options = inductor_options(inner) if compile_cfg.backend == "inductor" else None
        apply_compile(inner, blocks, backend=compile_cfg.backend, **({"options": options} if options else {}))

    fp8_names: list[str] = []
    if cfg.dense == "fsdp":
        fp8_names = apply_fsdp(inner, blocks, dims, ignored_params=table_params, expert_modules=expert_modules,
                               param_dtype=param_dtype, reduce_dtype=reduce_dtype, fp8_all_gather=fp8_all_gather)
    elif dims.world_size > 1:
        ignore = set(_sharded_param_names(inner))
        dmp._dmp_wrapped_module = wrap_ddp(inner, ignore, device)

    table_ids = {id(p) for p in table_params}
    dense = [p for p in inner.parameters() if id(p) not in table_ids and p.requires_grad]
    return Parallelized(model=dmp, dims=dims, sparse_optimizer=emb.fused_optimizer, embeddings=emb,
                        inner=inner, _dense_params=dense, fp8_all_gather=fp8_names)


def _sharded_param_names(module: nn.Module, prefix: str = "") -> Iterator[str]:
    """Names of the parameters TorchRec shards (DDP must leave them alone), the way DMP names them."""
    from torchrec.distributed.model_parallel import get_unwrapped_module
    from torchrec.distributed.types import ShardedModule

    module = get_unwrapped_module(module)
    if isinstance(module, ShardedModule):
        yield from module.sharded_parameter_names(prefix)
        return
    for name, child in module.named_children():
        yield from _sharded_param_names(child, f"{prefix}.{name}" if prefix else name)


def _sharded_params(module: nn.Module) -> list[nn.Parameter]:
    from torchrec.distributed.types import ShardedModule

    out, seen = [], set()
    for m in module.modules():
        if isinstance(m, ShardedModule):
            for p in m.parameters():
                if id(p) not in seen:
                    seen.add(id(p))
                    out.append(p)
    return out
