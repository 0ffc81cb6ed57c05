"""Per-task evaluation metrics: NE, AUC, calibration, log-loss, aggregated over all ranks.

NE and calibration use torchrec.metrics' state/compute functions on globally summed states. torchrec's AUC
orders tied predictions arbitrarily, so AUC here is the exact Mann-Whitney statistic with averaged tie ranks,
computed on the predictions gathered from every rank.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
import torch.distributed as dist
from torchrec.metrics.calibration import compute_calibration, get_calibration_states
from torchrec.metrics.ne import compute_ne, get_ne_states

ETA = 1e-12


def auc_with_ties(predictions: torch.Tensor, labels: torch.Tensor) -> float:
    """ROC AUC of one task; tied predictions count one half. 0.5 when only one class is present."""
    predictions = predictions.reshape(-1).double()
    labels = labels.reshape(-1).double()
    num_pos = float(labels.sum())
    num_neg = float(labels.numel() - num_pos)
    if num_pos == 0 or num_neg == 0:
        return 0.5
    sorted_preds, order = torch.sort(predictions)
    _, inverse, counts = torch.unique_consecutive(sorted_preds, return_inverse=True, return_counts=True)
    # Average 1-based rank of each group of equal predictions.
    ends = torch.cumsum(counts, 0).double()
    avg_rank = ends - (counts.double() - 1.0) / 2.0
    ranks = avg_rank[inverse]
    pos_rank_sum = float((ranks * labels[order]).sum())
    return (pos_rank_sum - num_pos * (num_pos + 1.0) / 2.0) / (num_pos * num_neg)


def gauc_with_ties(predictions: torch.Tensor, labels: torch.Tensor, groups: torch.Tensor) -> tuple[float, int]:
    """Group AUC: the AUC of each group (a request or a user; ties count one half) averaged with the group's
    impression count as its weight, over groups that hold both classes (as torchrec's GAUC skips one-class
    groups; unlike it, a group of tied predictions counts 0.5 instead of being dropped). Returns (gauc, groups
    counted); (0.5, 0) when no group holds both classes."""
    predictions = predictions.reshape(-1).double()
    labels = labels.reshape(-1).double()
    groups = groups.reshape(-1).to(torch.int64)
    if not predictions.numel() == labels.numel() == groups.numel():
        raise ValueError(f"gauc: {predictions.numel()} predictions, {labels.numel()} labels, {groups.numel()} groups")
    if predictions.numel() == 0:
        return 0.5, 0
    # Sort by group, then prediction; rank inside the group with tied predictions sharing their average rank.
    by_pred = torch.argsort(predictions, stable=True)
    order = by_pred[torch.argsort(groups[by_pred], stable=True)]
    g, p, y = groups[order], predictions[order], labels[order]
    _, group_idx, group_size = torch.unique_consecutive(g, return_inverse=True, return_counts=True)
    group_start = torch.cumsum(group_size, 0) - group_size
    starts = torch.ones_like(g, dtype=torch.bool)
    starts[1:] = (g[1:] != g[:-1]) | (p[1:] != p[:-1])  # compared apart: 64-bit ids don't fit a float64 key
    tie_idx = torch.cumsum(starts, 0) - 1
    tie_size = torch.bincount(tie_idx)
    tie_end = torch.cumsum(tie_size, 0).double()  # 1-based position of each tie run's last element
    avg_pos = tie_end - (tie_size.double() - 1.0) / 2.0
    rank = avg_pos[tie_idx] - group_start[group_idx].double()
    n_groups = group_size.numel()
    num_pos = torch.zeros(n_groups, dtype=torch.float64).index_add_(0, group_idx, y)
    num_neg = group_size.double() - num_pos
    pos_rank_sum = torch.zeros(n_groups, dtype=torch.float64).index_add_(0, group_idx, rank * y)
    valid = (num_pos > 0) & (num_neg > 0)
    if not bool(valid.any()):
        return 0.5, 0
    auc = (pos_rank_sum[valid] - num_pos[valid] * (num_pos[valid] + 1.0) / 2.0) / (num_pos[valid] * num_neg[valid])
    weight = group_size[valid].double()
    return float((auc * weight).sum() / weight.sum()), int(valid.sum())


def _all_gather_rows(t: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
    """Concatenate `t` [n_i, k] from every rank along dim 0 (n_i may differ per rank)."""
    world = dist.get_world_size(group)
    n = torch.tensor([t.shape[0]], dtype=torch.int64, device=t.device)
    sizes = [torch.zeros_like(n) for _ in range(world)]
    dist.all_gather(sizes, n, group=group)
    sizes_l = [int(s) for s in sizes]
    longest = max(sizes_l)
    padded = torch.zeros((longest,) + tuple(t.shape[1:]), dtype=t.dtype, device=t.device)
    padded[: t.shape[0]] = t
    out = [torch.empty_like(padded) for _ in range(world)]
    dist.all_gather(out, padded, group=group)
    return torch.cat([o[:s] for o, s in zip(out, sizes_l)], dim=0)


class TaskMetrics:
    """Accumulates predictions and labels of a pass; `compute()` returns global metrics per task.

    Keys: `<task>/ne`, `<task>/auc`, `<task>/calibration`, `<task>/logloss` (natural log), plus `num_samples`;
    `<task>/gauc` too when every update passed `groups` (the request or user of each row).
    """

    def __init__(self, tasks: Sequence[str], process_group: dist.ProcessGroup | None = None) -> None:
        if len(tasks) == 0:
            raise ValueError("TaskMetrics needs at least one task")
        self.tasks = list(tasks)
        self.process_group = process_group
        self._preds: list[torch.Tensor] = []
        self._labels: list[torch.Tensor] = []
        self._groups: list[torch.Tensor | None] = []

    def reset(self) -> None:
        self._preds.clear()
        self._labels.clear()
        self._groups.clear()

    @torch.no_grad()
    def update(self, logits: torch.Tensor, labels: torch.Tensor, groups: torch.Tensor | None = None) -> None:
        """`logits`, `labels`: [B, num_tasks]; predictions are sigmoid(logits); `groups`: [B] int ids for GAUC."""
        if logits.dim() != 2 or logits.shape != labels.shape or logits.shape[1] != len(self.tasks):
            raise ValueError(
                f"metrics expect logits and labels of shape [B, {len(self.tasks)}], got "
                f"{tuple(logits.shape)} and {tuple(labels.shape)}"
            )
        self._preds.append(torch.sigmoid(logits.detach().double()).cpu())
        self._labels.append(labels.detach().double().cpu())
        if groups is not None and groups.shape != (logits.shape[0],):
            raise ValueError(f"metrics expect groups of shape [{logits.shape[0]}], got {tuple(groups.shape)}")
        self._groups.append(None if groups is None else groups.detach().to(torch.int64).cpu())

    def _gathered(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        k = len(self.tasks)
        preds = torch.cat(self._preds) if self._preds else torch.zeros(0, k, dtype=torch.float64)
        labels = torch.cat(self._labels) if self._labels else torch.zeros(0, k, dtype=torch.float64)
        with_groups = bool(self._groups) and all(g is not None for g in self._groups)
        groups = torch.cat(self._groups) if with_groups else None  # type: ignore[arg-type]
        if dist.is_available() and dist.is_initialized() and dist.get_world_size(self.process_group) > 1:
            backend = dist.get_backend(self.process_group)
            device = torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else torch.device("cpu")
            both = _all_gather_rows(torch.cat([preds, labels], dim=1).to(device), self.process_group).cpu()
            preds, labels = both[:, :k], both[:, k:]
            if groups is not None:  # int64 ids gathered apart: a float64 column would round ids above 2**53
                groups = _all_gather_rows(groups[:, None].to(device), self.process_group).cpu()[:, 0]
        return preds, labels, groups

    @torch.no_grad()
    def compute(self) -> dict[str, float]:
        preds, labels, groups = self._gathered()
        out: dict[str, float] = {"num_samples": float(preds.shape[0])}
        # torchrec's state functions reduce over the last dim: [tasks, N].
        p, y = preds.t().contiguous(), labels.t().contiguous()
        w = torch.ones_like(p)
        ne_states = get_ne_states(y, p.clone(), w, ETA)
        ne = compute_ne(
            ne_states["cross_entropy_sum"],
            ne_states["weighted_num_samples"],
            ne_states["pos_labels"],
            ne_states["neg_labels"],
            ETA,
        )
        cal_states = get_calibration_states(y, p, w)
        cal = compute_calibration(cal_states["calibration_num"], cal_states["calibration_denom"])
        n = max(preds.shape[0], 1)
        for i, task in enumerate(self.tasks):
            # torchrec's cross entropy is in bits; log-loss is reported in nats.
            out[f"{task}/logloss"] = float(ne_states["cross_entropy_sum"][i]) * math.log(2.0) / n
            out[f"{task}/ne"] = float(ne[i])
            out[f"{task}/calibration"] = float(cal[i])
            out[f"{task}/auc"] = auc_with_ties(p[i], y[i])
            if groups is not None:
                out[f"{task}/gauc"] = gauc_with_ties(p[i], y[i], groups)[0]
        return out
