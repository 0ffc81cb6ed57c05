"""Dense AdamW with linear warmup + cosine decay and gradient clipping, combined with the fused sparse optimizer.

Sparse (embedding) parameters are updated inside backward by fbgemm's fused optimizer (gem.parallel builds it);
`TrainOptimizer` steps the dense AdamW and exposes one keyed state dict for both, so checkpoints hold every
optimizer state under parameter names.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

import torch
from torch.distributed.tensor import DTensor
from torchrec.optim.keyed import CombinedOptimizer, KeyedOptimizer, KeyedOptimizerWrapper


@dataclass(frozen=True)
class WarmupCosine:
    """lr(step) = base * factor(step): linear warmup over `warmup_steps`, then cosine down to `min_ratio`."""

    base_lr: float
    warmup_steps: int
    total_steps: int
    min_ratio: float = 0.0

    def factor(self, step: int) -> float:
        if step < self.warmup_steps:
            return (step + 1) / self.warmup_steps
        decay_steps = max(self.total_steps - self.warmup_steps, 1)
        progress = min(max(step - self.warmup_steps, 0) / decay_steps, 1.0)
        return self.min_ratio + (1.0 - self.min_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))

    def __call__(self, step: int) -> float:
        return self.base_lr * self.factor(step)


def grad_norm(params: Iterable[torch.Tensor]) -> torch.Tensor:
    """Global L2 norm of the gradients; DTensor gradients are reduced over their own meshes (one group each)."""
    groups: dict[object, list] = {}
    for p in params:
        if p.grad is not None:
            key = p.grad.device_mesh if isinstance(p.grad, DTensor) else None
            groups.setdefault(key, []).append(p.grad)
    if not groups:
        return torch.zeros(())
    squares = []
    for grads in groups.values():
        norm = torch.nn.utils.get_total_norm(grads, norm_type=2.0)
        if isinstance(norm, DTensor):
            norm = norm.full_tensor()
        squares.append(norm.float() ** 2)
    device = squares[0].device
    return torch.sqrt(torch.stack([s.to(device) for s in squares]).sum())


def clip_grad_norm_(params: Iterable[torch.Tensor], max_norm: float) -> torch.Tensor:
    """Scale gradients so their global norm is at most `max_norm` (0 = no clipping); returns the norm before.

    Unlike torch's clip_grad_norm_, works on a mix of plain and DTensor gradients on different meshes.
    """
    params = [p for p in params if p.grad is not None]
    total = grad_norm(params)
    if max_norm > 0 and params:
        coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
        grads: dict[tuple, list[torch.Tensor]] = {}
        for p in params:
            g = p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad
            grads.setdefault((g.device, g.dtype), []).append(g)
        for (device, dtype), gs in grads.items():
            torch._foreach_mul_(gs, coef.to(device=device, dtype=dtype))
    return total


NamedParams = Mapping[str, torch.nn.Parameter] | Iterable[tuple[str, torch.nn.Parameter]]


class TrainOptimizer:
    """Dense AdamW (scheduled, clipped) + fused sparse optimizer behind one `zero_grad()` / `step()`.

    `step()` sets the scheduled learning rate, clips dense gradients, then steps both optimizers (the fused
    sparse step is a no-op: its update already happened in backward). Usable as the optimizer of torchrec's
    train pipelines.
    """

    def __init__(
        self,
        dense_params: NamedParams,
        sparse_optimizer: KeyedOptimizer | None,
        *,
        lr: float,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0.0,
        warmup_steps: int = 0,
        total_steps: int = 1,
        min_lr_ratio: float = 0.0,
        grad_clip: float = 0.0,
        fused: bool | None = None,
    ) -> None:
        named: dict[str, torch.nn.Parameter] = dict(
            dense_params.items() if isinstance(dense_params, Mapping) else dense_params
        )
        named = {k: p for k, p in named.items() if p.requires_grad}
        self.dense_params = named
        self.schedule = WarmupCosine(lr, warmup_steps, total_steps, min_lr_ratio)
        self.grad_clip = grad_clip
        self.step_count = 0  # number of completed optimizer steps (drives the schedule)
        self.last_grad_norm: torch.Tensor | None = None
        self._adamw: torch.optim.AdamW | None = None
        self._fused = False
        optimizers = []
        if named:
            # The fused kernel when every parameter is a plain CUDA tensor (one launch per few tensors); foreach
            # otherwise, which handles DTensors on several meshes (it groups by device and dtype only).
            if fused is None:
                fused = all(p.is_cuda and not isinstance(p, DTensor) for p in named.values())
            self._fused = bool(fused)
            self._dense = KeyedOptimizerWrapper(
                named,
                lambda ps: torch.optim.AdamW(ps, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay,
                                             fused=fused or None),
            )
            self._adamw = self._dense._optimizer
            optimizers.append(("dense", self._dense))
        if sparse_optimizer is not None:
            optimizers.append(("sparse", sparse_optimizer))
        self.combined = CombinedOptimizer(optimizers)
        self._set_lr()

    # -- schedule ---------------------------------------------------------------------------------------------
    @property
    def lr(self) -> float:
        return self.schedule(self.step_count)

    @property
    def last_lr(self) -> float:
        """The learning rate the latest step used."""
        return self.schedule(max(self.step_count - 1, 0))

    def _set_lr(self) -> None:
        if self._adamw is not None:
            for group in self._adamw.param_groups:
                group["lr"] = self.lr

    # -- torch.optim.Optimizer-like surface ------------------------------------------------------------------
    @property
    def param_groups(self):
        return self.combined.param_groups

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.combined.zero_grad(set_to_none=set_to_none)

    def step(self, closure=None) -> None:
        self._set_lr()
        if self._fused:
            # The fused kernel divides each gradient by `grad_scale` inside its own pass (and stores the clipped
            # gradient back, as the foreach path leaves it): no separate read-scale-write pass over the gradients.
            total = grad_norm(self.dense_params.values())
            if self.grad_clip > 0:
                self._adamw.grad_scale = torch.clamp((total.float() + 1e-6) / self.grad_clip, min=1.0)
            self.last_grad_norm = total
        else:
            self.last_grad_norm = clip_grad_norm_(self.dense_params.values(), self.grad_clip)
        try:
            self.combined.step()
        finally:
            if self._adamw is not None:
                self._adamw.grad_scale = None
        self.step_count += 1
        self._set_lr()

    # -- checkpoint state ------------------------------------------------------------------------------------
    def init_state(self) -> None:
        """Materialise AdamW's lazy state without changing parameters, so a checkpoint can load into it."""
        if self._adamw is None or len(self._adamw.state) > 0:
            return
        saved = [g["lr"] for g in self._adamw.param_groups]
        grads = {k: p.grad for k, p in self.dense_params.items()}
        for p in self.dense_params.values():
            p.grad = torch.zeros_like(p)
        for g in self._adamw.param_groups:
            g["lr"] = 0.0  # lr 0: neither the update nor the decoupled weight decay touches the parameters
        self._adamw.step()
        for g, lr in zip(self._adamw.param_groups, saved):
            g["lr"] = lr
        for k, p in self.dense_params.items():
            p.grad = grads[k]

    def state_dict(self) -> dict[str, object]:
        return self.combined.state_dict()

    def load_state_dict(self, state: Mapping[str, object], step_count: int) -> None:
        self.combined.load_state_dict(state)
        self.step_count = step_count
        self._set_lr()
