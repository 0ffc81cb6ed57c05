"""What a run's checkpoint holds (model, optimizer, progress, data position, per-rank RNG) and how it is saved and
resumed; the files themselves are written by gem.train.checkpoint.Checkpointer (DCP, atomic)."""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from typing import Any

import torch
import torch.distributed as dist

from gem.train.checkpoint import Checkpointer, latest_checkpoint, no_checkpoint_error


def restart_count() -> int:
    """How many times torchrun has restarted this job's workers (0: the first attempt, or not under torchrun)."""
    return int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") or 0)


class TrainCheckpointer:
    """Saves and resumes one rank's training state. `info`: rank 0's log line writer."""

    def __init__(
        self,
        checkpointer: Checkpointer,
        par,
        optimizer,
        *,
        rank: int,
        world_size: int,
        device: torch.device,
        info: Callable[[str], None],
    ) -> None:
        self.checkpointer, self.par, self.optimizer = checkpointer, par, optimizer
        self.rank, self.world_size, self.device, self.info = rank, world_size, device, info

    def state(self, step: int, data_state: Mapping[str, int]) -> dict[str, Any]:
        rng = {"torch": torch.get_rng_state()}
        if self.device.type == "cuda":
            rng["cuda"] = torch.cuda.get_rng_state(self.device)
        return {
            "model": self.par.model.state_dict(),
            "optim": self.optimizer.state_dict(),
            "progress": {
                "step": torch.tensor(step, dtype=torch.int64),
                "world_size": torch.tensor(self.world_size),
            },
            "data": {k: torch.tensor(int(v), dtype=torch.int64) for k, v in data_state.items()},
            f"rng_rank{self.rank}": rng,
        }

    def save(self, step: int, data_state: Mapping[str, int]) -> str:
        if self.par.embeddings is not None and self.par.embeddings.n_replicas > 1:
            self.par.sync_embeddings()  # every replica holds the same tables in the checkpoint
        path = self.checkpointer.save(step, self.state(step, data_state))
        self.info(f"checkpoint: {path}")
        return str(path)

    def resume(self, train_data, report_none: bool = True, require: bool = False) -> int | None:
        """Load the newest complete checkpoint (the same on every rank) into the model, optimizer, RNG and
        `train_data`'s position; returns its step, or None when there is none (an error when `require`)."""
        found = latest_checkpoint(self.checkpointer.dir)
        steps = [found[0] if found else -1]
        if self.world_size > 1:  # every rank must pick the same checkpoint
            dist.broadcast_object_list(steps, src=0)
        if steps[0] < 0:
            if require:
                raise no_checkpoint_error(self.checkpointer.dir)
            if report_none:
                self.info(f"resume: no checkpoint in {self.checkpointer.dir}, starting from step 0")
            return None
        path = self.checkpointer.dir / f"step_{steps[0]}"
        self.optimizer.init_state()
        meta = {"progress": {"step": torch.tensor(0, dtype=torch.int64), "world_size": torch.tensor(0)}}
        self.checkpointer.load(path, meta)
        same_world = int(meta["progress"]["world_size"]) == self.world_size
        state = self.state(0, train_data.state_dict())
        if not same_world:  # per-rank RNG streams only carry over to the same world size
            state.pop(f"rng_rank{self.rank}")
        self.checkpointer.load(path, state)
        self.par.model.load_state_dict(state["model"])
        step = int(state["progress"]["step"])
        self.optimizer.load_state_dict(state["optim"], step_count=step)
        train_data.load_state_dict({k: int(v) for k, v in state["data"].items()})
        if same_world:
            rng = state[f"rng_rank{self.rank}"]
            torch.set_rng_state(rng["torch"])
            if self.device.type == "cuda" and "cuda" in rng:
                torch.cuda.set_rng_state(rng["cuda"], self.device)
        restart = f" (torchrun restart {restart_count()})" if restart_count() else ""
        self.info(f"resumed from {path} at step {step}{restart}")
        return step
