"""Typed `train:` config; every problem raises one TrainConfigError whose message starts with the key."""

from __future__ import annotations

import dataclasses
import types
import typing
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

from gem._config import to_plain


class TrainConfigError(ValueError):
    """A `train:` config problem; the message names the key."""


@dataclass
class CheckpointConfig:
    every: int = 0  # steps between checkpoints; 0: none (a final one is written when every > 0)
    dir: str | None = None  # None: <run dir>/checkpoints
    keep: int = 2


@dataclass
class MFUConfig:
    measure_peak: bool = False  # CUDA: time a bf16 matmul at start and report MFU against it too
    measured_peak_flops: float | None = None  # a known measured peak (FLOP/s), instead of measuring
    single_device_mfu: float | None = None  # local MFU of a 1-device run: enables the scaling ratio


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
    autocast: str = "auto"  # auto: bf16 on CUDA, none on CPU | bf16 | none
    pipeline: str = "auto"  # auto: torchrec TrainPipelineSparseDist on CUDA, plain loop on CPU | sparse_dist | none
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
        data = to_plain(cfg)
        if not isinstance(data, Mapping):
            raise TrainConfigError(f"train: expected a mapping, got {type(data).__name__}")
        out = _build(cls, data, "train")
        out.validate()
        return out

    def validate(self) -> None:
        def need(ok: bool, key: str, msg: str) -> None:
            if not ok:
                raise TrainConfigError(f"train.{key}: {msg}")

        need(self.steps >= 1, "steps", f"must be >= 1, got {self.steps}")
        need(self.lr > 0, "lr", f"must be > 0, got {self.lr}")
        need(
            len(self.betas) == 2 and all(0 <= b < 1 for b in self.betas),
            "betas",
            f"need two values in [0, 1), got {list(self.betas)}",
        )
        need(self.eps > 0, "eps", f"must be > 0, got {self.eps}")
        need(self.weight_decay >= 0, "weight_decay", f"must be >= 0, got {self.weight_decay}")
        need(
            0 <= self.warmup_steps <= self.steps,
            "warmup_steps",
            f"must be in [0, train.steps={self.steps}], got {self.warmup_steps}",
        )
        need(0 <= self.min_lr_ratio <= 1, "min_lr_ratio", f"must be in [0, 1], got {self.min_lr_ratio}")
        need(self.grad_clip >= 0, "grad_clip", f"must be >= 0 (0: no clipping), got {self.grad_clip}")
        need(self.aux_loss_weight >= 0, "aux_loss_weight", f"must be >= 0, got {self.aux_loss_weight}")
        need(
            self.autocast in ("auto", "bf16", "none"), "autocast", f"must be auto, bf16 or none, got {self.autocast!r}"
        )
        need(
            self.pipeline in ("auto", "sparse_dist", "none"),
            "pipeline",
            f"must be auto, sparse_dist or none, got {self.pipeline!r}",
        )
        need(
            self.resume is True or self.resume is False or self.resume == "auto",
            "resume",
            f"must be {_one_of((True, False, 'auto'))}, got {self.resume!r}",
        )
        need(self.log_every >= 1, "log_every", f"must be >= 1, got {self.log_every}")
        need(self.eval_every >= 0, "eval_every", f"must be >= 0 (0: only at the end), got {self.eval_every}")
        if self.stop_at_step is not None:
            need(
                1 <= self.stop_at_step <= self.steps,
                "stop_at_step",
                f"must be in [1, train.steps={self.steps}], got {self.stop_at_step}",
            )
        need(
            self.checkpoint.every >= 0,
            "checkpoint.every",
            f"must be >= 0 (0: no checkpoints), got {self.checkpoint.every}",
        )
        need(self.checkpoint.keep >= 1, "checkpoint.keep", f"must be >= 1, got {self.checkpoint.keep}")
        need(
            isinstance(self.sparse_optimizer, Mapping) and "name" in self.sparse_optimizer,
            "sparse_optimizer",
            "needs a 'name'",
        )
        if self.mfu.measured_peak_flops is not None:
            need(self.mfu.measured_peak_flops > 0, "mfu.measured_peak_flops", "must be > 0")
        if self.mfu.single_device_mfu is not None:
            need(0 < self.mfu.single_device_mfu <= 1, "mfu.single_device_mfu", "must be in (0, 1]")


def _one_of(options) -> str:
    names = [str(o).lower() if isinstance(o, bool) else str(o) for o in options]
    return ", ".join(names[:-1]) + " or " + names[-1] if len(names) > 1 else names[0]


def _coerce(tp: Any, value: Any, key: str) -> Any:
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin in (typing.Union, types.UnionType):  # X | None
        if value is None and type(None) in args:
            return None
        return _coerce(next(a for a in args if a is not type(None)), value, key)
    if origin is typing.Literal:
        # compare types too: 1 == True, but `resume: 1` is not `resume: true`
        if any(type(value) is type(a) and value == a for a in args):
            return value
        raise TrainConfigError(f"{key}: must be {_one_of(args)}, got {value!r}")
    if value is None:
        raise TrainConfigError(f"{key}: must not be null")
    if dataclasses.is_dataclass(tp):
        if not isinstance(value, Mapping):
            raise TrainConfigError(f"{key}: expected a mapping, got {value!r}")
        return _build(tp, value, key)
    if origin is tuple:
        if not isinstance(value, (list, tuple)):
            raise TrainConfigError(f"{key}: expected a list, got {value!r}")
        return tuple(_coerce(args[0], v, key) for v in value)
    if origin is dict:
        if not isinstance(value, Mapping):
            raise TrainConfigError(f"{key}: expected a mapping, got {value!r}")
        return dict(value)
    if tp is bool:
        if not isinstance(value, bool):
            raise TrainConfigError(f"{key}: expected true/false, got {value!r}")
        return value
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise TrainConfigError(f"{key}: expected an integer, got {value!r}")
        return value
    if tp is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise TrainConfigError(f"{key}: expected a number, got {value!r}")
        return float(value)
    if tp is str:
        if not isinstance(value, str):
            raise TrainConfigError(f"{key}: expected a string, got {value!r}")
        return value
    return value


def _build(cls: type, data: Mapping, key: str) -> Any:
    hints = typing.get_type_hints(cls)
    fields = {f.name for f in dataclasses.fields(cls)}
    for k in data:
        if k not in fields:
            raise TrainConfigError(f"{key}.{k}: unknown key (expected one of {sorted(fields)})")
    kwargs = {name: _coerce(hints[name], data[name], f"{key}.{name}") for name in fields if name in data}
    return cls(**kwargs)
