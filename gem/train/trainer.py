"""The training loop: data -> validated batches -> sharded GEM model -> multitask loss -> fused sparse + AdamW.

`train.pipeline`: torchrec's TrainPipelineSparseDist (host-to-device copy and the embeddings' input all-to-all of
the next batches overlap this batch's compute; `auto` uses it on CUDA, `sparse_dist` on CPU too), else the plain
loop; a model the pipeline cannot trace falls back to the plain loop with a warning (`Trainer.loop` says which ran).
Rank 0 logs (console, TensorBoard, `<run dir>/metrics.jsonl`); every rank takes part in evaluation and
checkpoints. `data.num_workers` > 0: DataLoader worker processes make and validate the training batches (the
training thread only receives them); evaluation batches are made inline.
"""

from __future__ import annotations

import collections
import contextlib
import inspect
import itertools
import json
import logging
import os
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, IterableDataset

from gem._config import ConfigError, UserError
from gem.data import Batch, DataConfig, build_dataset, validate_batch
from gem.model import GEMModel, ModelConfig, losses, validate_against_schema
from gem.parallel import parallelize
from gem.parallel.dims import ParallelConfig, init_distributed
from gem.parallel.dims import validate as validate_parallel
from gem.train.checkpoint import Checkpointer, latest_checkpoint, no_checkpoint_error, run_config
from gem.train.config import TrainConfig
from gem.train.logging import TrainLogger
from gem.train.metrics import TaskMetrics
from gem.train.mfu import device_peak_flops, measure_matmul_peak, mfu_report
from gem.train.optim import TrainOptimizer

log = logging.getLogger("gem.train")


@dataclass
class Configs:
    """The typed, cross-checked config groups of one run."""

    model: ModelConfig
    data: DataConfig
    parallel: ParallelConfig
    train: TrainConfig


def build_configs(cfg: Any, world_size: int | None = None) -> Configs:
    """Typed configs from the composed Hydra config; raises a ValueError naming the first bad key.

    `world_size`: when given, the parallel layout is checked against it too.
    """
    from omegaconf import OmegaConf

    for group in ("model", "data", "parallel", "train"):
        if group not in cfg or cfg[group] is None:
            raise ConfigError(group, "missing config group")
    # Raises MissingMandatoryValue naming the key for any `???` left.
    OmegaConf.to_container(cfg, resolve=True, throw_on_missing=True)
    data = DataConfig.from_dict(cfg.data)
    model = ModelConfig.from_dict(cfg.model)
    validate_against_schema(model, data.schema)
    parallel = ParallelConfig.from_any(cfg.parallel)
    if world_size is not None:
        parallel = validate_parallel(parallel, world_size)
    train = TrainConfig.from_dict(cfg.train)
    return Configs(model=model, data=data, parallel=parallel, train=train)


@dataclass
class TrainResult:
    steps: int  # steps done when the run ended (global step counter)
    losses: list[float] = field(default_factory=list)  # per step of this run (rank-local loss)
    eval_metrics: dict[str, float] = field(default_factory=dict)  # the last evaluation
    samples_per_s: float = 0.0
    run_dir: str | None = None
    last_checkpoint: str | None = None


def _rank_world() -> tuple[int, int]:
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def _restart_count() -> int:
    """How many times torchrun has restarted this job's workers (0: the first attempt, or not under torchrun)."""
    return int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") or 0)


def _fault_injection_step(rank: int) -> int | None:
    """Test hook for fault tolerance: GEM_FAULT_AT_STEP=<step> and GEM_FAULT_RANK=<rank> (default 0) make that
    rank exit hard right after that step, on the first attempt only (so a torchrun restart can succeed)."""
    at = os.environ.get("GEM_FAULT_AT_STEP")
    if not at or _restart_count() > 0 or int(os.environ.get("GEM_FAULT_RANK", "0")) != rank:
        return None
    return int(at)


