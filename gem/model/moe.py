"""Mixture of SwiGLU experts with a softmax top-k router and a swappable token dispatcher.

Forward of `MoE` on x [N, d_model]:
  1. router: p = softmax(x @ W_r) in fp32 [N, E]; top-k experts per token, gates renormalised to sum to 1.
  2. Switch-style load-balancing loss: aux = coef * E * sum_e f_e * P_e, with f_e the share of the N*k
     assignments that went to expert e and P_e the mean router probability of e (= coef when balanced).
  3. assignments are sorted by expert id (stable, so earlier tokens come first); with `capacity_factor`
     each expert keeps at most ceil(capacity_factor * N * k / E) assignments and drops the rest (their
     contribution is 0; the block's residual carries the token). capacity_factor=None is dropless.
  4. `dispatcher.dispatch` -> the experts this rank owns run SwiGLU on their rows -> `dispatcher.combine`;
     the results are scaled by their gates and summed back per token.

Dispatcher interface (the `dispatcher` attribute; `LocalDispatcher` is the default, expert parallelism swaps in
an all-to-all one). Every method must be differentiable in its tensor inputs and must not reorder within an
expert's group beyond what combine undoes:

  local_expert_range(num_experts) -> (first, count)
      The global ids [first, first + count) of the experts this rank computes.
  dispatch(x_sorted, tokens_per_expert) -> (x_local, tokens_per_local_expert, ctx)
      x_sorted [n, d]: this rank's kept assignments grouped by global expert id, ascending;
      tokens_per_expert [E] int64 (on x's device): group sizes, sum = n.
      x_local [m, d]: the rows for the local experts from every rank, grouped by local expert ascending;
      tokens_per_local_expert [count] int64: their group sizes; ctx: whatever combine needs.
  combine(y_local, ctx) -> y_sorted
      The inverse of dispatch on the expert outputs: y_local [m, d] in x_local's row order -> [n, d] in
      x_sorted's order.

Expert weights are batched parameters w1, w3 [E, d_model, d_ff] and w2 [E, d_ff, d_model]. The parallel layer
may shard them along dim 0 (a DTensor, or a plain parameter holding only the local experts); the experts read
them only through `local_expert_weights()`, which returns the `count` local experts in either case.
Grouped GEMM (`torch._grouped_mm`, groups padded to 16 rows) runs on CUDA in bf16 (or under CUDA autocast) when
`use_grouped_mm` allows it; elsewhere a loop over experts.
"""

from __future__ import annotations

import math
from typing import Any, Protocol

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor


class Dispatcher(Protocol):
    def local_expert_range(self, num_experts: int) -> tuple[int, int]: ...

    def dispatch(self, x_sorted: torch.Tensor, tokens_per_expert: torch.Tensor
                 ) -> tuple[torch.Tensor, torch.Tensor, Any]: ...

    def combine(self, y_local: torch.Tensor, ctx: Any) -> torch.Tensor: ...

    def host_sizes(self, ctx: Any) -> list[int] | None:
        """Rows per local expert as host ints when dispatch already has them (saves the loop path a sync)."""
        ...


class LocalDispatcher:
    """Every expert lives here: dispatch and combine are the identity."""

    def local_expert_range(self, num_experts: int) -> tuple[int, int]:
        return 0, num_experts

    def dispatch(self, x_sorted, tokens_per_expert):
        return x_sorted, tokens_per_expert, None

    def combine(self, y_local, ctx):
        return y_local

    def host_sizes(self, ctx):
        return None


class _MaskGrad(torch.autograd.Function):
    """Identity on [E, ...] weights whose backward zeroes the gradient of experts where `keep` is False."""

    @staticmethod
    def forward(ctx, w, keep):
        ctx.save_for_backward(keep)
        return w.view_as(w)

    @staticmethod
    def backward(ctx, g):
        (keep,) = ctx.saved_tensors
        return g * keep.view(-1, *([1] * (g.dim() - 1))).to(g.dtype), None


