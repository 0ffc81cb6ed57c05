"""One-device rehearsal of W data-parallel ranks: each rank's share of a global batch trained one after another.

A synchronous step of W ranks lasts as long as its slowest rank's forward + backward + optimizer step, plus the
collectives. Here the W shares of each global batch run one after another on one device, each timed alone (host
clock around the step, the device synchronised before and after; the copy to the device is not timed); the
slowest is the step a W-rank job would wait for, communication excluded, and the mean is what a perfectly even
split would take. Shares: as drawn (`none`: rank r's batch of the step) and after data.balance=cost's split, for
the same global batches, the two alternating which goes first.
"""

from __future__ import annotations

import dataclasses
import statistics
import time
from dataclasses import dataclass, field

import numpy as np
import torch

from gem.data import Batch, build_dataset
from gem.data.balance import BalancedDataset, take_rows
from gem.model.flops import example_cost
from gem.train.step import train_step

MODES = ("none", "cost")


@dataclass
class Rehearsal:
    """Per measured global batch and mode: every share's step milliseconds (rank order)."""

    world: int
    share_ms: dict[str, list[list[float]]] = field(default_factory=lambda: {m: [] for m in MODES})

    def step_ms(self, mode: str) -> float:
        """Mean over global batches of the slowest share: the synchronous step."""
        return statistics.fmean(max(s) for s in self.share_ms[mode])

    def even_ms(self, mode: str) -> float:
        """Mean over global batches of the mean share: a perfectly even split of the same work."""
        return statistics.fmean(statistics.fmean(s) for s in self.share_ms[mode])

    def summary(self) -> dict[str, float]:
        out = {f"step_ms_{m}": self.step_ms(m) for m in MODES}
        out.update({f"even_ms_{m}": self.even_ms(m) for m in MODES})
        out["speedup"] = out["step_ms_none"] / out["step_ms_cost"]
        return out


def build_trainer(overrides: list[str]):
    """A one-rank Trainer for these training overrides, on the plain loop (each share's step timed alone)."""
    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    from gem.train.__main__ import CONFIG_DIR, _register_resolvers
    from gem.train.trainer import Trainer

    _register_resolvers()
    GlobalHydra.instance().clear()
    try:
        with initialize_config_dir(version_base="1.3", config_dir=CONFIG_DIR, job_name="gem_rehearse"):
            cfg = compose(config_name="config", overrides=[*overrides, "train.pipeline=none", "train.tensorboard=false"])
    finally:
        GlobalHydra.instance().clear()
    return Trainer(cfg)


def shares(trainer, world: int, index: int) -> dict[str, list[Batch]]:
    """The W shares of global batch `index` of the trainer's training data: as drawn and balanced."""
    data = dataclasses.replace(trainer.cfgs.data, balance="none")
    source = build_dataset(data, 0, world, split="train")
    drawn = [source.batch(index, rank=q) for q in range(world)]
    whole, part, _ = BalancedDataset(source, example_cost(trainer.cfgs.model)).split(index)
    balanced = [take_rows(whole, np.flatnonzero(part == q)) for q in range(world)]
    return {"none": drawn, "cost": balanced}


def _timed_step(trainer, batch: Batch, step: int) -> float:
    b = batch.to(trainer.device)
    sync = torch.cuda.synchronize if trainer.device.type == "cuda" else (lambda: None)
    sync()
    t0 = time.perf_counter()
    train_step(trainer.model, trainer.optimizer, b, trainer.step_cfg, step)
    sync()
    return 1e3 * (time.perf_counter() - t0)


def rehearse(trainer, world: int, batches: int, warmup: int = 1) -> Rehearsal:
    """`warmup` global batches (both modes, not recorded), then `batches` measured ones."""
    out = Rehearsal(world)
    step = 0
    for i in range(warmup + batches):
        by_mode = shares(trainer, world, i)
        for mode in (MODES if i % 2 == 0 else MODES[::-1]):
            times = []
            for b in by_mode[mode]:
                step += 1
                times.append(_timed_step(trainer, b, step))
            if i >= warmup:
                out.share_ms[mode].append(times)
    return out
