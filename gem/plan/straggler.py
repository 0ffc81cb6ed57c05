"""The straggler factor of synchronous data parallelism: E[max] / E[mean] of the ranks' per-step cost.

Each step waits for its slowest rank, so a step of W ranks takes (straggler factor) x the time of a perfectly even
split of the same work. Costs are the model's FLOPs per example (gem.model.flops.example_flops) on history lengths
drawn from each history's length law (gem.data.synthetic.sample_lengths) and, for requests, candidate counts drawn
as the synthetic data draws them; `batches` global batches of W x batch examples each; `none`: rank r takes the r-th block of `batch` examples as drawn, `cost`: the partition of
data.balance=cost (gem.data.balance.partition).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from gem.data.balance import partition
from gem.data.schema import Schema
from gem.data.synthetic import sample_candidate_counts, sample_lengths
from gem.model.flops import example_flops


@dataclass(frozen=True)
class Straggler:
    """E[max] / E[mean] of per-rank cost without balancing (`none`) and with it (`cost`)."""

    none: float
    cost: float

    def factor(self, balance: str) -> float:
        return self.cost if balance == "cost" else self.none


def simulate(model_cfg, schema: Schema, batch: int, world: int, batches: int = 64, seed: int = 0,
             max_candidates: int = 1) -> Straggler:
    """The straggler factors for `world` ranks of `batch` examples (requests of 1..max_candidates candidates, drawn
    as the synthetic data draws them) each (1.0 on one rank)."""
    if world == 1 or batches < 1:
        return Straggler(1.0, 1.0)
    gen = torch.Generator().manual_seed(seed)
    n = world * batch
    per_draw = max(1, (1 << 20) // n)  # batches drawn at once (about a million lengths)
    max_none = max_cost = total = 0.0
    for start in range(0, batches, per_draw):
        k = min(per_draw, batches - start)
        lengths = {h.name: sample_lengths(h, k * n, gen) for h in schema.histories}
        counts = sample_candidate_counts(max_candidates, k * n, gen) if max_candidates > 1 else None
        costs = example_flops(model_cfg, lengths, counts).numpy().reshape(k, world, batch)
        max_none += costs.sum(2).max(1).sum()
        total += costs.sum()
        for c in costs.reshape(k, n):
            max_cost += np.bincount(partition(c, world), weights=c, minlength=world).max()
    mean = total / world
    return Straggler(none=float(max_none / mean), cost=float(max_cost / mean))
