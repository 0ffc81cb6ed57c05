"""Dense data parallelism: FSDP2 (HSDP on a 2D mesh) per transformer block + root, or DDP over the world.

Embedding tables are left out of both (TorchRec owns them); expert weights (already split over "ep") are
FSDP-sharded over the dims left after ep, with the gradient divided by the whole data-parallel world.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import Shard
from torch.nn.parallel import DistributedDataParallel

from gem.parallel.dims import ParallelDims, dtype_of
from gem.parallel.expert import EXPERT_WEIGHTS


def apply_activation_checkpointing(blocks: nn.ModuleList, mode: str, every: int) -> None:
    """none | full (every block) | selective (every `every`-th block); recomputes the block in backward."""
    if mode == "none":
        return
    for i, block in enumerate(blocks):
        if mode == "full" or i % every == 0:
            blocks[i] = checkpoint_wrapper(block, preserve_rng_state=False)


def apply_compile(model: nn.Module, blocks: nn.ModuleList | None, **compile_kwargs) -> None:
    """Compile each block's dense parts on its own (regional compilation): the blocks repeat, so their graphs are
    shared; the attention kernels and FSDP's hooks stay outside the graphs. The model's own regions too."""
    if hasattr(model, "compile_regions"):
        model.compile_regions(**compile_kwargs)
    for block in blocks or ():
        inner = getattr(block, "_checkpoint_wrapped_module", block)
        if hasattr(inner, "compile_regions"):
            inner.compile_regions(**compile_kwargs)
        else:
            block.compile(**compile_kwargs)


def apply_fsdp(root: nn.Module, blocks: nn.ModuleList | None, dims: ParallelDims,
               ignored_params: Iterable[nn.Parameter], expert_modules: Iterable[nn.Module] = (),
               param_dtype: str = "fp32", reduce_dtype: str = "fp32") -> None:
    """fully_shard the expert modules, then each block, then the root (which picks up the remaining dense
    params); `ignored_params` (the embedding tables) stay as they are. `param_dtype`, `reduce_dtype`: FSDP2's
    mixed precision (train.param_dtype / train.reduce_dtype)."""
    c = dims.cfg
    mp = MixedPrecisionPolicy(param_dtype=dtype_of(param_dtype), reduce_dtype=dtype_of(reduce_dtype))
    mesh = dims.fsdp_mesh
    ignored = set(ignored_params)
    reshard = c.reshard_after_forward
    expert_mesh = dims.expert_fsdp_mesh
    for m in expert_modules:
        few = m.num_experts // dims.ep < expert_mesh.size()
        expert_ids = {id(getattr(m, n)) for n in EXPERT_WEIGHTS}

        def place(p, _ids=expert_ids, _few=few):
            # too few local experts to split over the fsdp ranks: shard their hidden dim instead
            return Shard(1) if _few and id(p) in _ids else None

        # The MoE is one unit over the dims left after ep (its router weight is read inside MoE.forward, so it
        # cannot be a unit of its own). Expert grads already sum the tokens of the whole ep group; the router's
        # are summed over ep by a hook before FSDP reduces; FSDP then divides both by the full dp world.
        fully_shard(m, mesh=expert_mesh, mp_policy=mp, reshard_after_forward=reshard, shard_placement_fn=place)
        m.set_gradient_divide_factor(float(dims.dp_world))
        shard_ranks = expert_mesh.size(expert_mesh.ndim - 1)
        if dist.get_backend() != "nccl" and 1 < shard_ranks != dims.dp_world:
            # FSDP would reduce-scatter with PREMUL_SUM(1 / factor), which only NCCL has: sum, then divide. (Not on
            # one shard rank: FSDP divides there already and would divide twice.)
            m.set_force_sum_reduction_for_comms(True)
        _sum_router_grad_over(m, dims.ep_pg)
    if blocks is not None:
        n = len(blocks)
        for i, block in enumerate(blocks):
            # the last block's params are needed again right at the start of backward
            fully_shard(block, mesh=mesh, mp_policy=mp, reshard_after_forward=reshard if i < n - 1 else False)
    fully_shard(root, mesh=mesh, mp_policy=mp, reshard_after_forward=reshard, ignored_params=ignored or None)


def _sum_router_grad_over(moe: nn.Module, group: dist.ProcessGroup) -> None:
    """Before FSDP reduces it, sum the (unsharded) router weight's gradient over `group`."""
    handle: list = [None]

    def all_reduce_sum(g: torch.Tensor) -> torch.Tensor:
        out = g.float().clone()
        dist.all_reduce(out, group=group)
        return out.to(g.dtype)

    def pre_forward(module: nn.Module, args) -> None:
        # runs after FSDP's pre-forward (registered later): router.weight is now the unsharded parameter
        if handle[0] is not None:
            handle[0].remove()
        w = module.router.weight
        handle[0] = w.register_hook(all_reduce_sum) if w.requires_grad else None

    moe.register_forward_pre_hook(pre_forward)


def wrap_ddp(module: nn.Module, ignore_names: set[str], device: torch.device,
             find_unused_parameters: bool) -> DistributedDataParallel:
    """DDP over the whole world; the embedding tables (sharded by TorchRec) are ignored."""
    DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(module, sorted(ignore_names))
    return DistributedDataParallel(
        module,
        device_ids=None if device.type == "cpu" else [device],
        process_group=dist.group.WORLD,
        broadcast_buffers=False,
        gradient_as_bucket_view=True,
        find_unused_parameters=find_unused_parameters,
    )