class _Failed:
    """What a DataLoader worker sends instead of a batch that failed (a worker's exception would reach the training
    process wrapped in a traceback dump; this carries the one-line message). `invalid`: failed validation."""

    def __init__(self, message: str, invalid: bool, user: bool = False) -> None:
        self.message, self.invalid, self.user = message, invalid, user


class _WorkerBatches(IterableDataset):
    """Runs in DataLoader workers: yields (index, batch) with the batch already validated, or (index, _Failed) and
    stops. `index`: the batch's position in the dataset's stream (None when the dataset has no `state_dict`)."""

    def __init__(self, dataset, schema) -> None:
        super().__init__()
        self.dataset, self.schema = dataset, schema

    def __iter__(self) -> Iterator[tuple[int | None, Batch | _Failed]]:
        it = iter(self.dataset)
        while True:
            try:
                batch = next(it)
            except StopIteration:
                return
            except ValueError as e:
                yield None, _Failed(str(e), invalid=False, user=isinstance(e, UserError))
                return
            # The datasets advance their position to just past the batch they yield.
            index = int(self.dataset.state_dict()["batch_index"]) - 1 if hasattr(self.dataset, "state_dict") else None
            try:
                validate_batch(batch, self.schema)
            except ValueError as e:
                yield index, _Failed(str(e), invalid=True)
                return
            yield index, batch


class _InOrder:
    """The (index, item) pairs of a worker DataLoader put back in stream order from `start`.

    The workers of a dataset started mid-stream need not take turns in stream order (worker w makes the batches
    i = w mod n), so up to one round of batches is held back until its turn; a failure surfaces at its turn too.
    """

    def __init__(self, it: Iterator[tuple[int | None, Any]], start: int) -> None:
        self._it = it
        self._next = start
        self._held: dict[int, Any] = {}

    def __iter__(self) -> _InOrder:
        return self

    def __next__(self):
        while self._next not in self._held:
            try:
                index, item = next(self._it)
            except StopIteration:
                if not self._held:
                    raise
                self._next = min(self._held)  # a finite stream's tail
                break
            if index is None:  # a dataset without a position, or its own error: as it comes
                return item
            if index == self._next:
                self._next += 1
                return item
            self._held[index] = item
        item = self._held.pop(self._next)
        self._next += 1
        return item


class _ValidatedBatches:
    """Iterates a dataset's batches, validating each (before it reaches the model) and noting its FLOPs.

    `validate=False`: the batches were validated where they were made (DataLoader workers), which send a _Failed in
    place of a bad one; it raises here, in the training process, with the same message as inline validation.
    """

    def __init__(
        self, it: Iterator[Any], schema, flops_of: Callable[[Batch], float], first_step: int, validate: bool = True
    ) -> None:
        self._it = it
        self._schema = schema
        self._flops_of = flops_of
        self._next_step = first_step
        self._validate = validate
        self.flops: collections.deque[float] = collections.deque()

    def __iter__(self) -> _ValidatedBatches:
        return self

    def __next__(self) -> Batch:
        batch = next(self._it)
        step = self._next_step
        self._next_step += 1
        if isinstance(batch, _Failed):
            if batch.invalid:
                raise BadBatchError(f"training batch of step {step + 1}: {batch.message}")
            raise (UserError if batch.user else ValueError)(batch.message)  # what the dataset raised
        if self._validate:
            try:
                validate_batch(batch, self._schema)
            except ValueError as e:
                raise BadBatchError(f"training batch of step {step + 1}: {e}") from None
        self.flops.append(self._flops_of(batch))
        return batch


class _Recording:
    """An iterator that remembers what it yields until `stop_recording()`."""

    def __init__(self, source: Iterator[Batch]) -> None:
        self.source = source
        self.recorded: list[Batch] = []
        self._recording = True

    def __iter__(self) -> _Recording:
        return self

    def __next__(self) -> Batch:
        b = next(self.source)
        if self._recording:
            self.recorded.append(b)
        return b

    def stop_recording(self) -> None:
        self._recording = False
        self.recorded = []


