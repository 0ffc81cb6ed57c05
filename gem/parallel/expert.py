"""Expert parallelism: experts split over the "ep" ranks, tokens exchanged with all-to-all (uneven splits).

`AllToAllDispatcher` implements gem.model.moe's dispatcher interface. dispatch: exchange the per-expert counts
(one small all_to_all), send each rank the rows of the experts it owns (differentiable all_to_all with uneven
splits), regroup the received rows by local expert. combine: undo the regrouping, send the rows back.
The expert weights w1/w3/w2 [E, ...] become DTensors sharded on dim 0 over the ep mesh (E/ep experts per rank);
FSDP2 then shards them further over ("dp_replicate", "dp_shard_mod_ep").
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed._functional_collectives import all_to_all_single_autograd
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard

from gem.parallel.dims import ParallelConfigError, ParallelDims

EXPERT_WEIGHTS = ("w1", "w3", "w2")


class AllToAllDispatcher:
    def __init__(self, group: dist.ProcessGroup):
        self.group = group
        self.ep = dist.get_world_size(group)
        self.ep_rank = dist.get_rank(group)

    def local_expert_range(self, num_experts: int) -> tuple[int, int]:
        if num_experts % self.ep:
            raise ValueError(f"num_experts={num_experts} is not divisible by the expert-parallel degree {self.ep}")
        count = num_experts // self.ep
        return self.ep_rank * count, count

    def dispatch(self, x_sorted: torch.Tensor, tokens_per_expert: torch.Tensor):
        ep = self.ep
        e_local = tokens_per_expert.numel() // ep
        send_counts = tokens_per_expert.reshape(ep, e_local).to(torch.int64)
        recv_counts = torch.empty_like(send_counts)
        # recv_counts[src, e]: rows rank `src` sends to this rank's local expert e
        dist.all_to_all_single(recv_counts, send_counts.contiguous(), group=self.group)
        # one device->host copy (one sync) for the splits and the rows per local expert
        host = torch.cat((send_counts.flatten(), recv_counts.flatten())).tolist()
        send_h, recv_h = host[:ep * e_local], host[ep * e_local:]
        in_splits = [sum(send_h[r * e_local:(r + 1) * e_local]) for r in range(ep)]
        out_splits = [sum(recv_h[r * e_local:(r + 1) * e_local]) for r in range(ep)]
        local_sizes = [sum(recv_h[r * e_local + e] for r in range(ep)) for e in range(e_local)]
        x_recv = all_to_all_single_autograd(x_sorted, out_splits, in_splits, self.group)
        # received rows are grouped by (src rank, local expert): regroup by local expert, src order kept
        # output_size from the host counts: repeat_interleave would otherwise sync to learn it
        expert_of_row = torch.repeat_interleave(
            torch.arange(e_local, device=x_sorted.device).repeat(ep), recv_counts.flatten().to(x_sorted.device),
            output_size=sum(out_splits),
        )
        perm = torch.argsort(expert_of_row, stable=True)
        x_local = x_recv[perm]
        ctx = (perm, in_splits, out_splits, x_local, local_sizes)
        return x_local, recv_counts.sum(0), ctx

    def host_sizes(self, ctx: Any) -> list[int]:
        return ctx[4]

    def combine(self, y_local: torch.Tensor, ctx: Any) -> torch.Tensor:
        perm, in_splits, out_splits, x_local, _ = ctx
        if y_local.shape[0] == 0 and x_local.requires_grad:
            # no rows came here: keep dispatch's all-to-all in this rank's autograd graph anyway, or its
            # backward collective would run on the other ranks only and hang them
            y_local = y_local + 0.0 * x_local.sum()
        y_recv = torch.empty_like(y_local).index_copy(0, perm, y_local)  # inverse of x_recv[perm]
        return all_to_all_single_autograd(y_recv, in_splits, out_splits, self.group)


def find_moe_modules(model: nn.Module) -> list[nn.Module]:
    """The MoE layers whose dispatcher expert parallelism swaps (gem.model.moe.MoE)."""
    try:
        from gem.model.moe import MoE
    except ImportError:  # pragma: no cover
        return []
    return [m for m in model.modules() if isinstance(m, MoE)]


def shard_expert_weights(moe: nn.Module, ep_mesh: DeviceMesh) -> None:
    """Replace w1/w3/w2 [E, ...] by DTensors Shard(0) over `ep_mesh`, keeping this rank's experts' values."""
    ep_rank, ep = ep_mesh.get_local_rank(), ep_mesh.size()
    for name in EXPERT_WEIGHTS:
        w = getattr(moe, name)
        e = w.shape[0]
        count = e // ep
        local = w.detach()[ep_rank * count:(ep_rank + 1) * count].clone()
        dt = DTensor.from_local(local, ep_mesh, [Shard(0)], run_check=False, shape=w.shape, stride=w.stride())
        setattr(moe, name, nn.Parameter(dt, requires_grad=w.requires_grad))


def apply_expert_parallel(moes: list[nn.Module], dims: ParallelDims) -> list[nn.Module]:
    """Swap in all-to-all dispatchers and shard the expert weights over ep; returns the modules whose (expert)
    parameters FSDP should shard over the expert mesh."""
    if dims.ep == 1:
        return []
    if not moes:
        raise ParallelConfigError(f"parallel.ep={dims.ep}: the model has no MoE layer")
    ep_mesh = dims.expert_mesh["ep"]
    group = dims.ep_pg
    for m in moes:
        if m.num_experts % dims.ep:
            raise ParallelConfigError(f"parallel.ep={dims.ep}: does not divide num_experts={m.num_experts}")
        m.dispatcher = AllToAllDispatcher(group)
        shard_expert_weights(m, ep_mesh)
    return moes
