"""The training batch stream: from a dataset position, validated before a batch reaches the model.

`num_workers` > 0: DataLoader worker processes make and validate the batches (the training thread only receives
them). A worker's failure travels as a `FailedBatch` and is raised in the training process with the same one-line
message as inline validation, at the step whose batch failed.
"""

from __future__ import annotations

import collections
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch.utils.data import DataLoader, IterableDataset

from gem.config import UserError
from gem.data.batch import Batch
from gem.data.validate import validate_batch


class BadBatchError(UserError):
    """A training batch failed validation (raised before it reaches forward or any optimizer step)."""


class FailedBatch:
    """What a DataLoader worker sends instead of a batch that failed (a worker's exception would reach the training
    process wrapped in a traceback dump; this carries the one-line message). `invalid`: failed validation."""

    def __init__(self, message: str, invalid: bool, user: bool = False) -> None:
        self.message, self.invalid, self.user = message, invalid, user


class WorkerBatches(IterableDataset):
    """Runs in DataLoader workers: yields (index, batch) with the batch already validated, or (index, FailedBatch)
    and stops. `index`: the batch's position in the dataset's stream (None when the dataset has no `state_dict`)."""

    def __init__(self, dataset, schema) -> None:
        super().__init__()
        self.dataset, self.schema = dataset, schema

    def __iter__(self) -> Iterator[tuple[int | None, Batch | FailedBatch]]:
        it = iter(self.dataset)
        while True:
            try:
                batch = next(it)
            except StopIteration:
                return
            except ValueError as e:
                yield None, FailedBatch(str(e), invalid=False, user=isinstance(e, UserError))
                return
            # The datasets advance their position to just past the batch they yield.
            index = int(self.dataset.state_dict()["batch_index"]) - 1 if hasattr(self.dataset, "state_dict") else None
            try:
                validate_batch(batch, self.schema)
            except ValueError as e:
                yield index, FailedBatch(str(e), invalid=True)
                return
            yield index, batch


class InOrder:
    """The (index, item) pairs of a worker DataLoader put back in stream order from `start`.

    The workers of a dataset started mid-stream need not take turns in stream order (worker w makes the batches
    i = w mod n), so up to one round of batches is held back until its turn; a failure surfaces at its turn too.
    """

    def __init__(self, it: Iterator[tuple[int | None, Any]], start: int) -> None:
        self._it = it
        self._next = start
        self._held: dict[int, Any] = {}

    def __iter__(self) -> InOrder:
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


class ValidatedBatches:
    """Iterates a dataset's batches, validating each (before it reaches the model) and noting its FLOPs and
    candidate rows.

    `validate=False`: the batches were validated where they were made (DataLoader workers), which send a
    FailedBatch in place of a bad one; it raises here, in the training process, with the same message as inline
    validation. `first_step`: the step (0-based) that consumes the first batch, for the error message.
    """

    def __init__(
        self, it: Iterator[Any], schema, flops_of: Callable[[Batch], float], first_step: int, validate: bool = True
    ) -> None:
        self._it = it
        self._schema = schema
        self._flops_of = flops_of
        self._next_step = first_step
        self._validate = validate
        self.flops: collections.deque[float] = collections.deque()  # per batch handed out, oldest first
        self.samples: collections.deque[int] = collections.deque()  # candidate rows per batch handed out

    def __iter__(self) -> ValidatedBatches:
        return self

    def __next__(self) -> Batch:
        batch = next(self._it)
        step = self._next_step
        self._next_step += 1
        if isinstance(batch, FailedBatch):
            if batch.invalid:
                raise BadBatchError(f"training batch of step {step + 1}: {batch.message}")
            raise (UserError if batch.user else ValueError)(batch.message)  # what the dataset raised
        if self._validate:
            try:
                validate_batch(batch, self._schema)
            except ValueError as e:
                raise BadBatchError(f"training batch of step {step + 1}: {e}") from None
        self.flops.append(self._flops_of(batch))
        self.samples.append(batch.batch_size)
        return batch


class TrainBatches(ValidatedBatches):
    """A training dataset's validated batches from stream position `position` (the batch of step `first_step`).

    With `num_workers` > 0 the dataset's own position only advances inside the workers (and runs ahead of training
    by the prefetched batches), so the stream restarts at `position` rather than at the dataset's count.
    `seed` seeds the workers (not the global RNG, so the training RNG stream does not depend on `num_workers`).
    `close()` shuts the workers down.
    """

    def __init__(
        self,
        dataset,
        schema,
        flops_of: Callable[[Batch], float],
        *,
        position: int,
        first_step: int,
        num_workers: int = 0,
        pin_memory: bool = False,
        seed: int = 0,
    ) -> None:
        if hasattr(dataset, "load_state_dict"):
            dataset.load_state_dict({"batch_index": position})
        self._loader_iter: Iterator[Any] | None = None
        if num_workers == 0:
            super().__init__(iter(dataset), schema, flops_of, first_step, validate=True)
            return
        loader = DataLoader(
            WorkerBatches(dataset, schema),
            batch_size=None,  # the dataset yields whole batches
            num_workers=num_workers,
            pin_memory=pin_memory,
            prefetch_factor=2,
            persistent_workers=True,
            generator=torch.Generator().manual_seed(seed),
        )
        self._loader_iter = iter(loader)
        super().__init__(InOrder(self._loader_iter, position), schema, flops_of, first_step, validate=False)

    @property
    def workers_running(self) -> bool:
        return self._loader_iter is not None

    def close(self) -> None:
        it, self._loader_iter = self._loader_iter, None
        # now, not when a traceback holding the iterator is freed (DataLoader has no public shutdown)
        if it is not None and hasattr(it, "_shutdown_workers"):
            it._shutdown_workers()
