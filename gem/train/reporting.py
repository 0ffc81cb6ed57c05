"""Training metrics over log windows: loss (mean over ranks), throughput, MFU (E2E, local, scaling ratio), the
step-time breakdown with exposed communication, memory, learning rate; evaluation results. Rank 0 writes them to
the console, TensorBoard (TrainLogger) and `<run dir>/metrics.jsonl`.

Per step only device tensors are kept; the host syncs once per window (`log_window`). Time spent in evaluation
and checkpoints is left out of the throughput (`restart_window`).
"""

from __future__ import annotations

import json
import os
import time
from typing import Any

import torch
import torch.distributed as dist

from gem.train.metrics_log import TrainLogger
from gem.train.mfu import CommProbe, device_peak_flops, measure_matmul_peak, mfu_report
from gem.train.step import PhaseTimer, StepOutput


class MetricsReporter:
    """One run's training and evaluation metrics. Every rank calls `log_window` (the loss is averaged over ranks)."""

    def __init__(
        self,
        logger: TrainLogger,
        optimizer,
        tcfg,
        *,
        run_dir: str | None,
        rank: int,
        world_size: int,
        device: torch.device,
        tasks: list[str],
        global_batch: int,
    ) -> None:
        self.logger, self.optimizer, self.tcfg = logger, optimizer, tcfg
        self.rank, self.world_size, self.device, self.tasks = rank, world_size, device, tasks
        self.global_batch = global_batch
        self.is_cuda = device.type == "cuda"
        # held for the whole run (closed in close()): a context manager cannot span it
        self._jsonl = open(os.path.join(run_dir, "metrics.jsonl"), "a") if (run_dir and rank == 0) else None  # noqa: SIM115
        self.timer = PhaseTimer(device)  # the loop marks each step's phases on it
        self.peak_flops = tcfg.mfu.peak_flops or device_peak_flops(device)
        self.measured_peak = tcfg.mfu.measured_peak_flops
        if self.is_cuda and tcfg.mfu.measure_peak and self.measured_peak is None:
            self.measured_peak = measure_matmul_peak(device)
        # exposed communication as a share of the step: none on one rank; measured by the probe on more
        self.probe = CommProbe(device) if world_size > 1 and tcfg.mfu.comm_probe_every > 0 else None
        self.exposed_comm_fraction: float | None = 0.0 if world_size == 1 else None
        self.comm_fraction: float | None = 0.0 if world_size == 1 else None
        self._probe_due, self._probe_left, self._windows_since_probe = False, 0, None
        self.start()

    def start(self) -> None:
        """A new run of steps: clears the per-step losses and the clocks."""
        self.window_t0 = self.run_t0 = time.perf_counter()
        self.window_steps, self.window_flops, self.run_steps, self.train_time = 0, 0.0, 0, 0.0
        self.window_samples, self.run_samples = 0, 0.0  # candidates scored: this rank's window, all ranks' run
        self._window_step_flops: list[float] = []  # this rank's FLOPs of each step of the window
        self._window_losses: list[torch.Tensor] = []
        self._step_losses: list[torch.Tensor] = []  # kept on device: no host sync per step

    def step_begin(self, step: int) -> None:
        """Before step `step` (1-based): starts a due communication probe where its steps fit in the run and no
        evaluation or checkpoint falls between them."""
        if not self._probe_due:
            return
        tc, k = self.tcfg, self.tcfg.mfu.comm_probe_steps
        between = range(step, step + k - 1)
        if step + k - 1 <= (tc.stop_at_step or tc.steps) and not any(
            (tc.eval_every and s % tc.eval_every == 0) or (tc.checkpoint.every and s % tc.checkpoint.every == 0)
            for s in between
        ) and self.probe.start():
            self._probe_due = False
            self._probe_left = k

    def step_done(self, loss: torch.Tensor, flops: float, samples: int | None = None) -> None:
        """`samples`: candidates this rank scored in the step (None: the configured batch size)."""
        if self._probe_left:
            self._probe_left -= 1
            if not self._probe_left:
                self.exposed_comm_fraction, self.comm_fraction = self.probe.stop()
                self.window_t0 += self.probe.overhead_s  # reading the profile is not training time
        self.window_flops += flops
        self.window_samples += self.global_batch // self.world_size if samples is None else samples
        self._window_step_flops.append(flops)
        self.window_steps += 1
        self.run_steps += 1
        self._window_losses.append(loss)
        self._step_losses.append(loss)

    def restart_window(self) -> None:
        self.window_t0 = time.perf_counter()
        self.timer.window()  # steps around evaluation or a checkpoint do not count

    def losses(self) -> list[float]:
        """This rank's loss of every step since `start()` (one host sync)."""
        return torch.stack(self._step_losses).float().cpu().tolist() if self._step_losses else []

    @property
    def samples_per_s(self) -> float:
        """Training throughput since `start()`: evaluation and checkpoint time left out."""
        return self.run_samples / self.train_time if self.train_time > 0 else 0.0

    def log_window(self, step: int, out: StepOutput, last_eval: dict[str, float]) -> dict[str, float]:
        """The window of steps since the last one ended; `out`: its last step's losses. Returns the window's
        scalars (as logged)."""
        if self.is_cuda:
            torch.cuda.synchronize(self.device)
        dt = max(time.perf_counter() - self.window_t0, 1e-9)
        self.train_time += dt
        steps, flops = self.window_steps, self.window_flops
        loss = float(torch.stack(self._window_losses).mean())
        samples = float(self.window_samples)
        if self.world_size > 1:  # loss: mean over ranks for the log; candidates scored: summed
            t = torch.tensor([loss, samples], dtype=torch.float64, device=self.device if self.is_cuda else "cpu")
            dist.all_reduce(t)
            loss, samples = float(t[0]) / self.world_size, float(t[1])
        self.run_samples += samples
        samples_per_s = samples / dt
        scalars = {
            "train/loss": loss,
            "train/task_loss": float(out.task_loss),
            "train/aux_loss": float(out.aux_loss),
            "train/lr": self.optimizer.last_lr,
            "perf/samples_per_s": samples_per_s,
            "perf/step_time_s": dt / steps,
        }
        if self.optimizer.last_grad_norm is not None:
            scalars["train/grad_norm"] = float(self.optimizer.last_grad_norm)
        if self.world_size > 1:
            scalars["perf/rank_imbalance"] = self._rank_imbalance()
        report = mfu_report(flops / steps, dt / steps, self.peak_flops, self.measured_peak,
                            self.exposed_comm_fraction, self.comm_fraction)
        phases = self.timer.window()
        scalars.update({f"time/{name}_ms": ms for name, ms in phases.items()})
        scalars.update(report.scalars())
        if self.is_cuda:
            scalars["memory/peak_allocated_gib"] = torch.cuda.max_memory_allocated(self.device) / 2**30
            scalars["memory/peak_reserved_gib"] = torch.cuda.max_memory_reserved(self.device) / 2**30
            torch.cuda.reset_peak_memory_stats(self.device)
        self.logger.scalars(scalars, step)
        extra = [
            f"MFU {100 * report.mfu_e2e:.1f}%" if report.mfu_e2e is not None
            else f"{report.flops_per_s / 1e9:.2f} GFLOP/s"
        ]
        if report.mfu_local is not None:
            extra[0] += f" (local {100 * report.mfu_local:.1f}%)"
        if report.scaling_ratio is not None:
            extra[0] += f" scaling {report.scaling_ratio:.3f}"
        if phases:
            extra.append("ms " + " ".join(f"{name[:3]} {ms:.1f}" for name, ms in phases.items()))
        if "perf/rank_imbalance" in scalars:
            extra.append(f"imbalance {scalars['perf/rank_imbalance']:.3f}")
        if report.exposed_comm_s is not None and self.world_size > 1:
            extra.append(f"exposed comm {1e3 * report.exposed_comm_s:.1f} ms")
        if "memory/peak_allocated_gib" in scalars:
            extra.append(f"mem {scalars['memory/peak_allocated_gib']:.1f} GiB")
        total_dt = time.perf_counter() - self.run_t0
        self.logger.progress(
            step,
            self.tcfg.steps,
            loss,
            samples_per_s,
            last_eval,
            self.tasks[0],
            extra=" | ".join(extra),
            steps_per_s=self.run_steps / total_dt if total_dt > 0 else None,
        )
        self._write_jsonl({"step": step, **scalars})
        self._window_losses, self._window_step_flops = [], []
        self.window_steps, self.window_flops, self.window_samples = 0, 0.0, 0
        self.restart_window()
        self._schedule_probe(step)
        return scalars

    def _rank_imbalance(self) -> float:
        """Mean over the window's steps of max / mean of the ranks' step FLOPs (the model's cost of their batches):
        how long a synchronous step waits for its slowest rank, in work (1.0: every rank the same)."""
        mine = torch.tensor(self._window_step_flops, dtype=torch.float64,
                            device=self.device if self.is_cuda else "cpu")
        every = [torch.empty_like(mine) for _ in range(self.world_size)]
        dist.all_gather(every, mine)
        per_rank = torch.stack(every)  # [world, steps]
        mean = per_rank.mean(0)
        ratio = torch.where(mean > 0, per_rank.max(0).values / mean.clamp_min(1e-30), torch.ones_like(mean))
        return float(ratio.mean())

    def _schedule_probe(self, step: int) -> None:
        """After the first log window past the LR warmup, then every `comm_probe_every` windows."""
        if self.probe is None or step < self.tcfg.warmup_steps:
            return
        if self._windows_since_probe is None or self._windows_since_probe >= self.tcfg.mfu.comm_probe_every:
            self._probe_due, self._windows_since_probe = True, 0
        self._windows_since_probe += 1

    def log_eval(self, step: int, m: dict[str, float]) -> None:
        self.logger.scalars({f"eval/{k}": v for k, v in m.items()}, step)
        parts = [
            f"{t} NE {m[f'{t}/ne']:.4f} AUC {m[f'{t}/auc']:.4f}"
            + (f" GAUC {m[f'{t}/gauc']:.4f}" if f"{t}/gauc" in m else "") + f" cal {m[f'{t}/calibration']:.3f}"
            for t in self.tasks
        ]
        self.logger.info(f"eval @ step {step} ({int(m['num_samples'])} samples): " + " | ".join(parts))
        self._write_jsonl({"step": step, **{f"eval/{k}": v for k, v in m.items()}})
        self.restart_window()  # evaluation time is not training throughput

    def _write_jsonl(self, record: dict[str, Any]) -> None:
        if self._jsonl is not None:
            self._jsonl.write(json.dumps(record) + "\n")
            self._jsonl.flush()

    def close(self) -> None:
        if self.probe is not None and self.probe.running:
            self.probe.stop()
            self._probe_left = 0
        if self._jsonl is not None:
            self._jsonl.close()
            self._jsonl = None
