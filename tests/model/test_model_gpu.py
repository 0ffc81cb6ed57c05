"""CUDA checks of the model's GPU paths (grouped-GEMM MoE, tower blocks on the Triton kernels); run on the H200."""

import pytest
import torch

pytestmark = pytest.mark.gpu

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def _moe(d, f, e, k, seed=0):
    from gem.model.moe import MoE

    torch.manual_seed(seed)
    return MoE(d, f, e, k).cuda()


@needs_cuda
@pytest.mark.parametrize("n", [1, 77, 999, 4096])
def test_grouped_mm_moe_matches_the_expert_loop(n):
    d, f, e, k = 128, 256, 8, 2
    m = _moe(d, f, e, k, seed=n)
    m.use_grouped_mm = True
    # Both paths see the same bf16-representable input, so the (fp32) router picks the same experts in both;
    # n = 1 leaves 6 of the 8 experts without a token (empty groups).
    x = torch.randn(n, d, device="cuda").to(torch.bfloat16).float()
    xb = x.clone().requires_grad_()
    with torch.autocast("cuda", dtype=torch.bfloat16):  # as in training: fp32 params, bf16 compute
        assert m._use_grouped(xb)
        y, _ = m(xb)
    (y.float().pow(2).sum()).backward()
    g_grouped = {nm: p.grad.clone() for nm, p in m.named_parameters() if p.grad is not None}
    gx_grouped = xb.grad.clone()
    m.zero_grad()
    m.use_grouped_mm = False
    xr = x.clone().requires_grad_()
    # the loop path under the same autocast: the check is grouped vs loop, not bf16 vs fp32 (the router's grad
    # goes through a softmax derivative that cancels, and was 4% off fp32 at n = 1)
    with torch.autocast("cuda", dtype=torch.bfloat16):
        yr, _ = m(xr)
    yr = yr.float()
    (yr.pow(2).sum()).backward()
    row_err = (y.float() - yr).norm(dim=1) / yr.norm(dim=1).clamp_min(1e-6)
    assert (y.float() - yr).norm() / yr.norm() < 2e-2, (row_err.max(), torch.topk(row_err, min(5, n)))
    assert (gx_grouped.float() - xr.grad.float()).norm() / xr.grad.float().norm() < 3e-2
    for nm, p in m.named_parameters():
        if nm in g_grouped:
            ref = p.grad.float()
            err = (g_grouped[nm].float() - ref).norm() / ref.norm().clamp_min(1e-12)
            assert err < 3e-2, (nm, float(err))
    with torch.no_grad():
        counts = torch.bincount(m.route(x)[1].flatten(), minlength=e)
    empty = counts == 0
    if n == 1:
        assert int(empty.sum()) == e - k
    for nm in ("w1", "w3", "w2"):
        assert g_grouped[nm][empty].abs().sum() == 0, nm


@needs_cuda
def test_tower_blocks_triton_vs_reference_bf16():
    from gem.model.attention import build_blocks
    from gem.model.config import ModelConfig

    cfg = ModelConfig.from_dict({
        "d_model": 256,
        "tower": {"num_blocks": 2, "num_heads": 4, "num_kv_heads": 2, "head_dim": 64, "moe_every": 2, "d_ff": 512},
        "moe": {"num_experts": 4, "top_k": 2, "d_ff": 256},
    })
    torch.manual_seed(0)
    blocks = build_blocks(cfg).cuda()
    lengths = torch.tensor([0, 1, 300, 77, 512, 5])
    offsets = torch.zeros(7, dtype=torch.int64)
    offsets[1:] = lengths.cumsum(0)
    offsets = offsets.cuda()
    x = torch.randn(int(lengths.sum()), 256, device="cuda")
    outs = {}
    for kernel in ("triton", "reference"):
        for b in blocks:
            b.attn.kernel = kernel
        xi = x.clone().requires_grad_()
        h = xi
        with torch.autocast("cuda", dtype=torch.bfloat16):
            for b in blocks:
                h, _ = b(h, offsets, 512)
        h.float().pow(2).mean().backward()
        outs[kernel] = (h.float().detach(), xi.grad.clone())
    torch.testing.assert_close(outs["triton"][0], outs["reference"][0], rtol=5e-2, atol=5e-2)
    g1, g2 = outs["triton"][1], outs["reference"][1]
    assert (g1 - g2).norm() / g2.norm() < 5e-2
