"""Expert-parallel MoE (all-to-all dispatcher + ep-sharded weights) against the unsharded MoE on all tokens.

Each rank runs its own tokens (uneven counts, including none) through the sharded MoE; the outputs and the
input / expert / router gradients must equal the unsharded layer's on the concatenation of every rank's tokens.
"""

from __future__ import annotations

import argparse
import copy
import faulthandler

import torch
import torch.distributed as dist

from tests.dist._common import finish


def check_case(dims, tokens_per_rank: list[int], top_k: int, capacity_factor, skew: bool, seed: int) -> dict:
    from gem.model.moe import MoE
    from gem.parallel.expert import apply_expert_parallel

    rank = dist.get_rank()
    torch.manual_seed(seed)
    d, e = 8, 4
    ref = MoE(d, 6, e, top_k, capacity_factor=capacity_factor).double()
    if skew:  # every token picks experts 0 and 1 (the first ep rank's): the others receive no rows
        with torch.no_grad():
            ref.router.weight[:2] = 1.0
            ref.router.weight[2:] = -1.0
    xs = [torch.randn(n, d, dtype=torch.float64).abs() if skew else torch.randn(n, d, dtype=torch.float64)
          for n in tokens_per_rank]
    ws = [torch.randn(n, d, dtype=torch.float64) for n in tokens_per_rank]
    # unsharded reference: every rank's MoE call separately (routing and capacity are per call), summed loss
    x_ref = [x.clone().requires_grad_() for x in xs]
    loss = sum(((ref(x)[0]) * w).sum() for x, w in zip(x_ref, ws))
    y_ref = [ref(x)[0].detach() for x in x_ref]
    loss.backward()

    sh = copy.deepcopy(ref)
    for p in sh.parameters():
        p.grad = None
    apply_expert_parallel([sh], dims)
    x = xs[rank].clone().requires_grad_()
    y, _ = sh(x)
    (y * ws[rank]).sum().backward()

    first, count = sh.dispatcher.local_expert_range(e)
    errs = {"y": (y.detach() - y_ref[rank]).abs().max().item() if y.numel() else 0.0,
            "dx": (x.grad - x_ref[rank].grad).abs().max().item() if x.numel() else 0.0}
    for name in ("w1", "w3", "w2"):
        g = getattr(sh, name).grad.to_local()
        errs[name] = (g - getattr(ref, name).grad[first:first + count]).abs().max().item()
        errs[name + "_ref_norm"] = getattr(ref, name).grad[first:first + count].abs().max().item()
    gr = sh.router.weight.grad.clone()
    dist.all_reduce(gr)  # each rank holds its own tokens' router gradient
    errs["router"] = (gr - ref.router.weight.grad).abs().max().item()
    out = torch.tensor([v for v in errs.values()], dtype=torch.float64)
    dist.all_reduce(out, op=dist.ReduceOp.MAX)
    return dict(zip(errs, out.tolist()))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--watchdog", type=float, default=150)
    a = ap.parse_args()
    faulthandler.dump_traceback_later(a.watchdog, exit=True)  # a hang fails with every rank's stack
    from gem.parallel import ParallelDims, init_distributed

    init_distributed()
    world = dist.get_world_size()
    dims = ParallelDims.build({"dense": "fsdp", "ep": world})
    cases = {
        "uneven": dict(tokens_per_rank=[5, 9, 3, 7][:world], top_k=2, capacity_factor=None, skew=False, seed=1),
        "empty_rank": dict(tokens_per_rank=[0] + [6] * (world - 1), top_k=2, capacity_factor=None, skew=False,
                           seed=2),
        "skew_no_rows_to_some": dict(tokens_per_rank=[4, 5, 6, 7][:world], top_k=2, capacity_factor=None,
                                     skew=True, seed=3),
        "top1_capacity": dict(tokens_per_rank=[11, 1, 8, 2][:world], top_k=1, capacity_factor=1.0, skew=False,
                              seed=4),
    }
    res = {name: check_case(dims, **kw) for name, kw in cases.items()}
    finish(a.out, res)


if __name__ == "__main__":
    main()
