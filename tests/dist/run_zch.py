"""k training steps of the tiny GEM model whose item table is `hash: zch`, each rank on its slice of the same global
batch; rank 0 writes the global losses and, per item id seen (by its hashed value), the rank holding it and its
trained embedding.

A row is initialised from the table's init_fn when an id takes it (torchrec's managed-collision eviction), on the
rank holding it, and which row an id gets is each shard's own choice (a 2-rank run holds its ids in two maps of
half the rows): with a random init the runs would start each id from different values. So the item table's
init_fn is a constant here.
"""

from __future__ import annotations

import argparse
import functools

import torch
import torch.distributed as dist

from tests.dist._common import data_dict, dataset, finish, model_cfg, train_losses


def zch_data() -> dict:
    d = data_dict()
    d["tables"]["item"].update(ids="raw", hash="zch")
    return d


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--global-batch", type=int, default=8)
    a = ap.parse_args()

    from gem.model import GEMModel
    from gem.model.embeddings import zch_modules
    from gem.parallel import init_distributed, parallelize

    device = init_distributed()
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    data = zch_data()
    model = GEMModel(model_cfg(data=data), embedding_device=device)
    (item,) = model.mc_ec._embedding_module.embedding_configs()
    item.init_fn = functools.partial(torch.nn.init.constant_, val=0.02)
    p = parallelize(model, {}, sparse_optimizer_cfg={"name": "rowwise_adagrad", "lr": 0.5}, device=device)
    opt = torch.optim.SGD(p.dense_parameters(), lr=0.5)
    ds = dataset(a.global_batch, data=data)
    losses = train_losses(p, opt, ds, a.steps, rank, world, device)

    (m,) = zch_modules(p.inner)
    (w,) = [v for k, v in p.model.state_dict().items() if k.endswith("item.weight")]
    shard = w.local_shards()[0]
    offset = shard.metadata.shard_offsets[0]
    held = m._mch_sorted_raw_ids != torch.iinfo(torch.int64).max
    rows = m._mch_remapped_ids_mapping[held] - offset
    mine = {int(h): (rank, shard.tensor[r].tolist()) for h, r in zip(m._mch_sorted_raw_ids[held].tolist(), rows)}
    every = [None] * world
    dist.all_gather_object(every, mine)
    ids = {str(h): v for part in every for h, v in part.items()}
    plan = {t: ps.sharding_type for mp in p.model.plan.plan.values() for t, ps in mp.items()}
    finish(a.out, {"losses": losses, "ids": ids, "plan": plan, "rows": int(m.output_size())})


if __name__ == "__main__":
    main()
