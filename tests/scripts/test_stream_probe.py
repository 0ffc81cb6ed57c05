"""scripts/stream_probe.py's kernels (interpreted on CPU): they must move every row GDPA's kernels move, so their
outputs are exact copies of the inputs over jagged batches (empty sequences, lengths across tile edges)."""

from __future__ import annotations

import pytest
import torch

from scripts.stream_probe import stream_bwd, stream_fwd, stream_rows


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
        assert torch.equal(dk, k) if kv_out else dk.isnan().all()
    dq, dk, dv = stream_bwd(q, k, v, do, oq, ok, order, block_n=16, block_m=block_m, num_warps=1, num_stages=1,
                            out=tuple(torch.full_like(x, float("nan")) for x in (q, k, v)), hold=True)
    assert torch.equal(dq, q) and torch.equal(dk, k) and torch.equal(dv, v)
    dq = stream_rows(q, do, oq, order, block_m=block_m, num_warps=1, num_stages=1, out=torch.full_like(q, float("nan")))
    assert torch.equal(dq, q)
