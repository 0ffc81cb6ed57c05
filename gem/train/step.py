"""One training step: forward, multitask loss, backward, optimizer step; and the two loops that drive it.

`train_step` is the whole step on a batch already on the device. `PlainLoop` feeds it batches one at a time;
`SparseDistLoop` hands the same forward + loss to torchrec's TrainPipelineSparseDist, which overlaps the next
batches' host-to-device copy and embedding input all-to-all with this step's compute and runs backward and the
optimizer itself. `choose_loop` picks one at start-up from `train.pipeline` and the device.
"""

from __future__ import annotations

import contextlib
import inspect
import logging
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from gem.data import Batch
from gem.model import losses

log = logging.getLogger("gem.train")


@dataclass(frozen=True)
class StepConfig:
    """What forward + loss needs besides the model and the batch."""

    tasks: Sequence[str]
    task_weights: Any  # per task, or None for equal weights
    aux_loss_weight: float = 1.0
    autocast_dtype: torch.dtype | None = None
    device_type: str = "cpu"
    check_finite: bool = True  # one host sync per step


@dataclass
class StepOutput:
    """The step's losses, detached and left on the device (reading them syncs the host)."""

    loss: torch.Tensor  # total: task loss + aux_loss_weight * aux loss
    task_loss: torch.Tensor
    aux_loss: torch.Tensor


def autocast(cfg: StepConfig):
    if cfg.autocast_dtype is None:
        return contextlib.nullcontext()
    return torch.autocast(device_type=cfg.device_type, dtype=cfg.autocast_dtype)


def forward_loss(model: nn.Module, batch: Batch, cfg: StepConfig, step: int) -> tuple[torch.Tensor, StepOutput]:
    """Forward and the multitask loss; (total loss to backward, detached losses). `step`: 1-based, for errors."""
    with autocast(cfg):
        out = model(batch)
    task_loss, _ = losses(out.logits.float(), batch.labels, cfg.task_weights, list(cfg.tasks))
    total = task_loss + cfg.aux_loss_weight * out.aux_loss.float()
    if cfg.check_finite and not bool(torch.isfinite(total)):
        # Before backward: the fused sparse optimizer updates the tables inside backward.
        raise FloatingPointError(f"non-finite loss {float(total)} at step {step}")
    return total, StepOutput(total.detach(), task_loss.detach(), out.aux_loss.detach())




class PhaseTimer:
    """Where each step's time goes, on the device's own timeline (CUDA events; the host clock elsewhere) and without
    a host sync per step: input (waiting for and copying the batch, the embeddings' input distribution), forward
    (with the loss), backward, optimizer. `window()` reads and clears the marks; it syncs, so call it where the host
    syncs anyway (the end of a log window)."""

    PHASES = (("input", "start", "forward_start"), ("forward", "forward_start", "forward_end"),
              ("backward", "forward_end", "optimizer_start"), ("optimizer", "optimizer_start", "optimizer_end"))

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        self._steps: list[dict[str, Any]] = []

    def mark(self, name: str) -> None:
        if name == "start":
            self._steps.append({})
        elif not self._steps:
            return
        if self.cuda:
            ev = torch.cuda.Event(enable_timing=True)
            ev.record()
            self._steps[-1][name] = ev
        else:
            self._steps[-1][name] = time.perf_counter()

    def window(self) -> dict[str, float]:
        """Mean milliseconds per step of each phase over the complete steps marked since the last call."""
        done = [s for s in self._steps if len(s) == 5]
        self._steps = []
        if not done:
            return {}
        if self.cuda:
            done[-1]["optimizer_end"].synchronize()
        out = {}
        for phase, a, b in self.PHASES:
            if self.cuda:
                total = sum(s[a].elapsed_time(s[b]) for s in done)
            else:
                total = 1e3 * sum(s[b] - s[a] for s in done)
            out[phase] = total / len(done)
        return out


class _TimedOptimizer:
    """The optimizer with its step marked on a PhaseTimer (torchrec's pipeline calls step() itself)."""

    def __init__(self, optimizer, timer: PhaseTimer | None) -> None:
        self._optimizer, self._timer = optimizer, timer

    def zero_grad(self, *args, **kwargs):
        return self._optimizer.zero_grad(*args, **kwargs)

    def step(self, *args, **kwargs):
        if self._timer is not None:
            self._timer.mark("optimizer_start")
        out = self._optimizer.step(*args, **kwargs)
        if self._timer is not None:
            self._timer.mark("optimizer_end")
        return out

    def __getattr__(self, name: str):
        return getattr(self._optimizer, name)


