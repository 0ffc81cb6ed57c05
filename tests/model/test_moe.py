import math

import pytest
import torch
import torch.nn.functional as F

from gem.model.moe import LocalDispatcher, MoE


def naive_moe(m: MoE, x: torch.Tensor) -> torch.Tensor:
    """Per-token loop over its top-k experts, gates renormalised (fp64 inputs give an fp64 reference)."""
    out = []
    for i in range(x.shape[0]):
        p = torch.softmax(x[i] @ m.router.weight.T, dim=-1)
        g, e = torch.topk(p, m.top_k)
        g = g / g.sum()
        y = torch.zeros_like(x[i])
        for gj, ej in zip(g, e.tolist()):
            y = y + gj * ((F.silu(x[i] @ m.w1[ej]) * (x[i] @ m.w3[ej])) @ m.w2[ej])
        out.append(y)
    return torch.stack(out) if out else x.new_zeros(x.shape)


def _grads(m, x, y):
    return torch.autograd.grad(y.pow(2).sum(), [x, m.router.weight, m.w1, m.w2, m.w3], allow_unused=True)


@pytest.mark.parametrize("n,d,f,e,k", [(1, 8, 16, 4, 1), (13, 8, 12, 4, 2), (37, 16, 8, 5, 3), (0, 8, 8, 4, 2)])
def test_moe_matches_per_token_loop(n, d, f, e, k):
    torch.manual_seed(n + e)
    m = MoE(d, f, e, k).double()
    x = torch.randn(n, d, dtype=torch.float64, requires_grad=True)
    y, aux = m(x)
    ref = naive_moe(m, x)
    torch.testing.assert_close(y, ref)
    if n:
        for a, b in zip(_grads(m, x, y), _grads(m, x, ref)):
            torch.testing.assert_close(a, b)
    assert aux.dim() == 0 and torch.isfinite(aux)


def test_capacity_drops_the_later_tokens():
    torch.manual_seed(0)
    d, e, n = 8, 4, 12
    m = MoE(d, 8, e, 1, capacity_factor=1.0).double()
    with torch.no_grad():
        m.router.weight.zero_()
        m.router.weight[2, 0] = 10.0  # every token with x[:, 0] > 0 goes to expert 2
    x = torch.randn(n, d, dtype=torch.float64)
    x[:, 0] = 1.0
    cap = math.ceil(1.0 * n * 1 / e)
    assert m.capacity(n) == cap == 3
    y, _ = m(x)
    ref = naive_moe(m, x)
    # the first `cap` tokens (token order) are computed, the rest are dropped (zero contribution)
    torch.testing.assert_close(y[:cap], ref[:cap])
    assert torch.count_nonzero(y[cap:]) == 0
    # a generous factor drops nothing
    m.capacity_factor = float(e)
    torch.testing.assert_close(m(x)[0], ref)


def test_capacity_with_top2_drops_per_expert():
    torch.manual_seed(1)
    d, e, n, k = 8, 4, 20, 2
    m = MoE(d, 8, e, k, capacity_factor=0.5).double()
    x = torch.randn(n, d, dtype=torch.float64)
    cap = m.capacity(n)
    y, _ = m(x)
    # hand-made: keep assignment (token i, slot j) iff fewer than cap earlier assignments went to its expert
    p = torch.softmax(x @ m.router.weight.T, -1)
    g, idx = torch.topk(p, k)
    g = g / g.sum(-1, keepdim=True)
    used = [0] * e
    ref = torch.zeros_like(x)
    for i in range(n):
        for j in range(k):
            ex = int(idx[i, j])
            if used[ex] < cap:
                used[ex] += 1
                ref[i] += g[i, j] * ((F.silu(x[i] @ m.w1[ex]) * (x[i] @ m.w3[ex])) @ m.w2[ex])
    torch.testing.assert_close(y, ref)
    assert sum(used) < n * k  # something really was dropped


