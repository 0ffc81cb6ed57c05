"""One way to make a forward kernel function and its backward a differentiable op.

Every Triton op of gem.ops has two faces over the same functions:
- a `torch.library.custom_op` pair (forward, backward) with fake (meta) implementations and the forward's autograd
  registered, so torch.compile traces around the kernels;
- an eager `torch.autograd.Function` that calls the functions directly: the custom op's per-call dispatch costs tens
  of microseconds, as much as a whole short-sequence forward on the H100 / H200.
`KernelOp.__call__` takes the custom op while torch.compile traces and the autograd.Function otherwise.

Conventions (the same for both faces):
- `forward(*inputs)`: the first `n_tensors` inputs are tensors, the rest plain arguments (with optional tensors
  among them, e.g. num_targets, kept as they are); it returns a tensor or a tuple of tensors. Its annotations are the
  custom op's schema.
- `save(inputs, outputs)`: the tensors the backward needs (saved with save_for_backward).
- `backward(*grads, *saved, *rest, **kept)`: grads are those of the outputs not in `nondiff`, rest the inputs after
  the first n_tensors; returns the gradients of the first inputs (as many as it returns; None for the others).
  With `backward_fake` the backward is a custom op too; without, it is called as it is (it may call ops itself,
  e.g. a rotation's backward is the opposite rotation: then it stays differentiable).
- Eager calls may name their batches (gem.ops._common.JaggedBatch): the tables the functions build through
  gem.ops._common.cached are then kept in them, for the other layers and the backward.
- `keep` (eager only): a forward that also returns a dict of tensors the backward takes as keyword arguments, for
  residuals worth keeping when no graph capture or tracing is involved (e.g. a rotated k).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable

import torch

from gem.ops._common import batch_scope, capturing


class KernelOp:
    def __init__(self, name: str, forward: Callable, backward: Callable, *, fake: Callable, save: Callable,
                 n_tensors: int, backward_fake: Callable | None = None, nondiff: tuple[int, ...] = (),
                 keep: Callable | None = None):
        self.name = name
        self.forward, self.backward, self.save, self.keep = forward, backward, save, keep
        self.n_tensors, self.nondiff = n_tensors, tuple(nondiff)
        self.fwd_op = torch.library.custom_op(f"gem::{name}_fwd", forward, mutates_args=())
        self.fwd_op.register_fake(fake)
        self.bwd_op = None
        if backward_fake is not None:
            self.bwd_op = torch.library.custom_op(f"gem::{name}_bwd", backward, mutates_args=())
            self.bwd_op.register_fake(backward_fake)
        self.fwd_op.register_autograd(self._op_backward, setup_context=self._setup)
        self.fn = _eager_function(self)

    def __call__(self, *inputs, batches: tuple | None = None):
        """batches: the call's (query side, key side) gem.ops._common.JaggedBatch, which keeps the tables the eager
        forward and backward build (none while a CUDA graph is captured: the graph then builds its own)."""
        if torch.compiler.is_compiling():
            return self.fwd_op(*inputs)
        if batches is not None and capturing(inputs[0]):
            batches = False  # none: not even those of a call this one runs inside
        return self.fn.apply(batches, *inputs)

    # ------------------------------------------------------------------------------------- shared by both faces
    def _stash(self, ctx, inputs, outputs, kept=None) -> None:
        outs = outputs if isinstance(outputs, tuple) else (outputs,)
        kept = kept or {}
        saved = tuple(self.save(inputs, outputs))
        ctx.save_for_backward(*saved, *kept.values())
        ctx.n_saved = len(saved)
        ctx.kept_names = tuple(kept)
        ctx.rest = tuple(inputs[self.n_tensors:])
        ctx.n_inputs = len(inputs)
        if self.nondiff:
            ctx.mark_non_differentiable(*(outs[i] for i in self.nondiff))

    def _run_backward(self, ctx, grads, backward):
        saved = ctx.saved_tensors
        kept = dict(zip(ctx.kept_names, saved[ctx.n_saved:]))
        grads = tuple(g for i, g in enumerate(grads) if i not in self.nondiff)
        out = backward(*grads, *saved[:ctx.n_saved], *ctx.rest, **kept)
        out = out if isinstance(out, tuple) else (out,)
        return out + (None,) * (ctx.n_inputs - len(out))

    def _setup(self, ctx, inputs, output):
        self._stash(ctx, tuple(inputs), output)

    def _op_backward(self, ctx, *grads):
        return self._run_backward(ctx, grads, self.bwd_op or self.backward)


def _eager_function(op: KernelOp) -> type[torch.autograd.Function]:
    class Fn(torch.autograd.Function):
        @staticmethod
        def forward(ctx, batches, *inputs):
            kept = None
            # batches None: those of the op call this one runs in, if any (a backward calling an op)
            with batch_scope(batches or None) if batches is not None else contextlib.nullcontext():
                if op.keep is not None:
                    outputs, kept = op.keep(*inputs)
                else:
                    outputs = op.forward(*inputs)
            op._stash(ctx, inputs, outputs, kept)
            ctx.batches = batches
            return outputs

        @staticmethod
        def backward(ctx, *grads):
            with batch_scope(ctx.batches or None) if ctx.batches is not None else contextlib.nullcontext():
                return (None, *op._run_backward(ctx, grads, op.backward))

    Fn.__name__ = Fn.__qualname__ = op.name.title().replace("_", "") + "Fn"  # e.g. JfaFn in profiler traces
    return Fn