def _timed_forward(model: nn.Module, batch: Batch, cfg: StepConfig, step: int, timer: PhaseTimer | None):
    if timer is not None:
        timer.mark("forward_start")
    out = forward_loss(model, batch, cfg, step)
    if timer is not None:
        timer.mark("forward_end")
    return out


def train_step(model: nn.Module, optimizer, batch: Batch, cfg: StepConfig, step: int,
               timer: PhaseTimer | None = None) -> StepOutput:
    """One optimizer step on `batch` (on the device). The sparse optimizer is fused into the tables' backward."""
    optimizer.zero_grad()
    total, out = _timed_forward(model, batch, cfg, step, timer)
    total.backward()
    optimizer.step()
    return out


class PlainLoop:
    """Takes the next batch, copies it to the device and runs forward, backward and the optimizer step."""

    name = "plain"

    def __init__(self, model: nn.Module, optimizer, cfg: StepConfig, device: torch.device,
                 timer: PhaseTimer | None = None) -> None:
        self.model, self.cfg, self.device, self.timer = model, cfg, device, timer
        self.optimizer = _TimedOptimizer(optimizer, timer)

    def step(self, batches: Iterator[Batch], step: int) -> StepOutput:
        if self.timer is not None:
            self.timer.mark("start")
        batch = next(batches).to(self.device, non_blocking=True)
        return train_step(self.model, self.optimizer, batch, self.cfg, step, self.timer)

    @contextlib.contextmanager
    def paused(self):
        """Around evaluation: nothing to undo."""
        yield


class SparseDistLoop:
    """torchrec's TrainPipelineSparseDist running `forward_loss`; it pulls batches ahead of the step it runs."""

    name = "sparse_dist"

    def __init__(self, model: nn.Module, optimizer, cfg: StepConfig, device: torch.device,
                 timer: PhaseTimer | None = None) -> None:
        from torchrec.distributed.train_pipeline import TrainPipelineSparseDist

        self.model, self.cfg, self.timer = model, cfg, timer
        self._step = 0
        self._pipeline = TrainPipelineSparseDist(
            model, _TimedOptimizer(optimizer, timer), device, execute_all_batches=True,
            custom_model_fwd=self._forward,
        )

    def _forward(self, batch: Batch) -> tuple[torch.Tensor, StepOutput]:
        return _timed_forward(self.model, batch, self.cfg, self._step, self.timer)

    def step(self, batches: Iterator[Batch], step: int) -> StepOutput:
        self._step = step
        if self.timer is not None:
            self.timer.mark("start")
        return self._pipeline.progress(batches)

    @contextlib.contextmanager
    def paused(self):
        """Around evaluation: the sharded modules get their own forwards back, then the pipelined ones again."""
        self._pipeline.detach()
        try:
            yield
        finally:
            self._pipeline.attach(self.model)


def pipeline_unsupported() -> str | None:
    """Why this torchrec's TrainPipelineSparseDist cannot run the step (None: it can)."""
    from torchrec.distributed.train_pipeline import TrainPipelineSparseDist

    params = inspect.signature(TrainPipelineSparseDist.__init__).parameters
    if "custom_model_fwd" not in params or not hasattr(TrainPipelineSparseDist, "detach"):
        return "this torchrec's TrainPipelineSparseDist lacks custom_model_fwd/detach"
    return None


def choose_loop(pipeline: str, device: torch.device) -> tuple[type[PlainLoop | SparseDistLoop], str | None]:
    """The loop `train.pipeline` asks for on `device`, and why a requested pipeline is not used (None: it is, or
    none was requested). auto: the pipeline on CUDA, the plain loop elsewhere."""
    if pipeline == "none" or (pipeline == "auto" and device.type != "cuda"):
        return PlainLoop, None
    why = pipeline_unsupported()
    if why is not None:
        log.warning(f"pipeline: {why}; using the plain loop")
        return PlainLoop, why
    return SparseDistLoop, None
