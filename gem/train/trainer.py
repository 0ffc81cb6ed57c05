"""The Trainer: builds a run from the composed config and trains it.

Components: `train_step` and the loop that drives it (gem/train/step.py: plain, or torchrec's
TrainPipelineSparseDist, chosen once at start-up from `train.pipeline` and the device), the training batches
(gem/data/loader.py), evaluation (evaluator.py), checkpoints (checkpoint.py), metrics and logs (reporting.py),
stopping on a signal (stop.py).
Hooks: `hooks` run after every step (evaluation and checkpoint included) with the trainer (tests use one to kill
a rank); `on_step_end` run with the step number as soon as the step's work is queued, before the window's host sync
(the benchmark marks step ends there); `on_window` get each log window's scalars.
Rank 0 logs (console, TensorBoard, `<run dir>/metrics.jsonl`); every rank takes part in evaluation and
checkpoints.
"""

from __future__ import annotations

import logging
import math
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from gem.config import ConfigError
from gem.data import BadBatchError, DataConfig, TrainBatches, build_dataset
from gem.model import GEMModel, ModelConfig
from gem.model.flops import example_cost
from gem.model.precision import apply_precision
from gem.parallel import parallelize
from gem.parallel.dims import ActivationCheckpointConfig, CommConfig, CompileConfig, ParallelConfig, init_distributed
from gem.parallel.dims import validate as validate_parallel
from gem.parallel.embedding import check_zch_layout
from gem.train.checkpoint import Checkpointer, TrainCheckpointer, restart_count, run_config
from gem.train.config import TrainConfig
from gem.train.evaluator import Evaluator
from gem.train.metrics_log import TrainLogger
from gem.train.optim import TrainOptimizer
from gem.train.reporting import MetricsReporter
from gem.train.step import StepConfig, choose_loop
from gem.train.stop import StopSignals, StopVote

__all__ = ["BadBatchError", "Configs", "StepEndHook", "StepHook", "TrainResult", "Trainer", "WindowHook", "build_configs",
           "summary_line"]

StepHook = Callable[["Trainer"], None]
StepEndHook = Callable[[int], None]
WindowHook = Callable[[int, dict[str, float]], None]


@dataclass
class Configs:
    """The typed, cross-checked config groups of one run."""

    model: ModelConfig
    data: DataConfig
    parallel: ParallelConfig
    train: TrainConfig
    compile: CompileConfig = field(default_factory=CompileConfig)
    activation_checkpoint: ActivationCheckpointConfig = field(default_factory=ActivationCheckpointConfig)
    comm: CommConfig = field(default_factory=CommConfig)


def build_configs(cfg: Any, world_size: int | None = None) -> Configs:
    """Typed configs from the composed Hydra config; raises a ValueError naming the first bad key.

    `world_size`: when given, the parallel layout is checked against it too. The `compile`,
    `activation_checkpoint` and `comm` groups take their defaults where the config has none.
    """
    from omegaconf import OmegaConf

    for group in ("model", "data", "parallel", "train"):
        if group not in cfg or cfg[group] is None:
            raise ConfigError(group, "missing config group")
    # Raises MissingMandatoryValue naming the key for any `???` left.
    OmegaConf.to_container(cfg, resolve=True, throw_on_missing=True)
    data = DataConfig.from_dict(cfg.data)
    model = ModelConfig.from_dict(cfg.model, data.schema)
    parallel = ParallelConfig.from_any(cfg.parallel)
    if world_size is not None:
        parallel = validate_parallel(parallel, world_size)
        check_zch_layout([t.name for t in data.schema.tables if t.zch is not None], parallel, world_size)
    train = TrainConfig.from_dict(cfg.train)
    for t in data.schema.tables:  # a checkpoint between two id-map updates would drop the ids seen since the last
        k = t.zch.eviction_interval if t.zch is not None else 1
        for key, step in (("every", train.checkpoint.every), ("stop_at_step", train.stop_at_step or 0)):
            if step % k:
                name = f"train.checkpoint.{key}" if key == "every" else f"train.{key}"
                raise ConfigError(name, f"must be a multiple of data.tables.{t.name}.zch_eviction_interval={k}, so "
                                  "that checkpoints fall on the table's id-map updates", step)
    return Configs(model=model, data=data, parallel=parallel, train=train,
                   compile=CompileConfig.from_any(cfg.get("compile")),
                   activation_checkpoint=ActivationCheckpointConfig.from_any(cfg.get("activation_checkpoint")),
                   comm=CommConfig.from_any(cfg.get("comm")))


