"""gem.bench.stream's kernels (timed by tools/stream_probe.py) (interpreted on CPU): they must move every row GDPA's kernels move, so their
outputs are exact copies of the inputs over jagged batches (empty sequences, lengths across tile edges)."""

from __future__ import annotations

import pytest
import torch

from gem.bench.stream import stream_bwd, stream_fwd, stream_rows


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

    for kv_in, kv_out in ((False, True), (True, False), (False, False)):  # the K side switched off in parts
        nan = [torch.full_like(x, float("nan")) for x in (q, k, v)]
        dq, dk, dv = stream_bwd(q, k, v, do, oq, ok, order, block_n=16, block_m=block_m, num_warps=1,
                                num_stages=1, out=tuple(nan), kv_in=kv_in, kv_out=kv_out)
        assert torch.equal(dq, q)
        assert torch.equal(dk, k) and torch.equal(dv, v) if kv_out else dk.isnan().all() and dv.isnan().all()
    dq, dk, dv = stream_bwd(q, k, v, do, oq, ok, order, block_n=16, block_m=block_m, num_warps=1, num_stages=1,
                            out=tuple(torch.full_like(x, float("nan")) for x in (q, k, v)), hold=True)
    assert torch.equal(dq, q) and torch.equal(dk, k) and torch.equal(dv, v)
    dq = stream_rows(q, do, oq, order, block_m=block_m, num_warps=1, num_stages=1, out=torch.full_like(q, float("nan")))
    assert torch.equal(dq, q)


def _live_sums(q, k, v, do, oq, ok, kv_in):
    """What the backward kernels add with zero = 1: dq += dO + (sum of the item's K and V rows, if loaded);
    dk, dv += sum of the item's dO rows."""
    dq, dk, dv = q.float() + do.float(), k.float().clone(), v.float().clone()
    for b in range(oq.numel() - 1):
        qs, ks = slice(int(oq[b]), int(oq[b + 1])), slice(int(ok[b]), int(ok[b + 1]))
        if kv_in:
            dq[qs] += k[ks].float().sum(0) + v[ks].float().sum(0)
        dk[ks] += do[qs].float().sum(0)
        dv[ks] += do[qs].float().sum(0)
    return dq, dk, dv


@pytest.mark.parametrize(("kv_in", "hold"), [(False, False), (True, False), (True, True)])  # held: the tile loaded
def test_stream_bwd_reads_what_it_claims(kv_in, hold):
    """With the live sums scaled by 1 the outputs show which loads each backward variant made: the K/V tile (only
    with kv_in), every dO row of the item (in dK/dV), and the item's own rows only."""
    lq, lk = [40, 0, 1, 17, 33, 16], [5, 9, 0, 16, 1, 3]
    q, k, v, do, oq, ok, order = _batch(lq, lk, dtype=torch.float32)
    dq, dk, dv = stream_bwd(q, k, v, do, oq, ok, order, block_n=16, block_m=16, num_warps=1, num_stages=1,
                            kv_in=kv_in, hold=hold, zero=1.0)
    want = _live_sums(q, k, v, do, oq, ok, kv_in)
    for got, ref in zip((dq, dk, dv), want):
        torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-4)
