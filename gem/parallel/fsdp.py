"""Dense data parallelism: FSDP2 (HSDP on a 2D mesh) per transformer block + root, or DDP over the world.

Embedding tables are left out of both (TorchRec owns them); expert weights (already split over "ep") are
FSDP-sharded over the dims left after ep, with the gradient divided by the whole data-parallel world.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor, Shard
from torch.nn.parallel import DistributedDataParallel

from gem.model.precision import BlockFP8Linear, BlockFP8ShardWeight
from gem.ops.fp8_block import BLOCK
from gem.parallel.dims import ParallelDims, dtype_of
from gem.parallel.expert import EXPERT_WEIGHTS

log = logging.getLogger("gem.parallel")
FP8_GATHER_BYTES = 1 + 4 / BLOCK**2  # an all-gathered E4M3 code and its share of its 128x128 tile's fp32 scale


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


def fp8_all_gather_reason(out_features: int, shard_ranks: int, reshard_after_forward: bool | int) -> str | None:
    """Why a BlockFP8Linear weight ([out_features, in_features]) of an FSDP2 unit sharded over `shard_ranks` is
    all-gathered in param_dtype rather than in FP8 (None: it is gathered in FP8; gem plan counts the same). FP8 needs every rank's row shard to be whole 128x128 tiles (the
    out features a multiple of 128 x shard_ranks: FSDP2's shards are then even), and a bool reshard_after_forward
    (FSDP2's hooks do not reshard a gathered subclass to a smaller group)."""
    n = out_features
    if n % (BLOCK * shard_ranks):
        return f"{n} out features do not split into whole {BLOCK}-row tiles over {shard_ranks} shards"
    if not isinstance(reshard_after_forward, bool):
        return f"reshard_after_forward={reshard_after_forward} (an int) needs the param_dtype all-gather"
    return None


def enable_fp8_all_gather(unit: nn.Module, shard_ranks: int, reshard_after_forward: bool | int,
                          prefix: str = "") -> tuple[list[str], list[str]]:
    """Before fully_shard(unit): make the weights of its BlockFP8Linear layers (those not in a unit sharded already)
    all-gather in FP8 where fp8_all_gather_reason allows. Returns (names gathered in FP8, 'name (reason)' of the
    others). Nothing changes on a single shard rank: there is nothing to gather."""
    on, off = [], []
    if shard_ranks <= 1:
        return on, off
    for name, m in unit.named_modules(prefix=prefix):
        if type(m) is not BlockFP8Linear or isinstance(m.weight, DTensor):
            continue
        w = m.weight
        reason = fp8_all_gather_reason(w.shape[0], shard_ranks, reshard_after_forward)
        if reason is not None:
            off.append(f"{name} ({reason})")
            continue
        if not isinstance(w.data, BlockFP8ShardWeight):
            m.weight = nn.Parameter(BlockFP8ShardWeight(w.data), requires_grad=w.requires_grad)
            m.register_state_dict_post_hook(_plain_weight_in_state_dict)
        on.append(name)
    return on, off


def _plain_weight_in_state_dict(module: nn.Module, state_dict: dict, prefix: str, local_metadata) -> None:
    """State dicts (checkpoints, DCP) hold the plain shard, sharing its storage: loads write into the weight."""
    key = prefix + "weight"
    v = state_dict.get(key)
    if isinstance(v, DTensor) and isinstance(v._local_tensor, BlockFP8ShardWeight):
        with torch.no_grad():
            state_dict[key] = DTensor.from_local(v._local_tensor.plain(), v.device_mesh, v.placements,
                                                 run_check=False, shape=v.shape, stride=v.stride())


def apply_fsdp(root: nn.Module, blocks: nn.ModuleList | None, dims: ParallelDims,
               ignored_params: Iterable[nn.Parameter], expert_modules: Iterable[nn.Module] = (),
               param_dtype: str = "fp32", reduce_dtype: str = "fp32", fp8_all_gather: bool = True) -> list[str]:
    """fully_shard the expert modules, then each block, then the root (which picks up the remaining dense
    params); `ignored_params` (the embedding tables) stay as they are. `param_dtype`, `reduce_dtype`: FSDP2's
    mixed precision (train.param_dtype / train.reduce_dtype). `fp8_all_gather`: BlockFP8Linear weights whose shards
    are whole 128x128 tiles all-gather in FP8 (enable_fp8_all_gather); returns their names."""
    c = dims.cfg
    mp = MixedPrecisionPolicy(param_dtype=dtype_of(param_dtype), reduce_dtype=dtype_of(reduce_dtype))
    mesh = dims.fsdp_mesh
    ignored = set(ignored_params)
    reshard = c.reshard_after_forward
    shard_ranks = mesh.size(mesh.ndim - 1)
    fp8_on, fp8_off = [], []

    def fp8(unit: nn.Module, unit_reshard: bool | int, prefix: str = "") -> None:
        if fp8_all_gather:
            on, off = enable_fp8_all_gather(unit, shard_ranks, unit_reshard, prefix)
            fp8_on.extend(on)
            fp8_off.extend(off)
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
            block_reshard = reshard if i < n - 1 else False
            fp8(block, block_reshard, f"blocks.{i}")
            fully_shard(block, mesh=mesh, mp_policy=mp, reshard_after_forward=block_reshard)
    fp8(root, reshard)
    fully_shard(root, mesh=mesh, mp_policy=mp, reshard_after_forward=reshard, ignored_params=ignored or None)
    if fp8_on:
        log.info("fp8_block: %d weights all-gather in FP8 (128x128-tile codes + scales)", len(fp8_on))
    if fp8_off:
        log.info("fp8_block: these weights all-gather in %s instead of FP8: %s", param_dtype, ", ".join(fp8_off))
    return fp8_on


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


def wrap_ddp(module: nn.Module, ignore_names: set[str], device: torch.device) -> DistributedDataParallel:
    """DDP over the whole world; the embedding tables (sharded by TorchRec) are ignored. Every dense parameter
    takes part in every step (MoE experts are stacked tensors, and a step where none gets a row still adds
    0 * their sum), so DDP need not search the graph for unused ones."""
    DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(module, sorted(ignore_names))
    return DistributedDataParallel(
        module,
        device_ids=None if device.type == "cpu" else [device],
        process_group=dist.group.WORLD,
        broadcast_buffers=False,
        gradient_as_bucket_view=True,
    )