def test_aux_loss_minimal_for_uniform_routing():
    d, e, n = 8, 4, 64
    m = MoE(d, 8, e, 2, aux_loss_coef=0.1)
    x = torch.randn(n, d)
    with torch.no_grad():
        m.router.weight.zero_()  # uniform probabilities; ties spread assignments evenly only in f, P is uniform
    _, aux_uniform = m(x)
    torch.testing.assert_close(aux_uniform, torch.tensor(0.1))  # coef * E * sum(f_e / E) = coef
    with torch.no_grad():
        m.router.weight.zero_()
        m.router.weight[0, 0] = 5.0
        m.router.weight[1, 0] = 4.0
    x[:, 0] = 1.0  # skewed routing toward experts 0 and 1
    _, aux_skewed = m(x)
    assert aux_skewed > aux_uniform * 1.5
    # balanced hard routing: each expert gets an equal share and equal mean probability
    with torch.no_grad():
        m.router.weight.zero_()
        for j in range(e):
            m.router.weight[j, j] = 8.0
    xb = torch.zeros(n, d)
    xb[torch.arange(n), torch.arange(n) % e] = 1.0
    _, aux_bal = m(xb)
    torch.testing.assert_close(aux_bal, torch.tensor(0.1), atol=1e-6, rtol=1e-6)
    assert aux_skewed > aux_bal


class _HalfDispatcher:
    """Computes only experts [first, first + count): dispatch picks their rows, combine puts zeros elsewhere.

    Summing two of these over disjoint halves must equal the local result, as an expert-parallel all-to-all would.
    """

    def __init__(self, first, count):
        self.first, self.count = first, count

    def local_expert_range(self, num_experts):
        return self.first, self.count

    def dispatch(self, x_sorted, tokens_per_expert):
        starts = torch.cumsum(tokens_per_expert, 0) - tokens_per_expert
        lo = int(starts[self.first])
        hi = lo + int(tokens_per_expert[self.first:self.first + self.count].sum())
        local = tokens_per_expert[self.first:self.first + self.count]
        return x_sorted[lo:hi], local, (lo, hi, x_sorted.shape[0], local.tolist())

    def host_sizes(self, ctx):  # handed to the expert loop, as the all-to-all dispatcher does
        return ctx[3]

    def combine(self, y_local, ctx):
        lo, hi, n, _ = ctx
        d = y_local.shape[1]
        return torch.cat([y_local.new_zeros(lo, d), y_local, y_local.new_zeros(n - hi, d)])


@pytest.mark.parametrize("shard_weights", [False, True])
def test_dispatcher_interface_partitions_experts(shard_weights):
    torch.manual_seed(3)
    d, e, n = 8, 4, 25
    full = MoE(d, 12, e, 2).double()
    x = torch.randn(n, d, dtype=torch.float64)
    y_full, _ = full(x)
    total = torch.zeros_like(y_full)
    for first in (0, 2):
        part = MoE(d, 12, e, 2).double()
        part.load_state_dict(full.state_dict())
        if shard_weights:  # the parameters hold only the local experts, as after expert-parallel sharding
            for name in ("w1", "w2", "w3"):
                setattr(part, name, torch.nn.Parameter(getattr(full, name).detach()[first:first + 2].clone()))
        part.dispatcher = _HalfDispatcher(first, 2)
        total = total + part(x)[0]
    torch.testing.assert_close(total, y_full)
    assert isinstance(full.dispatcher, LocalDispatcher)


def test_bad_arguments_are_named():
    with pytest.raises(ValueError, match="top_k"):
        MoE(8, 8, 4, 5)
    with pytest.raises(ValueError, match="capacity_factor"):
        MoE(8, 8, 4, 2, capacity_factor=0.0)