def _grouped_mm_available() -> bool:
    return hasattr(torch, "_grouped_mm")


class MoE(nn.Module):
    def __init__(self, d_model: int, d_ff: int, num_experts: int, top_k: int, *,
                 capacity_factor: float | None = None, aux_loss_coef: float = 0.01):
        super().__init__()
        if not 0 < top_k <= num_experts:
            raise ValueError(f"top_k={top_k} must be in [1, num_experts={num_experts}]")
        if capacity_factor is not None and capacity_factor <= 0:
            raise ValueError(f"capacity_factor={capacity_factor} must be > 0 or None (dropless)")
        self.d_model, self.d_ff, self.num_experts, self.top_k = d_model, d_ff, num_experts, top_k
        self.capacity_factor, self.aux_loss_coef = capacity_factor, aux_loss_coef
        self.router = nn.Linear(d_model, num_experts, bias=False)
        self.w1 = nn.Parameter(torch.empty(num_experts, d_model, d_ff))
        self.w3 = nn.Parameter(torch.empty(num_experts, d_model, d_ff))
        self.w2 = nn.Parameter(torch.empty(num_experts, d_ff, d_model))
        self.dispatcher: Dispatcher = LocalDispatcher()
        # True / None: grouped GEMM when on CUDA in bf16; False: the per-expert loop (model.moe.grouped_mm).
        self.use_grouped_mm: bool | None = None
        # row-wise fp8 grouped GEMMs, chosen by set_gemm_precision
        self.fp8_experts = False
        self.reset_parameters()

    def set_gemm_precision(self, precision: str) -> bool:
        """The experts' GEMM format for `train.precision` (apply_precision calls it on the MoE layers its filter
        names): fp8 and fp8_block run the row-wise fp8 grouped GEMM where d_model and d_ff are multiples of 16, the
        other formats bf16. Returns whether the experts run in fp8."""
        self.fp8_experts = precision in ("fp8", "fp8_block") and self.d_model % 16 == 0 and self.d_ff % 16 == 0
        return self.fp8_experts

    def reset_parameters(self) -> None:
        for w, fan_in in ((self.w1, self.d_model), (self.w3, self.d_model), (self.w2, self.d_ff)):
            bound = 1.0 / math.sqrt(fan_in)
            nn.init.uniform_(w, -bound, bound)
        self.router.reset_parameters()

    # -- routing ---------------------------------------------------------------------------------------------------
    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """-> (gates [N, k] (fp32 at least) renormalised, expert ids [N, k] int64, aux loss scalar fp32)."""
        gates, idx, probs = self._gates(x)
        counts = _counts_sorted(torch.sort(idx.flatten()).values, self.num_experts)
        return gates, idx, self._aux_loss(probs, counts)

    def _gates(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """-> (gates [N, k] renormalised, expert ids [N, k], router probabilities [N, E])."""
        # Route in fp32 (fp64 stays fp64), also under autocast: bf16 logits flip near-tied top-k choices.
        dt = torch.promote_types(x.dtype, torch.float32)
        with torch.autocast(x.device.type, enabled=False):
            logits = F.linear(x.to(dt), self.router.weight.to(dt))
        probs = torch.softmax(logits, dim=-1)
        gates, idx = torch.topk(probs, self.top_k, dim=-1)
        return gates / gates.sum(dim=-1, keepdim=True), idx, probs

    def _aux_loss(self, probs: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """Load-balancing loss from the router probabilities and the assignments per expert (counts [E], taken
        from the sorted assignments: a scatter-add of N·k ones into E bins serialises on atomics)."""
        n = probs.shape[0]
        if n == 0 or self.aux_loss_coef == 0:
            return probs.sum() * 0.0  # keeps the router in the graph
        frac = counts.to(probs.dtype) / (n * self.top_k)
        return self.aux_loss_coef * self.num_experts * (frac * probs.mean(dim=0)).sum()

    def capacity(self, num_tokens: int) -> int | None:
        if self.capacity_factor is None:
            return None
        return math.ceil(self.capacity_factor * num_tokens * self.top_k / self.num_experts)

    # -- experts ---------------------------------------------------------------------------------------------------
    def local_expert_weights(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(w1, w3, w2) of the local experts only, whether the parameters hold all E or just the local ones."""
        first, count = self.dispatcher.local_expert_range(self.num_experts)
        out = []
        for w in (self.w1, self.w3, self.w2):
            if isinstance(w, DTensor):  # sharded over the expert dim (isinstance: Dynamo traces it, hasattr not)
                w = w.to_local()
            if w.shape[0] == self.num_experts and count != self.num_experts:
                w = w[first:first + count]
            elif w.shape[0] != count:
                raise RuntimeError(f"expert weights hold {w.shape[0]} experts; the dispatcher reports {count} local "
                                   f"of {self.num_experts}")
            out.append(w)
        return tuple(out)

    def _use_grouped(self, x: torch.Tensor) -> bool:
        if self.use_grouped_mm is False or not x.is_cuda or not _grouped_mm_available():
            return False
        return x.dtype == torch.bfloat16 or torch.is_autocast_enabled("cuda")

    def experts(self, x: torch.Tensor, tokens_per_local_expert: torch.Tensor,
                sizes: list[int] | None = None) -> torch.Tensor:
        """SwiGLU of each row by its local expert; rows grouped by local expert ([m, d] -> [m, d]). `sizes`: the
        same counts as host ints, when known (else the loop path reads them from the device)."""
        w1, w3, w2 = self.local_expert_weights()
        if x.shape[0] == 0:
            # The dtype the non-empty paths produce: under expert parallelism the ranks exchange these rows, and
            # a rank sending bf16 to one expecting fp32 leaves the receiver waiting for bytes that never come.
            out = torch.bfloat16 if self._use_grouped(x) else (
                torch.get_autocast_dtype(x.device.type) if torch.is_autocast_enabled(x.device.type) else x.dtype)
            return x.new_zeros((0, self.d_model), dtype=out) + 0.0 * (w1.sum() + w3.sum() + w2.sum()).to(out)
        if self._use_grouped(x):
            return self._grouped_experts(x, tokens_per_local_expert, w1, w3, w2)
        if sizes is None:
            sizes = tokens_per_local_expert.tolist()
        outs = []
        for e, xe in enumerate(torch.split(x, sizes, dim=0)):
            if xe.shape[0] == 0:
                continue
            w1e, w3e, w2e = (w[e].to(x.dtype) for w in (w1, w3, w2))
            outs.append((F.silu(xe @ w1e) * (xe @ w3e)) @ w2e)
        return torch.cat(outs, dim=0)

    GROUP_ALIGN = 16  # rows per grouped-GEMM group are padded to a multiple of this, and at least this

    def _grouped_experts(self, x, counts, w1, w3, w2):
        """Grouped GEMM of rows grouped by expert: scattered (on device, no host sync) into padded groups."""
        m, e = x.shape[0], counts.numel()
        starts = torch.cumsum(counts, 0) - counts
        starts_p, offs = _padded_groups(counts, self.GROUP_ALIGN)
        expert = torch.repeat_interleave(torch.arange(e, device=x.device), counts, output_size=m)
        dest = starts_p[expert] + torch.arange(m, device=x.device) - starts[expert]
        buf = x.new_zeros((m + e * self.GROUP_ALIGN, x.shape[1]), dtype=torch.bfloat16)
        buf = buf.index_copy(0, dest, x.to(torch.bfloat16))
        return _grouped_swiglu(buf, offs, counts > 0, w1, w3, w2, self.fp8_experts)[dest]

    # -- forward ---------------------------------------------------------------------------------------------------
    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [N, d_model] -> (y [N, d_model], aux loss scalar (fp32 at least)).

        Every (token, slot) assignment gets a row `pos` in the buffer the experts read (rows grouped by expert);
        tokens are copied there in one scatter and the outputs come back in one gather that sums each token's k
        rows with their gates. Both are permutations, so their backward passes are a gather and a scatter too:
        no atomics, no host sync, and static shapes on the local grouped-GEMM path (torch.compile keeps them).
        """
        n, k, e = x.shape[0], self.top_k, self.num_experts
        gates, idx, probs = self._gates(x)
        flat = idx.flatten()
        order = torch.argsort(flat, stable=True)  # earlier tokens first within an expert (capacity keeps them)
        expert_sorted = flat[order]
        counts = _counts_sorted(expert_sorted, e)
        aux = self._aux_loss(probs, counts)
        starts = torch.cumsum(counts, 0) - counts
        rank_in_expert = torch.arange(flat.numel(), device=x.device) - starts[expert_sorted]
        cap = self.capacity(n)
        kept = counts if cap is None else counts.clamp(max=cap)
        grouped_local = isinstance(self.dispatcher, LocalDispatcher) and self._use_grouped(x)
        if grouped_local:
            dest_starts, offs = _padded_groups(kept, self.GROUP_ALIGN)
            rows = flat.numel() + e * self.GROUP_ALIGN  # static bound on the padded rows
        else:
            dest_starts = torch.cumsum(kept, 0) - kept
            rows = flat.numel() if cap is None else int(kept.sum())  # capacity: the exact kept rows (host sync)
        pos_sorted = dest_starts[expert_sorted] + rank_in_expert
        keep = None
        if cap is not None:
            keep_sorted = rank_in_expert < cap
            pos_sorted = torch.where(keep_sorted, pos_sorted, rows)  # dropped: one spare row past the groups
            keep = torch.empty_like(keep_sorted).scatter_(0, order, keep_sorted).view(n, k)
        pos = torch.empty_like(pos_sorted).scatter_(0, order, pos_sorted)  # [n * k]: (token, slot) -> row
        spare = 0 if cap is None else 1
        if grouped_local:
            pad = _pad_rows(dest_starts, kept, offs, self.GROUP_ALIGN, rows + spare)
            buf = _ScatterRows.apply(x.to(torch.bfloat16), pos, k, rows + spare, pad)
            w1, w3, w2 = self.local_expert_weights()
            out = _grouped_swiglu(buf[:rows], offs, kept > 0, w1, w3, w2, self.fp8_experts)
        else:
            pad = None  # every row but the spare one holds an assignment
            x_sorted = _ScatterRows.apply(x, pos, k, rows + spare, pad)[:rows]
            x_local, per_local, ctx = self.dispatcher.dispatch(x_sorted, kept)
            y_local = self.experts(x_local, per_local, self.dispatcher.host_sizes(ctx))
            out = self.dispatcher.combine(y_local, ctx)
        if spare:
            out = torch.cat([out, out.new_zeros(1, out.shape[1])])
        # Sum the k expert outputs per token in fp32 at least (bf16 expert outputs would round each partial sum).
        acc = torch.promote_types(out.dtype, torch.float32)
        g = gates.to(acc) if keep is None else torch.where(keep, gates.to(acc), 0.0)
        y = _GatherRows.apply(out, pos, g, pad)
        return y.to(x.dtype), aux


def _counts_sorted(expert_sorted: torch.Tensor, num_experts: int) -> torch.Tensor:
    """Assignments per expert [E] int64 from the sorted expert ids (no bincount: its output size depends on the data,
    which torch.compile cannot keep in one graph)."""
    edges = torch.searchsorted(expert_sorted, torch.arange(num_experts + 1, device=expert_sorted.device))
    return edges[1:] - edges[:-1]


def _padded_groups(counts: torch.Tensor, align: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(start row of each group, int32 end offsets) when every group is padded to a multiple of `align`, at least
    `align`: torch._grouped_mm's backward gave wrong weight gradients for empty or ragged groups."""
    padded = torch.clamp_min((counts + align - 1) // align * align, align)
    ends = torch.cumsum(padded, 0)
    return ends - padded, ends.to(torch.int32)


def _pad_rows(starts: torch.Tensor, kept: torch.Tensor, ends: torch.Tensor, align: int, total: int) -> torch.Tensor:
    """Indices (static count) that cover every row of a padded-group buffer of `total` rows that no assignment
    occupies: each group's < `align` rows after its data, the rows past the last group and the last row. Some
    point at occupied rows of the next group or repeat: zero them before the assignments are copied in."""
    j = torch.arange(align, device=kept.device)
    tail = ends[-1].to(kept.dtype) + torch.arange(kept.numel() * align, device=kept.device)
    last = torch.full((1,), total - 1, dtype=kept.dtype, device=kept.device)
    return torch.cat([((starts + kept)[:, None] + j).flatten(), tail, last]).clamp_(max=total - 1)


def _rows_buffer(src: torch.Tensor, rows: int, pad: torch.Tensor | None) -> torch.Tensor:
    """[rows, d] buffer for a row scatter: zero where `pad` points (all of it without `pad`); the scatter writes
    the rest. Zeroing only the unoccupied rows saves a full pass over the buffer."""
    if pad is None:
        return src.new_zeros((rows, src.shape[-1]))
    return src.new_empty((rows, src.shape[-1])).index_fill_(0, pad, 0)


def _grouped_swiglu(buf, offs, used, w1, w3, w2, fp8=False):
    """SwiGLU experts on padded groups of `buf` (bf16) with torch._grouped_mm (row-wise fp8 GEMMs if `fp8`)."""
    # The weight gradient of a group with only padding rows came back non-zero on the H200 (torch 2.11):
    # experts without tokens get their gradient masked to zero.
    w1, w3, w2 = (_MaskGrad.apply(w.to(torch.bfloat16), used) for w in (w1, w3, w2))
    if fp8:
        from gem.model.precision import fp8_grouped_mm as mm
    else:
        def mm(a, w, offs):
            return torch._grouped_mm(a, w, offs=offs)
    h = F.silu(mm(buf, w1, offs)) * mm(buf, w3, offs)
    return mm(h, w2, offs)


class _ScatterRows(torch.autograd.Function):
    """x [n, d] -> buffer [rows, d] whose row pos[t * k + j] holds x[t]; other rows are zero (`pad`, when given,
    covers every row pos does not; without it, pos covers every row but spare ones that are never read).

    pos must be unique except on spare rows (never read back with a non-zero gate)."""

    @staticmethod
    def forward(ctx, x, pos, k, rows, pad):
        ctx.save_for_backward(pos)
        ctx.k = k
        buf = _rows_buffer(x, rows, pad)
        for pj in pos.view(-1, k).unbind(1):
            buf.index_copy_(0, pj, x)
        return buf

    @staticmethod
    def backward(ctx, g):
        (pos,) = ctx.saved_tensors
        gx = None
        for pj in pos.view(-1, ctx.k).unbind(1):
            gj = g.index_select(0, pj)
            gx = gj if gx is None else gx + gj
        return gx, None, None, None, None


class _GatherRows(torch.autograd.Function):
    """y[t] = sum_j gates[t, j] * out[pos[t * k + j]], accumulated in the gates' dtype. The gradient of `out` is
    zero on the rows pos does not name (`pad` as for _ScatterRows)."""

    @staticmethod
    def forward(ctx, out, pos, gates, pad):
        n, k = gates.shape
        rows = out[pos].view(n, k, out.shape[1])
        ctx.save_for_backward(pos, gates, rows, pad)
        ctx.rows = out.shape[0]
        return (rows.to(gates.dtype) * gates[..., None]).sum(1)

    @staticmethod
    def backward(ctx, gy):
        pos, gates, rows, pad = ctx.saved_tensors
        g_rows = (gy[:, None, :] * gates[..., None]).to(rows.dtype).flatten(0, 1)
        g_out = _rows_buffer(rows, ctx.rows, pad).index_copy_(0, pos, g_rows)
        g_gates = (gy[:, None, :] * rows.to(gy.dtype)).sum(-1)
        return g_out, None, g_gates, None
