"""DCP round trip of the whole training state: model (FSDP2 DTensors + sharded tables), fused sparse optimizer
and dense AdamW, combined the way the trainer does it (torchrec CombinedOptimizer).

save: train k1 steps, sync embedding replicas, save, train k2 more steps -> the reference losses.
load: (any world size / layout) build fresh, load, train the same k2 steps -> the losses to compare; also the
      loss of the fresh, unloaded model on the first of those batches (must differ: the load did something).
"""

from __future__ import annotations

import argparse
import faulthandler
import json

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

from tests.dist._common import dataset, finish, model_cfg, slice_batch


def build(parallel: dict, device, ac: dict | None = None):
    from torchrec.optim.keyed import CombinedOptimizer, KeyedOptimizerWrapper

    from gem.model import GEMModel
    from gem.parallel import parallelize

    torch.manual_seed(0)
    model = GEMModel(model_cfg(), embedding_device=device)
    p = parallelize(model, parallel, ac_cfg=ac, sparse_optimizer_cfg={"name": "rowwise_adagrad", "lr": 0.3},
                    device=device)
    adamw = KeyedOptimizerWrapper(p.dense_named_parameters(), lambda ps: torch.optim.AdamW(ps, lr=0.01))
    opt = CombinedOptimizer([("dense", adamw), ("sparse", p.sparse_optimizer)])
    return p, opt, adamw


def step_loss(p, opt, ds, step: int, per: int, train: bool = True) -> float:
    from gem.model import multitask_loss

    rank, world = dist.get_rank(), dist.get_world_size()
    dev = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    b = slice_batch(ds.global_batch(step), rank * per, (rank + 1) * per).to(dev)
    out = p.model(b)
    loss = multitask_loss(out.logits, b.labels)[0] + out.aux_loss
    if train:
        loss.backward()
        opt.step()
        opt.zero_grad()
        p.after_step(step + 1)
    g = loss.detach().clone()
    dist.all_reduce(g)
    return g.item() / world


def load_and_train(p, opt, adamw, ds, per: int, a) -> dict:
    out = {}
    with torch.no_grad():
        out["fresh"] = step_loss(p, opt, ds, a.k1, per, train=False)
    adamw.init_state()  # AdamW state is lazy: materialise it so DCP has tensors to load into
    state = {"model": p.model.state_dict(), "optim": opt.state_dict()}
    # through gem's checkpoint reader: allow-listed metadata, the model's tensors matched before loading
    from gem.train.checkpoint import Checkpointer

    Checkpointer(a.ckpt).load(a.ckpt, state)
    p.model.load_state_dict(state["model"])
    opt.load_state_dict(state["optim"])
    out["after"] = [step_loss(p, opt, ds, s, per) for s in range(a.k1, a.k1 + a.k2)]
    return out


def replica_max_diff(p):
    """None with one embedding group; else max |local shard - replica mean| over weights + optimizer state."""
    if p.embeddings.n_replicas == 1:
        return None
    ts = p.embeddings.replica_tensors(include_optimizer_state=True)
    flat = torch.cat([t.detach().reshape(-1).double() for t in ts])
    mean = flat.clone()
    dist.all_reduce(mean, group=p.embeddings.replica_pg)
    d = (flat - mean / p.embeddings.n_replicas).abs().max().reshape(1)
    dist.all_reduce(d, op=dist.ReduceOp.MAX)
    return d.item()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--phase", choices=["save", "load"], required=True)
    ap.add_argument("--ckpt", required=True)
    ap.add_argument("--parallel", default="{}")
    ap.add_argument("--k1", type=int, default=2)
    ap.add_argument("--k2", type=int, default=2)
    ap.add_argument("--global-batch", type=int, default=8)
    ap.add_argument("--watchdog", type=float, default=200)
    ap.add_argument("--load-here", action="store_true")
    ap.add_argument("--activation-checkpoint", default="{}")
    a = ap.parse_args()
    faulthandler.dump_traceback_later(a.watchdog, exit=True)
    from gem.parallel import init_distributed

    device = init_distributed()
    p, opt, adamw = build(json.loads(a.parallel), device, json.loads(a.activation_checkpoint))
    ds = dataset(a.global_batch)
    per = a.global_batch // dist.get_world_size()
    res: dict = {}
    if a.phase == "save":
        res["before"], res["replicas"] = [], []
        for s in range(a.k1):
            res["before"].append(step_loss(p, opt, ds, s, per))
            res["replicas"].append(replica_max_diff(p))
        p.sync_embeddings()
        dcp.save({"model": p.model.state_dict(), "optim": opt.state_dict()}, checkpoint_id=a.ckpt)
        res["after"] = []
        for s in range(a.k1, a.k1 + a.k2):
            res["after"].append(step_loss(p, opt, ds, s, per))
            res["replicas"].append(replica_max_diff(p))
        if a.load_here:  # a second, fresh copy in this process group loads what was just saved
            p, opt, adamw = build(json.loads(a.parallel), device, json.loads(a.activation_checkpoint))
            res["same_world"] = load_and_train(p, opt, adamw, ds, per, a)
    else:
        res.update(load_and_train(p, opt, adamw, ds, per, a))
    finish(a.out, res)


if __name__ == "__main__":
    main()
