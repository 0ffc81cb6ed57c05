"""k training steps of the tiny GEM model under a `parallel:` config; rank 0 writes the global losses.

Every rank builds the same global batch and takes its contiguous slice, so runs at different world sizes
see the same examples per step.
"""

from __future__ import annotations

import argparse
import json

import torch
import torch.distributed as dist

from tests.dist._common import dataset, finish, sharded_tiny_model, slice_batch


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--parallel", default="{}")
    ap.add_argument("--compile", default="{}")
    ap.add_argument("--activation-checkpoint", default="{}")
    ap.add_argument("--param-dtype", default="fp32")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--global-batch", type=int, default=8)
    ap.add_argument("--sparse-opt", default="sgd")
    ap.add_argument("--lr", type=float, default=0.05)
    ap.add_argument("--moe-every", type=int, default=2)
    ap.add_argument("--data", default=None, help="a data group's declaration (JSON) instead of the default one")
    ap.add_argument("--max-candidates", type=int, default=1)
    ap.add_argument("--candidates", default="rows")
    a = ap.parse_args()
    data = json.loads(a.data) if a.data else None

    from gem.model import multitask_loss

    device, rank, world, p, opt = sharded_tiny_model(a.parallel, moe_every=a.moe_every, sparse_opt=a.sparse_opt,
                                                     lr=a.lr, data=data, candidates=a.candidates, compile=a.compile,
                                                     activation_checkpoint=a.activation_checkpoint,
                                                     param_dtype=a.param_dtype)
    ds = dataset(a.global_batch, data=data, max_candidates=a.max_candidates)
    per = a.global_batch // world
    losses = []
    for step in range(a.steps):
        full = ds.global_batch(step)
        b = slice_batch(full, rank * per, (rank + 1) * per).to(device)
        out = p.model(b)
        loss, _ = multitask_loss(out.logits, b.labels)
        # requests: ranks score different numbers of candidates; weight each rank's mean by its share of the global
        # batch's candidates, so the average over ranks (the gradients' and the logged loss's) is the global mean
        loss = loss * (b.batch_size * world / full.batch_size)
        loss = loss + out.aux_loss
        loss.backward()
        if step == 0:
            grads = grad_fingerprint(p)
        opt.step()
        opt.zero_grad()
        p.after_step(step + 1)
        g = loss.detach().clone()
        dist.all_reduce(g)
        losses.append(g.item() / world)
    plan = {t: ps.sharding_type for mp in p.model.plan.plan.values() for t, ps in mp.items()}
    finish(a.out, {"losses": losses, "grads": grads, "plan": plan})


def grad_fingerprint(p) -> dict:
    """{param name: full gradient (flattened list)} of the dense parameters after the first backward."""
    out = {}
    for name, q in p.dense_named_parameters().items():
        g = q.grad
        if g is None:
            g = torch.zeros(q.shape)
        elif hasattr(g, "full_tensor"):
            g = g.full_tensor()
        out[name] = g.detach().double().flatten().tolist()
    return out


if __name__ == "__main__":
    main()