class BadBatchError(UserError):
    """A training batch failed validation (raised before it reaches forward or any optimizer step)."""


class Trainer:
    """Builds everything from the composed config and trains; `fit()` returns a TrainResult."""

    def __init__(self, cfg: Any, run_dir: str | None = None) -> None:
        self.device = init_distributed()
        self.rank, self.world_size = _rank_world()
        self.cfgs = build_configs(cfg, self.world_size)
        tc = self.tcfg = self.cfgs.train
        self.run_dir = run_dir
        self.schema = self.cfgs.data.schema
        self.tasks = list(self.schema.tasks)
        self.is_cuda = self.device.type == "cuda"

        # Same seed on every rank: parallelize needs identically initialised models.
        torch.manual_seed(tc.seed)
        model = GEMModel(self.cfgs.model, embedding_device=self.device)
        self.par = parallelize(model, self.cfgs.parallel, sparse_optimizer_cfg=tc.sparse_optimizer, device=self.device)
        self.model = self.par.model
        self.inner = self.par.inner
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
        self.task_weights = self.cfgs.model.task_weights

        self.train_data = build_dataset(self.cfgs.data, self.rank, self.world_size, split="train")
        self.eval_data = build_dataset(self.cfgs.data, self.rank, self.world_size, split="eval")
        self.metrics = TaskMetrics(self.tasks)

        self.autocast_dtype = None
        if tc.autocast == "bf16" or (tc.autocast == "auto" and self.is_cuda):
            self.autocast_dtype = torch.bfloat16

        ckpt_dir = tc.checkpoint.dir or (os.path.join(run_dir, "checkpoints") if run_dir else None)
        self.checkpointer = (
            Checkpointer(ckpt_dir, keep=tc.checkpoint.keep, config=run_config(self.cfgs)) if ckpt_dir else None
        )
        if (tc.checkpoint.every > 0 or tc.resume is True) and self.checkpointer is None:
            raise ConfigError("train.checkpoint.dir", "checkpoints need a directory (no run directory to default to)")

        if run_dir and self.rank == 0:
            os.makedirs(run_dir, exist_ok=True)
        self.logger = TrainLogger(run_dir, enabled=self.rank == 0, tensorboard=tc.tensorboard)
        # held for the whole run (closed in close()): a context manager cannot span it
        self._jsonl = open(os.path.join(run_dir, "metrics.jsonl"), "a") if (run_dir and self.rank == 0) else None  # noqa: SIM115

        self.peak_flops = device_peak_flops(self.device)
        self.measured_peak = tc.mfu.measured_peak_flops
        if self.is_cuda and tc.mfu.measure_peak and self.measured_peak is None:
            self.measured_peak = measure_matmul_peak(self.device)

        self.step = 0  # optimizer steps done
        # This rank's data position is step + offset: one batch per step (prefetched batches do not count); the
        # offset is nonzero only after resuming a checkpoint of another world size (positions are rescaled).
        self._data_offset = 0
        self._loader: DataLoader | None = None  # data.num_workers > 0: the workers' loader during fit()
        self._loader_iter: Iterator[Any] | None = None
        self.loop = "plain"  # what fit() runs: "plain" or "sparse_dist" (torchrec's TrainPipelineSparseDist)
        self.pipeline_fallback: str | None = None  # why a requested pipeline fell back to the plain loop
        self.last_eval: dict[str, float] = {}
        self._fault_step = _fault_injection_step(self.rank)
        if tc.resume is True or (tc.resume == "auto" and self.checkpointer is not None):
            self._resume(report_none=tc.resume is True or _restart_count() > 0)

    # -- state ------------------------------------------------------------------------------------------------
    def _state(self) -> dict[str, Any]:
        data_state = dict(self.train_data.state_dict())
        data_state["batch_index"] = self.step + self._data_offset
        rng = {"torch": torch.get_rng_state()}
        if self.is_cuda:
            rng["cuda"] = torch.cuda.get_rng_state(self.device)
        return {
            "model": self.model.state_dict(),
            "optim": self.optimizer.state_dict(),
            "progress": {
                "step": torch.tensor(self.step, dtype=torch.int64),
                "world_size": torch.tensor(self.world_size),
            },
            "data": {k: torch.tensor(int(v), dtype=torch.int64) for k, v in data_state.items()},
            f"rng_rank{self.rank}": rng,
        }

    def save_checkpoint(self) -> str:
        assert self.checkpointer is not None
        if self.par.embeddings is not None and self.par.embeddings.n_replicas > 1:
            self.par.sync_embeddings()  # every replica holds the same tables in the checkpoint
        path = self.checkpointer.save(self.step, self._state())
        self.logger.info(f"checkpoint: {path}")
        return str(path)

    def _resume(self, report_none: bool = True) -> None:
        assert self.checkpointer is not None
        found = latest_checkpoint(self.checkpointer.dir)
        steps = [found[0] if found else -1]
        if self.world_size > 1:  # every rank must pick the same checkpoint
            dist.broadcast_object_list(steps, src=0)
        if steps[0] < 0:
            if self.tcfg.resume is True:
                raise no_checkpoint_error(self.checkpointer.dir)
            if report_none:
                self.logger.info(f"resume: no checkpoint in {self.checkpointer.dir}, starting from step 0")
            return
        path = self.checkpointer.dir / f"step_{steps[0]}"
        self.optimizer.init_state()
        meta = {"progress": {"step": torch.tensor(0, dtype=torch.int64), "world_size": torch.tensor(0)}}
        self.checkpointer.load(path, meta)
        same_world = int(meta["progress"]["world_size"]) == self.world_size
        state = self._state()
        if not same_world:  # per-rank RNG streams only carry over to the same world size
            state.pop(f"rng_rank{self.rank}")
        self.checkpointer.load(path, state)
        self.model.load_state_dict(state["model"])
        self.step = int(state["progress"]["step"])
        self.optimizer.load_state_dict(state["optim"], step_count=self.step)
        self.train_data.load_state_dict({k: int(v) for k, v in state["data"].items()})
        self._data_offset = int(self.train_data.state_dict()["batch_index"]) - self.step
        if same_world:
            rng = state[f"rng_rank{self.rank}"]
            torch.set_rng_state(rng["torch"])
            if self.is_cuda and "cuda" in rng:
                torch.cuda.set_rng_state(rng["cuda"], self.device)
        self.logger.resume_at(self.step)  # the redone steps are logged once
        restart = f" (torchrun restart {_restart_count()})" if _restart_count() else ""
        self.logger.info(f"resumed from {path} at step {self.step}{restart}")

    # -- one step ---------------------------------------------------------------------------------------------
    def _autocast(self):
        if self.autocast_dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(device_type=self.device.type, dtype=self.autocast_dtype)

    def _loss(self, batch: Batch):
        """Forward + multitask loss; returns (total loss, (logits, labels, task loss, aux loss) detached)."""
        with self._autocast():
            out = self.model(batch)
        task_loss, _ = losses(out.logits.float(), batch.labels, self.task_weights, self.tasks)
        total = task_loss + self.tcfg.aux_loss_weight * out.aux_loss.float()
        if self.tcfg.check_finite and not bool(torch.isfinite(total)):
            # Before backward: the fused sparse optimizer updates the tables inside backward.
            raise FloatingPointError(f"non-finite loss {float(total)} at step {self.step + 1}")
        return total, (out.logits.detach().float(), batch.labels, task_loss.detach(), out.aux_loss.detach())

    def _plain_step(self, batches: _ValidatedBatches):
        batch = next(batches).to(self.device, non_blocking=True)
        self.optimizer.zero_grad()
        total, out = self._loss(batch)
        total.backward()
        self.optimizer.step()
        return total.detach(), out

    def _make_pipeline(self, batches: _ValidatedBatches):
        """torchrec's TrainPipelineSparseDist on CUDA when the model traces for it; None for the plain loop."""
        tc = self.tcfg
        if tc.pipeline == "none" or (tc.pipeline == "auto" and not self.is_cuda):
            return None
        from torchrec.distributed.train_pipeline import TrainPipelineSparseDist

        params = inspect.signature(TrainPipelineSparseDist.__init__).parameters
        if "custom_model_fwd" not in params or not hasattr(TrainPipelineSparseDist, "detach"):
            self.pipeline_fallback = "this torchrec's TrainPipelineSparseDist lacks custom_model_fwd/detach"
            log.warning(f"pipeline: {self.pipeline_fallback}; using the plain loop")
            return None
        holder = {}

        def fwd(batch):
            total, out = self._loss(batch)
            holder["loss"] = total.detach()
            return total, out

        pipeline = TrainPipelineSparseDist(
            self.model, self.optimizer, self.device, execute_all_batches=True, custom_model_fwd=fwd
        )
        pipeline._gem_loss = holder
        return pipeline

    # -- evaluation -------------------------------------------------------------------------------------------
    @torch.no_grad()
    def evaluate(self) -> dict[str, float]:
        self.model.eval()
        self.metrics.reset()
        if self.par.embeddings is not None and self.par.embeddings.n_replicas > 1:
            self.par.sync_embeddings()
        for batch in self.eval_data:
            validate_batch(batch, self.schema)
            batch = batch.to(self.device, non_blocking=True)
            with self._autocast():
                out = self.model(batch)
            self.metrics.update(out.logits.float(), batch.labels)
        self.model.train()
        return self.metrics.compute()

    # -- the loop ---------------------------------------------------------------------------------------------
    def fit(self) -> TrainResult:
        tc = self.tcfg
        end = tc.stop_at_step or tc.steps
        result = TrainResult(steps=self.step, run_dir=self.run_dir)
        self.model.train()
        source, in_workers = self._train_batches()
        try:
            return self._fit(result, end, source, in_workers)
        finally:
            self._close_loader()

    def _train_batches(self) -> tuple[Iterator[Any], bool]:
        """The training stream from the batches this trainer consumed, and whether workers validate it.

        With `data.num_workers` > 0, DataLoader worker processes make and validate the batches. The dataset's own
        position then only advances inside the workers (and runs ahead of training by the prefetched batches), so
        the stream is restarted at the trainer's count.
        """
        position = self.step + self._data_offset
        if hasattr(self.train_data, "load_state_dict"):
            self.train_data.load_state_dict({"batch_index": position})
        k = self.cfgs.data.num_workers
        if k == 0:
            return iter(self.train_data), False
        self._loader = DataLoader(
            _WorkerBatches(self.train_data, self.schema),
            batch_size=None,  # the dataset yields whole batches
            num_workers=k,
            pin_memory=self.is_cuda,
            prefetch_factor=2,
            persistent_workers=True,
            # Worker seeds come from this generator, not the global RNG, so the training RNG stream (and resume
            # parity) does not depend on num_workers.
            generator=torch.Generator().manual_seed(self.tcfg.seed),
        )
        self._loader_iter = iter(self._loader)
        return _InOrder(self._loader_iter, position), True

    def _close_loader(self) -> None:
        it = getattr(self, "_loader_iter", None)
        self._loader_iter = self._loader = None
        if it is not None and hasattr(it, "_shutdown_workers"):
            it._shutdown_workers()  # now, not when a traceback holding the iterator is freed

    def _fit(self, result: TrainResult, end: int, source: Iterator[Any], in_workers: bool) -> TrainResult:
        tc = self.tcfg
        raw = _Recording(source)
        batches = _ValidatedBatches(raw, self.schema, self.inner.flops, self.step, validate=not in_workers)
        pipeline = self._make_pipeline(batches)
        first_progress = pipeline is not None
        self.loop = "sparse_dist" if pipeline is not None else "plain"
        if pipeline is not None:
            self.logger.info("pipeline: torchrec TrainPipelineSparseDist")
        global_batch = self.cfgs.data.batch_size * self.world_size
        if self.rank == 0:
            self.logger.info(
                f"training steps {self.step}..{end} of {tc.steps} | world {self.world_size} | device {self.device} | "
                f"global batch {global_batch} | {self.par.dims.describe() if hasattr(self.par.dims, 'describe') else ''}"
            )
        window_t0, window_steps, window_flops = time.perf_counter(), 0, 0.0
        run_t0, run_steps, train_time = window_t0, 0, 0.0
        losses_window: list[torch.Tensor] = []
        step_losses: list[torch.Tensor] = []  # kept on device: no host sync per step
        while self.step < end:
            if pipeline is not None and first_progress:
                # The pipeline fx-traces the model on its first batch; a model it cannot trace falls back to the
                # plain loop, replaying the batches the pipeline had pulled (nothing was applied yet).
                try:
                    out = pipeline.progress(batches)
                    loss = pipeline._gem_loss["loss"]
                    first_progress = False
                    raw.stop_recording()
                except (BadBatchError, FloatingPointError, torch.OutOfMemoryError):
                    raise  # a real failure of the step, not of tracing
                except Exception as e:  # noqa: BLE001
                    self.pipeline_fallback = (
                        f"TrainPipelineSparseDist failed on the first batch ({type(e).__name__}: "
                        f"{str(e).splitlines()[0] if str(e) else ''})"
                    )
                    log.warning(f"pipeline: {self.pipeline_fallback}; using the plain loop")
                    # The pipeline swapped the sharded modules' forwards for its pipelined ones: restore them.
                    pipeline.detach()
                    pipeline, first_progress, self.loop = None, False, "plain"
                    raw = _Recording(itertools.chain(raw.recorded, raw.source))
                    raw.stop_recording()
                    batches = _ValidatedBatches(raw, self.schema, self.inner.flops, self.step, validate=not in_workers)
                    self.optimizer.zero_grad()
                    loss, out = self._plain_step(batches)
            elif pipeline is not None:
                out = pipeline.progress(batches)
                loss = pipeline._gem_loss["loss"]
            else:
                loss, out = self._plain_step(batches)
            self.step += 1
            self.par.after_step(self.step)
            window_flops += batches.flops.popleft()
            window_steps += 1
            run_steps += 1
            losses_window.append(loss)
            step_losses.append(loss)

            do_eval = (tc.eval_every and self.step % tc.eval_every == 0) or self.step == end
            do_log = self.step % tc.log_every == 0 or self.step == end or do_eval
            if do_log:
                if self.is_cuda:
                    torch.cuda.synchronize(self.device)
                now = time.perf_counter()
                dt = max(now - window_t0, 1e-9)
                train_time += dt
                self._log_window(
                    losses_window, out, window_steps, window_flops, dt, global_batch, end, run_t0, run_steps
                )
                losses_window = []
                window_steps, window_flops = 0, 0.0
                window_t0 = time.perf_counter()
            if do_eval and self.cfgs.data.eval_batches > 0:
                if pipeline is not None:
                    pipeline.detach()
                self.last_eval = self.evaluate()
                if pipeline is not None:
                    pipeline.attach(self.model)
                self._log_eval(self.last_eval)
                window_t0 = time.perf_counter()  # evaluation time is not training throughput
            if tc.checkpoint.every > 0 and (self.step % tc.checkpoint.every == 0 or self.step == end):
                result.last_checkpoint = self.save_checkpoint()
                window_t0 = time.perf_counter()
            if self.step == self._fault_step:
                log.warning(f"GEM_FAULT_AT_STEP: rank {self.rank} exits after step {self.step} (test hook)")
                os._exit(1)
        result.steps = self.step
        result.losses = torch.stack(step_losses).float().cpu().tolist() if step_losses else []
        result.eval_metrics = dict(self.last_eval)
        # training throughput: evaluation and checkpoint time left out
        result.samples_per_s = run_steps * global_batch / train_time if train_time > 0 else 0.0
        self.logger.flush()
        return result

    def _log_window(self, losses_window, out, steps, flops, dt, global_batch, end, run_t0, run_steps) -> None:
        loss = float(torch.stack(losses_window).mean())
        if self.world_size > 1:  # mean over ranks for the log
            t = torch.tensor([loss], device=self.device if self.is_cuda else "cpu")
            dist.all_reduce(t)
            loss = float(t) / self.world_size
        samples_per_s = steps * global_batch / dt
        _, _, task_loss, aux = out
        scalars = {
            "train/loss": loss,
            "train/task_loss": float(task_loss),
            "train/aux_loss": float(aux),
            "train/lr": self.optimizer.last_lr,
            "perf/samples_per_s": samples_per_s,
            "perf/step_time_s": dt / steps,
        }
        if self.optimizer.last_grad_norm is not None:
            scalars["train/grad_norm"] = float(self.optimizer.last_grad_norm)
        report = mfu_report(
            flops / steps, dt / steps, self.peak_flops, self.measured_peak, self.tcfg.mfu.single_device_mfu
        )
        scalars.update(report.scalars())
        if self.is_cuda:
            scalars["memory/peak_allocated_gib"] = torch.cuda.max_memory_allocated(self.device) / 2**30
            scalars["memory/peak_reserved_gib"] = torch.cuda.max_memory_reserved(self.device) / 2**30
            torch.cuda.reset_peak_memory_stats(self.device)
        self.logger.scalars(scalars, self.step)
        extra = []
        if report.mfu is not None:
            extra.append(f"MFU {100 * report.mfu:.1f}%")
        else:
            extra.append(f"{report.flops_per_s / 1e9:.2f} GFLOP/s")
        if "memory/peak_allocated_gib" in scalars:
            extra.append(f"mem {scalars['memory/peak_allocated_gib']:.1f} GiB")
        total_dt = time.perf_counter() - run_t0
        self.logger.progress(
            self.step,
            self.tcfg.steps,
            loss,
            samples_per_s,
            self.last_eval,
            self.tasks[0],
            extra=" | ".join(extra),
            steps_per_s=run_steps / total_dt if total_dt > 0 else None,
        )
        self._write_jsonl({"step": self.step, **scalars})

    def _log_eval(self, m: dict[str, float]) -> None:
        self.logger.scalars({f"eval/{k}": v for k, v in m.items()}, self.step)
        parts = [
            f"{t} NE {m[f'{t}/ne']:.4f} AUC {m[f'{t}/auc']:.4f} cal {m[f'{t}/calibration']:.3f}" for t in self.tasks
        ]
        self.logger.info(f"eval @ step {self.step} ({int(m['num_samples'])} samples): " + " | ".join(parts))
        self._write_jsonl({"step": self.step, **{f"eval/{k}": v for k, v in m.items()}})

    def _write_jsonl(self, record: dict[str, Any]) -> None:
        if self._jsonl is not None:
            self._jsonl.write(json.dumps(record) + "\n")
            self._jsonl.flush()

    def close(self) -> None:
        self._close_loader()
        self.logger.close()
        if self._jsonl is not None:
            self._jsonl.close()
            self._jsonl = None


def summary_line(result: TrainResult, tasks: list[str]) -> str:
    parts = [f"steps {result.steps}"]
    for t in tasks:
        if f"{t}/ne" in result.eval_metrics:
            parts.append(f"{t} NE {result.eval_metrics[f'{t}/ne']:.4f} AUC {result.eval_metrics[f'{t}/auc']:.4f}")
    parts.append(f"{result.samples_per_s:,.0f} samples/s")
    parts.append(f"run dir {result.run_dir}")
    return "gem-train summary: " + " | ".join(parts)