@dataclass
class TrainResult:
    steps: int  # steps done when the run ended (global step counter)
    losses: list[float] = field(default_factory=list)  # per step of this run (rank-local loss)
    eval_metrics: dict[str, float] = field(default_factory=dict)  # the last evaluation
    samples_per_s: float = 0.0
    run_dir: str | None = None
    last_checkpoint: str | None = None
    stopped_by: str | None = None  # the signal (e.g. 'SIGTERM') that stopped training early at `steps`


def _rank_world() -> tuple[int, int]:
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


class Trainer:
    """Builds everything from the composed config and trains; `fit()` returns a TrainResult."""

    def __init__(self, cfg: Configs | Any, run_dir: str | None = None, hooks: Sequence[StepHook] = (),
                 stop: StopSignals | None = None, on_step_end: Sequence[StepEndHook] = (),
                 on_window: Sequence[WindowHook] = ()) -> None:
        """`cfg`: the typed configs (as gem-train builds them) or a composed config; `stop`: the signals that stop
        training at a step boundary with a checkpoint (gem.train.stop)."""
        comm = cfg.comm if isinstance(cfg, Configs) else CommConfig.from_any(cfg.get("comm"))
        self.device = init_distributed(comm.timeout_s)
        self.rank, self.world_size = _rank_world()
        self.cfgs = cfg if isinstance(cfg, Configs) else build_configs(cfg, self.world_size)
        self.stop = stop
        tc = self.tcfg = self.cfgs.train
        self.run_dir = run_dir
        self.schema = self.cfgs.data.schema
        # zch tables keep the ids seen since their last id-map update outside the state dict: a stop on a signal
        # trains on to the next step where every such table updates, so its checkpoint resumes exactly
        self._stop_grid = math.lcm(1, *(t.zch.eviction_interval for t in self.schema.tables if t.zch is not None))
        self.tasks = list(self.schema.tasks)
        self.is_cuda = self.device.type == "cuda"
        self.hooks = list(hooks)
        self.on_step_end, self.on_window = list(on_step_end), list(on_window)

        # Same seed on every rank: parallelize needs identically initialised models.
        torch.manual_seed(tc.seed)
        model = GEMModel(self.cfgs.model, embedding_device=self.device)
        apply_precision(model, tc.precision, self.device, tc.precision_filter, tc.fp8_backend)
        self.par = parallelize(model, self.cfgs.parallel, compile_cfg=self.cfgs.compile,
                               ac_cfg=self.cfgs.activation_checkpoint, param_dtype=tc.param_dtype,
                               reduce_dtype=tc.reduce_dtype, sparse_optimizer_cfg=tc.sparse_optimizer,
                               device=self.device)
        self.model = self.par.model
        self.inner = self.par.inner
        fsdp_only = [f"train.{k}={getattr(tc, k)}" for k in ("param_dtype", "reduce_dtype") if getattr(tc, k) != "fp32"]
        if fsdp_only and self.cfgs.parallel.dense == "ddp":
            self._warn(f"{' and '.join(fsdp_only)}: FSDP2's mixed precision, unused here: parallel.dense="
                       f"{self.cfgs.parallel.dense} keeps fp32 parameters and gradients (train.autocast sets the "
                       "compute dtype)")
        torch.manual_seed(tc.seed + 1000003 * (self.rank + 1))  # per-rank stream for anything random in training

        # Names without wrapper prefixes, so optimizer-state keys don't depend on checkpointing/compile settings.
        self.optimizer = TrainOptimizer(
            list(self.par.dense_named_parameters().items()),
            self.par.sparse_optimizer,
            lr=tc.lr,
            betas=tuple(tc.betas),
            eps=tc.eps,
            weight_decay=tc.weight_decay,
            warmup_steps=tc.warmup_steps,
            total_steps=tc.steps,
            min_lr_ratio=tc.min_lr_ratio,
            grad_clip=tc.grad_clip,
        )
        self.autocast_dtype = None
        if tc.autocast == "bf16" or (tc.autocast == "auto" and self.is_cuda):
            self.autocast_dtype = torch.bfloat16
        self.step_cfg = StepConfig(
            tasks=self.tasks,
            task_weights=self.cfgs.model.task_weights,
            aux_loss_weight=tc.aux_loss_weight,
            autocast_dtype=self.autocast_dtype,
            device_type=self.device.type,
            check_finite=tc.check_finite,
        )
        # what fit() runs: PlainLoop or SparseDistLoop; `pipeline_fallback`: why a requested pipeline is not used
        self._loop_cls, self.pipeline_fallback = choose_loop(tc.pipeline, self.device)
        self.loop = self._loop_cls.name

        self.train_data = build_dataset(self.cfgs.data, self.rank, self.world_size, split="train",
                                        cost=example_cost(self.cfgs.model))
        eval_data = build_dataset(self.cfgs.data, self.rank, self.world_size, split="eval")
        self.evaluator = Evaluator(self.par, eval_data, self.schema, self.step_cfg, self.device)

        if run_dir and self.rank == 0:
            os.makedirs(run_dir, exist_ok=True)
        self.logger = TrainLogger(run_dir, enabled=self.rank == 0, tensorboard=tc.tensorboard)
        self.reporter = MetricsReporter(
            self.logger,
            self.optimizer,
            tc,
            run_dir=run_dir,
            rank=self.rank,
            world_size=self.world_size,
            device=self.device,
            tasks=self.tasks,
            global_batch=self.cfgs.data.batch_size * self.world_size,
        )

        ckpt_dir = tc.checkpoint.dir or (os.path.join(run_dir, "checkpoints") if run_dir else None)
        if (tc.checkpoint.every > 0 or tc.resume is True) and ckpt_dir is None:
            raise ConfigError("train.checkpoint.dir", "checkpoints need a directory (no run directory to default to)")
        self.checkpointer = None
        if ckpt_dir:
            background = tc.checkpoint.async_ is True or (tc.checkpoint.async_ == "auto" and self.is_cuda)
            self.checkpointer = TrainCheckpointer(
                Checkpointer(ckpt_dir, keep=tc.checkpoint.keep, keep_steps=tc.checkpoint.keep_steps,
                             config=run_config(self.cfgs), async_save=background),
                self.par,
                self.optimizer,
                rank=self.rank,
                world_size=self.world_size,
                device=self.device,
                info=self.logger.info,
                warn=self._warn,
                batch_size=self.cfgs.data.batch_size,
            )

        self.step = 0  # optimizer steps done
        # This rank's data position is step + offset: one batch per step (prefetched batches do not count); the
        # offset is nonzero only after resuming a checkpoint of another world size (positions are rescaled).
        self._data_offset = 0
        self.batches: TrainBatches | None = None  # the training stream during fit()
        self.last_eval: dict[str, float] = {}
        self._fit_ended = True  # False while fit() runs, and after it raised
        if tc.resume is True or (tc.resume == "auto" and self.checkpointer is not None):
            resumed = self.checkpointer.resume(
                self.train_data, report_none=tc.resume is True or restart_count() > 0, require=tc.resume is True
            )
            if resumed is not None:
                self.step = resumed
                self.logger.resume_at(self.step)  # the redone steps are logged once
                self._data_offset = int(self.train_data.state_dict()["batch_index"]) - self.step

    def _warn(self, msg: str) -> None:
        if self.rank == 0:
            logging.getLogger("gem.train").warning(msg)

    def save_checkpoint(self) -> str:
        assert self.checkpointer is not None
        data_state = dict(self.train_data.state_dict())
        data_state["batch_index"] = self.step + self._data_offset
        return self.checkpointer.save(self.step, data_state)

    def _stop_here(self, vote: StopVote, result: TrainResult, logged: bool, end: int) -> bool:
        """After a step: whether every rank stops here on a signal; if so the window is logged and the checkpoint of
        this step written (unless it just was). Every rank agrees on the signal after the same step, so every rank
        also trains on to the same id-map update step (zch tables)."""
        name = vote.poll()
        if name is None:
            return False
        if self.step % self._stop_grid and self.step < end:
            if not self._stop_deferred:
                self._stop_deferred = True
                nxt = min(end, self.step + self._stop_grid - self.step % self._stop_grid)
                self.logger.info(f"{name}: training on to step {nxt}, the next id-map update of the zch tables")
            return False
        self.logger.info(f"stopping at step {self.step} ({name})")
        result.stopped_by = name
        if not logged:
            self.reporter.log_window(self.step, self._last_out, self.last_eval)
        if self.checkpointer is not None:
            with self.stop.saving(self.step):
                if not (result.last_checkpoint or "").endswith(f"step_{self.step}"):
                    self.save_checkpoint()
                result.last_checkpoint = self.checkpointer.finish()
        return True

    def evaluate(self) -> dict[str, float]:
        return self.evaluator()

    def _train_batches(self) -> TrainBatches:
        return TrainBatches(
            self.train_data,
            self.schema,
            self.inner.flops,
            position=self.step + self._data_offset,
            first_step=self.step,
            num_workers=self.cfgs.data.num_workers,
            pin_memory=self.is_cuda,
            seed=self.tcfg.seed,
        )

    def fit(self) -> TrainResult:
        tc = self.tcfg
        end = tc.stop_at_step or tc.steps
        result = TrainResult(steps=self.step, run_dir=self.run_dir)
        self.model.train()
        loop = self._loop_cls(self.model, self.optimizer, self.step_cfg, self.device, timer=self.reporter.timer)
        if loop.name == "sparse_dist":
            self.logger.info("pipeline: torchrec TrainPipelineSparseDist")
        self.logger.info(
            f"training steps {self.step}..{end} of {tc.steps} | world {self.world_size} | device {self.device} | "
            f"global batch {self.reporter.global_batch} | {self.par.dims.describe()}"
        )
        self.batches = batches = self._train_batches()
        self._fit_ended = False
        self.reporter.start()
        vote = StopVote(self.stop, self.world_size)
        self._stop_deferred = False
        try:
            while self.step < end:
                self.reporter.step_begin(self.step + 1)
                out = self._last_out = loop.step(batches, self.step + 1)
                self.step += 1
                self.par.after_step(self.step)
                for hook in self.on_step_end:
                    hook(self.step)
                self.reporter.step_done(out.loss, batches.flops.popleft(), batches.samples.popleft())
                do_eval = (tc.eval_every and self.step % tc.eval_every == 0) or self.step == end
                logged = self.step % tc.log_every == 0 or self.step == end or do_eval
                if logged:
                    scalars = self.reporter.log_window(self.step, out, self.last_eval)
                    for hook in self.on_window:
                        hook(self.step, scalars)
                if do_eval and self.cfgs.data.eval_batches > 0:
                    with loop.paused():
                        self.last_eval = self.evaluate()
                    self.reporter.log_eval(self.step, self.last_eval)
                if tc.checkpoint.every > 0 and (self.step % tc.checkpoint.every == 0 or self.step == end):
                    result.last_checkpoint = self.save_checkpoint()
                    self.reporter.restart_window()
                if self.checkpointer is not None:
                    self.checkpointer.poll()
                for hook in self.hooks:
                    hook(self)
                if self._stop_here(vote, result, logged, end):
                    break
            vote.close()  # not on an exception: a failed peer would never join the last vote
            if self.checkpointer is not None and result.stopped_by is None and result.last_checkpoint:
                result.last_checkpoint = self.checkpointer.finish()  # the background save of the last step
        finally:
            batches.close()
            self.batches = None
        self._fit_ended = True
        result.steps = self.step
        result.losses = self.reporter.losses()
        result.eval_metrics = dict(self.last_eval)
        result.samples_per_s = self.reporter.samples_per_s
        self.logger.flush()
        return result

    def close(self) -> None:
        if self.checkpointer is not None:  # after a failure, a save in flight may wait on a peer that is gone
            self.checkpointer.checkpointer.close(wait=self._fit_ended)
        if self.batches is not None:
            self.batches.close()
            self.batches = None
        self.logger.close()
        self.reporter.close()


def summary_line(result: TrainResult, tasks: list[str]) -> str:
    parts = [f"steps {result.steps}"]
    if "num_samples" in result.eval_metrics:
        parts.append(f"eval on {int(result.eval_metrics['num_samples']):,} rows")
    for t in tasks:
        if f"{t}/ne" in result.eval_metrics:
            parts.append(f"{t} NE {result.eval_metrics[f'{t}/ne']:.4f} AUC {result.eval_metrics[f'{t}/auc']:.4f}")
    parts.append(f"{result.samples_per_s:,.0f} samples/s")
    parts.append(f"run dir {result.run_dir}")
    return "gem-train summary: " + " | ".join(parts)