@pytest.mark.skipif(not hasattr(torch, "_grouped_mm"), reason="torch._grouped_mm absent")
def test_padded_grouped_gemm_layout_matches_the_loop_forward():
    """The padded-group scatter/gather around torch._grouped_mm (CPU forward; CUDA fwd+bwd in test_model_gpu)."""
    torch.manual_seed(4)
    m = MoE(16, 32, 5, 2)
    counts = torch.tensor([0, 17, 1, 0, 40])
    x = torch.randn(int(counts.sum()), 16).to(torch.bfloat16).float()
    w1, w3, w2 = (w.detach().to(torch.bfloat16).float() for w in (m.w1, m.w3, m.w2))
    y = m._grouped_experts(x, counts, w1, w3, w2).float()
    ref = torch.cat([(F.silu(xe @ w1[e]) * (xe @ w3[e])) @ w2[e]
                     for e, xe in enumerate(torch.split(x, counts.tolist())) if xe.shape[0]])
    torch.testing.assert_close(y, ref, rtol=2e-2, atol=2e-2)


def test_mask_grad_zeroes_only_unused_experts():
    from gem.model.moe import _MaskGrad

    w = torch.randn(4, 3, 5, requires_grad=True)
    keep = torch.tensor([True, False, True, False])
    out = _MaskGrad.apply(w, keep)
    assert torch.equal(out, w)
    g = torch.randn(4, 3, 5)
    out.backward(g)
    assert torch.equal(w.grad[keep], g[keep])
    assert w.grad[~keep].abs().sum() == 0


@pytest.mark.parametrize("autocast", [False, True])
def test_experts_output_dtype_does_not_depend_on_the_row_count(autocast):
    """Expert-parallel ranks exchange expert outputs: a rank whose experts got no rows must send the same dtype."""
    torch.manual_seed(0)
    m = MoE(16, 32, 4, 2)
    counts_full = torch.tensor([3, 0, 2, 1])
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        full = m.experts(torch.randn(6, 16), counts_full)
        empty = m.experts(torch.randn(0, 16), torch.zeros(4, dtype=torch.int64))
    assert empty.dtype == full.dtype == (torch.bfloat16 if autocast else torch.float32)
    assert empty.shape == (0, 16)


@pytest.mark.parametrize("capacity_factor", [None, 1.0])
@pytest.mark.parametrize("n", [0, 1, 29])
def test_local_grouped_layout_matches_the_loop(monkeypatch, n, capacity_factor):
    """The local grouped-GEMM path (tokens scattered straight into padded groups, static row count) gives the loop's
    output, dropped tokens included (CPU forward; the CUDA backward is in test_model_gpu)."""
    torch.manual_seed(n + 5)
    m = MoE(16, 32, 5, 2, capacity_factor=capacity_factor)
    x = torch.randn(n, 16).to(torch.bfloat16).float()
    m.use_grouped_mm = False
    with torch.no_grad():
        w1, w3, w2 = (w.to(torch.bfloat16).float() for w in (m.w1, m.w3, m.w2))
        m.w1.copy_(w1), m.w3.copy_(w3), m.w2.copy_(w2)
        ref, aux_ref = m(x)
    monkeypatch.setattr(MoE, "_use_grouped", lambda self, x: True)
    with torch.no_grad():
        got, aux = m(x)
    assert got.shape == ref.shape == (n, 16)
    torch.testing.assert_close(got, ref, rtol=3e-2, atol=3e-2)
    torch.testing.assert_close(aux, aux_ref)


@pytest.mark.parametrize("n", [0, 1, 37])
@pytest.mark.parametrize("capacity_factor", [None, 1.0])
def test_local_grouped_layout_backward_with_poisoned_buffers(monkeypatch, capacity_factor, n):
    """The grouped path's gradients equal the loop's when fresh buffers hold NaN (deterministic mode fills
    uninitialised memory so): any buffer row left unzeroed would reach the weight gradients."""
    torch.manual_seed(3)
    m = MoE(16, 32, 5, 2, capacity_factor=capacity_factor)
    with torch.no_grad():
        for w in (m.w1, m.w3, m.w2):
            w.copy_(w.to(torch.bfloat16).float())
    x = torch.randn(n, 16).to(torch.bfloat16).float()
    grads = []
    for grouped in (False, True):
        if grouped:
            monkeypatch.setattr(MoE, "_use_grouped", lambda self, x: True)
        m.zero_grad()
        xi = x.clone().requires_grad_()
        monkeypatch.setattr(torch.utils.deterministic, "fill_uninitialized_memory", True)
        torch.use_deterministic_algorithms(True)
        try:
            y, _ = m(xi)
            (y.float() * torch.linspace(-1, 1, 16)).sum().backward()
        finally:
            torch.use_deterministic_algorithms(False)
        grads.append([xi.grad] + [w.grad.clone() for w in (m.w1, m.w3, m.w2)])
    for ref, got in zip(*grads):
        assert torch.isfinite(got).all()
        torch.testing.assert_close(got.float(), ref.float(), rtol=5e-2, atol=5e-2)


