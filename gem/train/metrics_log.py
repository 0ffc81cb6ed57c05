"""TensorBoard scalars and the console progress line; only rank 0 writes."""

from __future__ import annotations

import json
import logging
import os
import time
from collections.abc import Mapping
from pathlib import Path

log = logging.getLogger("gem.train")


def format_duration(seconds: float) -> str:
    seconds = max(round(seconds), 0)
    h, rem = divmod(seconds, 3600)
    m, s = divmod(rem, 60)
    return f"{h}:{m:02d}:{s:02d}" if h else f"{m:02d}:{s:02d}"


class TrainLogger:
    """Writes TensorBoard event files under `<run_dir>/tb` and progress lines; a no-op on ranks other than 0."""

    def __init__(self, run_dir: str | None, *, enabled: bool, tensorboard: bool = True) -> None:
        self.enabled = enabled
        self.run_dir = run_dir
        self._writer = None
        if enabled and tensorboard and run_dir is not None:
            self._writer = self._open_writer()
        self._t0 = time.perf_counter()

    def _open_writer(self, purge_step: int | None = None):
        from torch.utils.tensorboard import SummaryWriter

        return SummaryWriter(log_dir=os.path.join(self.run_dir, "tb"), purge_step=purge_step)

    def resume_at(self, step: int) -> None:
        """After resuming at `step`: the steps after it will be logged again, so drop their earlier records from
        `<run_dir>/metrics.jsonl` and hide their TensorBoard events (SummaryWriter's purge_step); each step then
        shows once."""
        if not self.enabled or self.run_dir is None:
            return
        truncate_metrics(Path(self.run_dir) / "metrics.jsonl", step)
        if self._writer is not None:
            self._writer.close()
            self._writer = self._open_writer(purge_step=step + 1)

    def scalars(self, values: Mapping[str, float], step: int) -> None:
        if self._writer is None:
            return
        for k, v in values.items():
            if v is not None:
                self._writer.add_scalar(k, float(v), step)

    def progress(
        self,
        step: int,
        total_steps: int,
        loss: float,
        samples_per_s: float,
        eval_metrics: dict[str, float] | None = None,
        first_task: str | None = None,
        extra: str = "",
        steps_per_s: float | None = None,
    ) -> str:
        """Log one progress line (rank 0) and return it."""
        parts = [f"step {step}/{total_steps}", f"loss {loss:.4f}"]
        if eval_metrics and first_task and f"{first_task}/ne" in eval_metrics:
            parts.append(
                f"{first_task} NE {eval_metrics[f'{first_task}/ne']:.4f} AUC {eval_metrics[f'{first_task}/auc']:.4f}"
            )
        parts.append(f"{samples_per_s:,.0f} samples/s")
        if steps_per_s:
            parts.append(f"ETA {format_duration((total_steps - step) / steps_per_s)}")
        if extra:
            parts.append(extra)
        line = " | ".join(parts)
        if self.enabled:
            log.info(line)
        return line

    def info(self, msg: str) -> None:
        if self.enabled:
            log.info(msg)

    def flush(self) -> None:
        if self._writer is not None:
            self._writer.flush()

    def close(self) -> None:
        if self._writer is not None:
            self._writer.close()
            self._writer = None


def truncate_metrics(path: str | os.PathLike, step: int) -> int:
    """Keep the records of steps <= `step` in a metrics.jsonl file; returns how many were dropped. A torn last line
    (a crash mid-write) is dropped too. Rewritten in place, so a handle open for appending stays valid."""
    p = Path(path)
    if not p.is_file():
        return 0
    kept, dropped = [], 0
    for line in p.read_text().splitlines():
        try:
            rec = json.loads(line)
        except ValueError:
            dropped += 1
            continue
        if isinstance(rec, dict) and isinstance(rec.get("step"), int) and rec["step"] > step:
            dropped += 1
        else:
            kept.append(line)
    if dropped:
        with open(p, "r+") as f:
            f.write("".join(ln + "\n" for ln in kept))
            f.truncate()
    return dropped
