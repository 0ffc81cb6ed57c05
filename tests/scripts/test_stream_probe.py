"""scripts/stream_probe.py's kernels (interpreted on CPU): they must move every row GDPA's kernels move, so their
outputs are exact copies of the inputs over jagged batches (empty sequences, lengths across tile edges)."""

from __future__ import annotations

import pytest
import torch

from scripts.stream_probe import pair_table, stream_bwd, stream_bwd_flat, stream_fwd, stream_fwd_flat


def _batch(lq, lk, h=2, d=16, dtype=torch.bfloat16):
    g = torch.Generator().manual_seed(0)
    oq = torch.tensor([0] + torch.tensor(lq).cumsum(0).tolist(), dtype=torch.int32)
    ok = torch.tensor([0] + torch.tensor(lk).cumsum(0).tolist(), dtype=torch.int32)
    q = torch.randn(sum(lq), h, d, generator=g).to(dtype)
    k = torch.randn(sum(lk), h, d, generator=g).to(dtype)
    v = torch.randn(sum(lk), h, d, generator=g).to(dtype)
    do = torch.randn(sum(lq), h, d, generator=g).to(dtype)
    order = torch.argsort(torch.tensor(lq), descending=True, stable=True).to(torch.int32)
    return q, k, v, do, oq, ok, order


@pytest.mark.parametrize("block_m", [16, 32])
def test_stream_kernels_copy_every_row(block_m):
    lq, lk = [40, 0, 1, 17, 33, 16], [5, 9, 0, 16, 1, 3]
    q, k, v, do, oq, ok, order = _batch(lq, lk)
    nan = [torch.full_like(x, float("nan")) for x in (q, q, k, v)]  # a row no program writes stays NaN
    o = stream_fwd(q, k, v, oq, ok, order, block_n=16, block_m=block_m, num_warps=1, num_stages=1, out=nan[0])
    assert torch.equal(o, q)
    dq, dk, dv = stream_bwd(q, k, v, do, oq, ok, order, block_n=16, block_m=block_m, num_warps=1, num_stages=1,
                            out=tuple(nan[1:]))
    assert torch.equal(dq, q) and torch.equal(dk, k) and torch.equal(dv, v)


@pytest.mark.parametrize("programs", [1, 3, 7])
def test_flat_stream_kernels_copy_every_row(programs):
    """The persistent layouts: runs cut anywhere (forward, K/V held or reloaded) or at item starts (backward)."""
    lq, lk = [40, 1, 17, 33, 16, 5], [5, 9, 16, 1, 3, 12]
    q, k, v, do, oq, ok, order = _batch(lq, lk)
    for hold in (True, False):
        pairs, bounds = pair_table(oq, order, q.shape[1], 16, programs, whole_items=False)
        assert bounds[0] == 0 and bounds[-1] == pairs.shape[0] == 2 * sum((x + 15) // 16 for x in lq)
        o = stream_fwd_flat(q, k, v, oq, ok, pairs, bounds, block_n=16, block_m=16, hold=hold, num_warps=1,
                            num_stages=1, out=torch.full_like(q, float("nan")))
        assert torch.equal(o, q)
    pairs, bounds = pair_table(oq, order, q.shape[1], 16, programs, whole_items=True)
    assert all(pairs[int(b), 2] == 0 for b in bounds[:-1] if b < pairs.shape[0])  # cuts at item starts
    nan = [torch.full_like(x, float("nan")) for x in (q, k, v)]
    dq, dk, dv = stream_bwd_flat(q, k, v, do, oq, ok, pairs, bounds, block_n=16, block_m=16, num_warps=1,
                                 num_stages=1, out=tuple(nan))
    assert torch.equal(dq, q) and torch.equal(dk, k) and torch.equal(dv, v)