@pytest.mark.parametrize("k", [1, 2, 3])
def test_row_scatter_and_gather_gradients(k):
    """The permutation autograd functions around the experts: gradcheck in fp64, spare rows included."""
    from gem.model.moe import _GatherRows, _ScatterRows

    torch.manual_seed(k)
    n, d, rows = 7, 5, 7 * k + 4
    pos = torch.randperm(rows - 1)[: n * k]
    x = torch.randn(n, d, dtype=torch.float64, requires_grad=True)
    free = torch.ones(rows, dtype=torch.bool)
    free[pos] = False
    # pad: the free rows, repeated and mixed with occupied ones, as _pad_rows makes them
    pad = torch.cat([free.nonzero().flatten(), pos[:3], free.nonzero().flatten()[:1]])
    for p in (None, pad):
        torch.autograd.gradcheck(lambda t, p=p: _ScatterRows.apply(t, pos, k, rows, p), (x,))
        buf = _ScatterRows.apply(x, pos, k, rows, p)
        assert torch.equal(buf[pos].view(n, k, d), x.detach()[:, None].expand(n, k, d))
        assert not buf[free].any()
        out = torch.randn(rows, d, dtype=torch.float64, requires_grad=True)
        gates = torch.rand(n, k, dtype=torch.float64, requires_grad=True)
        torch.autograd.gradcheck(lambda o, g, p=p: _GatherRows.apply(o, pos, g, p), (out, gates))
        ref = (out[pos].view(n, k, d) * gates[..., None]).sum(1)
        torch.testing.assert_close(_GatherRows.apply(out, pos, gates, p), ref)


@pytest.mark.parametrize("seed", range(4))
def test_pad_rows_cover_every_free_row_of_the_padded_groups(seed):
    """_pad_rows names every row of the padded-group buffer that no assignment occupies (empty experts, groups
    that fill their alignment exactly, the tail and the spare row included); the buffers are then not zeroed whole."""
    from gem.model.moe import MoE, _pad_rows, _padded_groups

    g = torch.Generator().manual_seed(seed)
    e, align = 6, MoE.GROUP_ALIGN
    kept = torch.randint(0, 40, (e,), generator=g)
    kept[seed % e] = 0
    kept[(seed + 1) % e] = 2 * align
    starts, ends = _padded_groups(kept, align)
    for spare in (0, 1):
        total = int(kept.sum()) + e * align + spare
        pad = _pad_rows(starts, kept, ends, align, total)
        free = torch.ones(total, dtype=torch.bool)
        for s0, c in zip(starts.tolist(), kept.tolist()):
            free[s0:s0 + c] = False
        assert pad.numel() == e * align * 2 + 1 and int(pad.max()) < total
        covered = torch.zeros(total, dtype=torch.bool)
        covered[pad] = True
        assert bool(covered[free].all())


@pytest.mark.parametrize("d,f,precision,fp8", [
    (32, 64, "fp8", True), (32, 64, "fp8_block", True), (32, 64, "mxfp8", False), (32, 64, "bf16", False),
    (24, 64, "fp8", False), (32, 40, "fp8_block", False),  # the fp8 grouped GEMM needs multiples of 16
])
def test_experts_choose_their_gemm_format(d, f, precision, fp8):
    m = MoE(d, f, num_experts=4, top_k=2)
    assert m.set_gemm_precision(precision) is fp8 and m.fp8_experts is fp8
    m.set_gemm_precision("bf16")
    assert m.fp8_experts is False
