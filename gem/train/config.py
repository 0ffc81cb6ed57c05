"""Typed `train:` config; every problem raises one TrainConfigError `train.<key>: <what> (got <value>)`."""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field
from typing import Any, Literal

from gem.config import Checker, ConfigError, build
from gem.model.precision import DEFAULT_FILTER

log = logging.getLogger("gem.train")


class TrainConfigError(ConfigError):
    """A `train:` config problem; the message names the key."""


@dataclass
class SparseOptimizerConfig:
    """The domain of `train.sparse_optimizer` (the embedding tables' fused fbgemm optimizer; gem.parallel builds it
    from the mapping); unset keys take gem.parallel's defaults."""

    name: Literal["rowwise_adagrad", "adagrad", "adam", "sgd"] = "rowwise_adagrad"
    lr: float | None = None
    eps: float | None = None
    weight_decay: float | None = None
    weight_decay_mode: Literal["l2", "decoupled"] | None = None  # rowwise_adagrad: l2 (default) or decoupled
    momentum: float | None = None  # only 0: fbgemm's fused sgd has no momentum
    betas: tuple[float, ...] | None = None


@dataclass
class CheckpointConfig:
    every: int = 0  # steps between checkpoints; 0: none (a final one is written when every > 0)
    dir: str | None = None  # None: <run dir>/checkpoints
    keep: int = 2  # newest complete checkpoints kept
    keep_steps: list[int] = field(default_factory=list)  # and these steps' checkpoints, always
    # write in the background (DCP async_save: the state is copied to host memory, training goes on); auto: on CUDA
    async_: Literal[True, False, "auto"] = "auto"


@dataclass
class MFUConfig:
    measure_peak: bool = False  # CUDA: time a bf16 matmul at start and report MFU against it too
    measured_peak_flops: float | None = None  # a known measured peak (FLOP/s), instead of measuring
    peak_flops: float | None = None  # the device's peak FLOP/s where the vendor table lacks it (e.g. CPU)
    # Exposed communication (local MFU, scaling ratio) on more than one rank: profile `comm_probe_steps` steps after
    # the first log window past train.warmup_steps, then every `comm_probe_every` windows; 0: never
    comm_probe_every: int = 10
    comm_probe_steps: int = 2


