"""Multi-task heads (one MLP per task -> one logit each) and the weighted multi-task BCE loss."""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn


def mlp(in_dim: int, hidden: Sequence[int], out_dim: int | None = None) -> nn.Sequential:
    """Linear+SiLU per hidden size; a last plain Linear to out_dim when given."""
    layers: list[nn.Module] = []
    d = in_dim
    for h in hidden:
        layers += [nn.Linear(d, h), nn.SiLU()]
        d = h
    if out_dim is not None:
        layers.append(nn.Linear(d, out_dim))
    return nn.Sequential(*layers)


def mlp_out_dim(in_dim: int, hidden: Sequence[int]) -> int:
    return hidden[-1] if len(hidden) else in_dim


class MultiTaskHeads(nn.Module):
    """[B, in_dim] -> logits [B, num_tasks], one MLP per task."""

    def __init__(self, in_dim: int, tasks: Sequence[str], hidden: Sequence[int]):
        super().__init__()
        self.tasks = list(tasks)
        self.heads = nn.ModuleList([mlp(in_dim, hidden, 1) for _ in self.tasks])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat([h(x) for h in self.heads], dim=-1)


def multitask_loss(logits: torch.Tensor, labels: torch.Tensor, weights: Sequence[float] | torch.Tensor | None = None,
                   tasks: Sequence[str] | None = None) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Weighted sum of per-task mean BCE-with-logits.

    logits, labels [B, num_tasks]; weights [num_tasks] (None: all 1). Returns (total, {task: loss}) with tasks
    named by `tasks` (default "task0", "task1", ...); the per-task losses are unweighted.
    """
    if logits.shape != labels.shape or logits.dim() != 2:
        raise ValueError(f"logits {tuple(logits.shape)} and labels {tuple(labels.shape)} must both be [B, num_tasks]")
    n = logits.shape[1]
    names = list(tasks) if tasks is not None else [f"task{i}" for i in range(n)]
    if len(names) != n:
        raise ValueError(f"{len(names)} task names for {n} logit columns")
    w = torch.ones(n) if weights is None else torch.as_tensor(weights, dtype=torch.float32)
    if w.shape != (n,):
        raise ValueError(f"weights of shape {tuple(w.shape)} for {n} tasks")
    per = F.binary_cross_entropy_with_logits(logits.float(), labels.float(), reduction="none").mean(dim=0)
    total = (per * w.to(per.device)).sum()
    return total, {name: per[i] for i, name in enumerate(names)}


losses = multitask_loss
