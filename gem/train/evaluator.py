"""Evaluation: every rank runs its evaluation batches; the metrics are aggregated over all ranks."""

from __future__ import annotations

import torch

from gem.data import validate_batch
from gem.train.metrics import TaskMetrics
from gem.train.step import StepConfig, autocast


class Evaluator:
    """NE / AUC / calibration / log-loss per task over one pass of `dataset` (see TaskMetrics)."""

    def __init__(self, par, dataset, schema, cfg: StepConfig, device: torch.device) -> None:
        self.par, self.dataset, self.schema, self.cfg, self.device = par, dataset, schema, cfg, device
        self.metrics = TaskMetrics(list(cfg.tasks))

    @torch.no_grad()
    def __call__(self) -> dict[str, float]:
        model = self.par.model
        model.eval()
        self.metrics.reset()
        if self.par.embeddings is not None and self.par.embeddings.n_replicas > 1:
            self.par.sync_embeddings()  # every replica evaluates the same tables
        for batch in self.dataset:
            validate_batch(batch, self.schema)
            batch = batch.to(self.device, non_blocking=True)
            with autocast(self.cfg):
                out = model(batch)
            self.metrics.update(out.logits.float(), batch.labels)
        model.train()
        return self.metrics.compute()
