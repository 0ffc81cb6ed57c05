"""Evaluation: every rank runs its evaluation batches, then its share of the rows past the last whole round of
batches (eval files: every row counts); the metrics are aggregated over all ranks (a rank with no rows adds none)."""

from __future__ import annotations

import torch
import torch.distributed as dist

from gem.data import validate_batch
from gem.train.metrics import TaskMetrics
from gem.train.step import StepConfig, autocast


class Evaluator:
    """NE / AUC / calibration / log-loss per task over one pass of `dataset` (see TaskMetrics), over candidates;
    GAUC by request too when the batches are requests (cand_offsets)."""

    def __init__(self, par, dataset, schema, cfg: StepConfig, device: torch.device) -> None:
        self.par, self.dataset, self.schema, self.cfg, self.device = par, dataset, schema, cfg, device
        self.metrics = TaskMetrics(list(cfg.tasks))

    @torch.no_grad()
    def __call__(self) -> dict[str, float]:
        model = self.par.model
        model.eval()
        self.metrics.reset()
        seen = 0  # requests of this pass on this rank: their ids where the data gives none
        if self.par.embeddings is not None and self.par.embeddings.n_replicas > 1:
            self.par.sync_embeddings()  # every replica evaluates the same tables
        for batch, real in self._batches():
            validate_batch(batch, self.schema)
            batch = batch.to(self.device, non_blocking=True)
            with autocast(self.cfg):
                out = model(batch)
            if real:
                groups = None
                if batch.cand_offsets is not None:
                    groups = batch.candidate_groups()
                    if batch.request_ids is None:  # unique over batches and ranks
                        world, rank = (dist.get_world_size(), dist.get_rank()) if dist.is_initialized() else (1, 0)
                        groups = (groups + seen) * world + rank
                    seen += batch.num_requests
                    groups = groups[:real]
                self.metrics.update(out.logits.float()[:real], batch.labels[:real], groups=groups)
        model.train()
        return self.metrics.compute()  # `num_samples`: the rows evaluated on all ranks

    def _batches(self):
        """(batch, rows that count): the whole batches, then the last, partial round (padded to one size on every
        rank; the padding does not count)."""
        for batch in self.dataset:
            yield batch, batch.labels.shape[0]
        last = getattr(self.dataset, "last_rows", None)
        tail = last() if callable(last) else None
        if tail is not None:
            yield tail