@dataclass
class TrainConfig:
    steps: int = 300
    seed: int = 0
    lr: float = 1e-3
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    weight_decay: float = 0.0
    warmup_steps: int = 20
    min_lr_ratio: float = 0.1
    grad_clip: float = 1.0
    aux_loss_weight: float = 1.0  # scales the model's aux (MoE load-balancing) loss
    sparse_optimizer: dict[str, Any] = field(default_factory=lambda: {"name": "rowwise_adagrad", "lr": 0.05})
    # -- precision: every numeric-format key of a run ----------------------------------------------------------------
    autocast: Literal["auto", "bf16", "none"] = "auto"  # auto: bf16 on CUDA, none on CPU
    # the tower GEMMs' format (gem/model/precision.py): bf16 (autocast decides) | fp8 (sm_89+) |
    # fp8_block (1x128 / 128x128 block-scaled E4M3 in all three GEMMs; cuBLAS on sm_90, else emulated) |
    # mxfp8 (MX tensor cores on sm_100+, else emulated)
    precision: Literal["bf16", "fp8", "fp8_block", "mxfp8"] = "bf16"
    # fnmatch patterns over module names: the nn.Linear modules `precision` converts
    precision_filter: list[str] = field(default_factory=lambda: list(DEFAULT_FILTER))
    fp8_backend: Literal["gem", "torchao"] = "gem"  # precision=fp8: gem's row-wise Linear or torchao's Float8Linear
    # FSDP2's mixed precision (parallel.dense=fsdp): the dtype parameters are all-gathered and computed in, and the
    # dtype gradients are reduced in; DDP keeps fp32 parameters and gradients
    param_dtype: Literal["fp32", "bf16", "fp16"] = "fp32"
    reduce_dtype: Literal["fp32", "bf16", "fp16"] = "fp32"
    # -----------------------------------------------------------------------------------------------------------------
    # auto: torchrec's TrainPipelineSparseDist on CUDA, the plain loop on CPU
    pipeline: Literal["auto", "sparse_dist", "none"] = "auto"
    log_every: int = 10
    eval_every: int = 100  # 0: evaluate only at the end
    check_finite: bool = True  # raise on a non-finite loss before backward (one host sync per step)
    stop_at_step: int | None = None  # end this run early (the schedule still spans `steps`), e.g. to split a job
    # true: continue from the newest complete checkpoint in the checkpoint dir | false: start fresh | auto: like
    # true when there is a checkpoint dir (a new run dir starts fresh, a torchrun restart reuses its run dir)
    resume: Literal[True, False, "auto"] = "auto"
    tensorboard: bool = True
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    mfu: MFUConfig = field(default_factory=MFUConfig)

    @classmethod
    def from_dict(cls, cfg: Any) -> TrainConfig:
        out = build(cls, cfg, "train", TrainConfigError)
        out.clamp_warmup()
        out.validate()
        return out

    def clamp_warmup(self) -> None:
        """A short run (`train.steps=8`) with a longer warmup: warm up over the whole run instead, and say so once."""
        if isinstance(self.steps, int) and self.steps >= 1 and self.warmup_steps > self.steps:
            _say_once(
                f"train.warmup_steps={self.warmup_steps} is longer than train.steps={self.steps}: "
                f"warming up over all {self.steps} steps"
            )
            self.warmup_steps = self.steps

    def validate(self) -> None:
        need = Checker("train", TrainConfigError).need
        need(self.steps >= 1, "steps", "must be >= 1", self.steps)
        need(self.lr > 0, "lr", "must be > 0", self.lr)
        need(len(self.betas) == 2 and all(0 <= b < 1 for b in self.betas), "betas", "need two values in [0, 1)",
             self.betas)
        need(self.eps > 0, "eps", "must be > 0", self.eps)
        need(self.weight_decay >= 0, "weight_decay", "must be >= 0", self.weight_decay)
        need(0 <= self.warmup_steps <= self.steps, "warmup_steps", f"must be in [0, train.steps={self.steps}]",
             self.warmup_steps)
        need(0 <= self.min_lr_ratio <= 1, "min_lr_ratio", "must be in [0, 1]", self.min_lr_ratio)
        need(self.grad_clip >= 0, "grad_clip", "must be >= 0 (0: no clipping)", self.grad_clip)
        need(self.aux_loss_weight >= 0, "aux_loss_weight", "must be >= 0", self.aux_loss_weight)
        need(self.log_every >= 1, "log_every", "must be >= 1", self.log_every)
        need(self.eval_every >= 0, "eval_every", "must be >= 0 (0: only at the end)", self.eval_every)
        if self.stop_at_step is not None:
            need(1 <= self.stop_at_step <= self.steps, "stop_at_step", f"must be in [1, train.steps={self.steps}]",
                 self.stop_at_step)
        need(self.checkpoint.every >= 0, "checkpoint.every", "must be >= 0 (0: no checkpoints)", self.checkpoint.every)
        need(self.checkpoint.keep >= 1, "checkpoint.keep", "must be >= 1", self.checkpoint.keep)
        need(all(s >= 1 for s in self.checkpoint.keep_steps), "checkpoint.keep_steps", "steps must be >= 1",
             self.checkpoint.keep_steps)
        if self.mfu.measured_peak_flops is not None:
            need(self.mfu.measured_peak_flops > 0, "mfu.measured_peak_flops", "must be > 0",
                 self.mfu.measured_peak_flops)
        if self.mfu.peak_flops is not None:
            need(self.mfu.peak_flops > 0, "mfu.peak_flops", "must be > 0", self.mfu.peak_flops)
        need(self.mfu.comm_probe_every >= 0, "mfu.comm_probe_every", "must be >= 0 (0: never)",
             self.mfu.comm_probe_every)
        need(self.mfu.comm_probe_steps >= 1, "mfu.comm_probe_steps", "must be >= 1", self.mfu.comm_probe_steps)
        so = build(SparseOptimizerConfig, self.sparse_optimizer, "train.sparse_optimizer", TrainConfigError)
        if so.lr is not None:
            need(so.lr > 0, "sparse_optimizer.lr", "must be > 0", so.lr)
        if so.eps is not None:
            need(so.eps > 0, "sparse_optimizer.eps", "must be > 0", so.eps)
        if so.weight_decay is not None:
            need(so.weight_decay >= 0, "sparse_optimizer.weight_decay", "must be >= 0", so.weight_decay)
            need(so.name not in ("sgd", "adagrad") or so.weight_decay == 0, "sparse_optimizer.weight_decay",
                 f"fbgemm's fused {so.name} has no weight decay (use rowwise_adagrad or adam)", so.weight_decay)
            need(so.name != "adam" or so.weight_decay_mode != "l2", "sparse_optimizer.weight_decay_mode",
                 "fbgemm's fused adam decays the weights decoupled (AdamW's); l2 is rowwise_adagrad's",
                 so.weight_decay_mode)
        if so.momentum is not None:
            need(so.momentum == 0, "sparse_optimizer.momentum", "fbgemm's fused sgd has no momentum (use adam or "
                 "rowwise_adagrad)", so.momentum)
        if so.betas is not None:
            need(so.name == "adam", "sparse_optimizer.betas", f"only adam takes betas, not {so.name}", so.betas)
            need(len(so.betas) == 2 and all(0 <= b < 1 for b in so.betas), "sparse_optimizer.betas",
                 "need two values in [0, 1)", so.betas)
        if so.eps is not None:
            need(so.name != "sgd", "sparse_optimizer.eps", "sgd takes no eps", so.eps)


_said: set[str] = set()


def _say_once(msg: str) -> None:
    """A warning printed once per process, by rank 0 only (the config is built more than once per run)."""
    if msg not in _said and os.environ.get("RANK", "0") == "0":
        _said.add(msg)
        log.warning(msg)


def check_device(cfgs: Any) -> None:
    """What this machine cannot run, as a config error before any rank starts (the pre-flight check runs on the
    ranks' own machine)."""
    import torch

    from gem.model.precision import check_precision_device

    kernel = cfgs.model.kernel
    if kernel == "triton" and not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1":
        raise ConfigError("model.kernel", "Triton kernels need a CUDA GPU (or TRITON_INTERPRET=1 to interpret "
                          "them on CPU, slowly)", kernel)
    from gem.parallel.embedding import check_sparse_optimizer_device

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    check_precision_device(cfgs.train.precision, device)
    check_sparse_optimizer_device(cfgs.train.sparse_optimizer, device)
