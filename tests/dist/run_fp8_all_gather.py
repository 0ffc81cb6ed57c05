"""FSDP2's FP8 all-gather of fp8_block weights on 2 ranks (gloo; NCCL from gpu_check.py), in one launch; rank 0 writes
the checks' results.

layers: three BlockFP8Linear layers, each its own FSDP2 unit: 256 -> 512 (out features 2 x 2 whole 128-row tiles:
    gathered in FP8), 512 -> 384 (192 rows a shard: the param_dtype all-gather) and 384 -> 256 (FP8). For fp32
    and bf16 param_dtype, over two optimizer steps: the FP8 copies each layer's forward uses against
    quantize_128x128 of the full weight in param_dtype (byte for byte), the all-gather bytes per unit, and how often
    the shards were quantized.
train: the GEM model widened so some fp8_block layers shard into whole tiles and others do not, trained a few
    steps with the FP8 all-gather and without it (the same seed, batches and optimizer): losses, trained parameters
    (through the state dict) and which weights took which all-gather.
"""

from __future__ import annotations

import argparse
import json

import torch
import torch.distributed as dist
from torch import nn

from tests.dist._common import ROOT, data_dict, dataset, finish, slice_batch, train_losses
from tests.dist.run_comm_bytes import CountCollectives

WIDE = {"d_model": 128, "tower": {"head_dim": 64, "d_ff": 256, "num_blocks": 2, "moe_every": 2},
        "interaction": {"head_dim": 64}, "moe": {"d_ff": 128}, "kernel": "reference"}


def _bytes(t: torch.Tensor) -> list[int]:
    return t.detach().contiguous().view(torch.uint8).flatten().tolist()


def check_layers(param_dtype: torch.dtype, calls: list, device: torch.device) -> dict:
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    from gem.model.precision import BlockFP8GatheredWeight, apply_precision, fp8_weights
    from gem.ops import fp8_block as fb
    from gem.parallel.fsdp import enable_fp8_all_gather

    torch.manual_seed(1)
    # each layer in a unit of its own (fully_shard changes the class of the module it wraps: not the layer's)
    model = nn.Sequential(*(nn.Sequential(nn.Linear(k, n, bias=False)) for k, n in ((256, 512), (512, 384),
                                                                                   (384, 256)))).to(device)
    apply_precision(model, "fp8_block", device, ["*.0"])
    on, off = enable_fp8_all_gather(model, dist.get_world_size(), True)
    mp = MixedPrecisionPolicy(param_dtype=param_dtype)
    for unit in model:
        fully_shard(unit, mp_policy=mp)
    fully_shard(model, mp_policy=mp)
    layers = [unit[0] for unit in model]
    seen: dict[int, tuple] = {}

    def grab(i):
        def hook(m, args):
            (q, qt, s), = fp8_weights(m)
            seen[i] = (isinstance(m.weight, BlockFP8GatheredWeight), q.clone(), qt.clone(), s.clone())
        return hook

    for i, layer in enumerate(layers):
        layer.register_forward_pre_hook(grab(i))
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    counter = CountCollectives({dist.group.WORLD.group_name: "world"})
    x = torch.randn(70, 256, generator=torch.Generator().manual_seed(dist.get_rank())).to(device)
    out = {"fp8": on, "fallback": off, "steps": []}
    for step in range(2):
        full = [layer.weight.full_tensor().to(param_dtype) for layer in layers]
        n_calls = len(calls)
        counter.log.clear()
        with counter:
            model(x).square().sum().backward()
        gathers = [b for key, b in counter.log if key == "all_gather/world"]
        res = {"gathered_fp8": [], "same_bytes": [], "quantized": len(calls) - n_calls, "all_gather_bytes": gathers}
        for i, w in enumerate(full):
            gathered, q, qt, s = seen[i]
            rq, rqt, rs = fb.quantize_128x128(w, kernel="reference")
            res["gathered_fp8"].append(gathered)
            res["same_bytes"].append(_bytes(q) == _bytes(rq) and _bytes(qt) == _bytes(rqt) and _bytes(s) == _bytes(rs))
        out["steps"].append(res)
        opt.step()
        opt.zero_grad()
    return out


def wide_model_cfg():
    from omegaconf import OmegaConf

    from gem.model import ModelConfig

    c = OmegaConf.to_container(OmegaConf.load(ROOT / "configs/model/gem_tiny.yaml"))
    c = OmegaConf.to_container(OmegaConf.merge(c, WIDE))
    return ModelConfig.from_dict(c, data_dict())


def train(fp8_all_gather: bool, steps: int, global_batch: int, param_dtype: str, compile_cfg: dict,
          parallel: dict) -> dict:
    from gem.model import GEMModel
    from gem.model.precision import apply_precision
    from gem.parallel import parallelize
    from gem.parallel.dims import init_distributed
    from tests.dist.run_trainer import full_state

    device = init_distributed()
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = GEMModel(wide_model_cfg(), embedding_device=device)
    converted = apply_precision(model, "fp8_block", device)
    p = parallelize(model, parallel, compile_cfg=compile_cfg, param_dtype=param_dtype,
                    sparse_optimizer_cfg={"name": "sgd", "lr": 0.05}, device=device, fp8_all_gather=fp8_all_gather)
    opt = torch.optim.AdamW(p.dense_parameters(), lr=1e-2)
    ds = dataset(global_batch)
    per = global_batch // world
    losses = train_losses(p, opt, ds, steps, rank, world, device)
    params = full_state(p)
    out = {"converted": converted, "fp8": p.fp8_all_gather, "losses": losses,
           "params": {k: _bytes(v) for k, v in params.items()} if rank == 0 else {}}
    if fp8_all_gather:
        out["checkpoint"] = checkpoint_round_trip(p, opt, slice_batch(ds.global_batch(steps), rank * per,
                                                                      (rank + 1) * per).to(device))
    return out


def checkpoint_round_trip(p, opt, batch) -> dict:
    """State dicts hold plain shards (no wrapper subclass reaches a checkpoint); a DCP save, an in-place change of
    every dense weight and a DCP load bring the loss back: the FP8 copies follow the loaded weights."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.tensor import DTensor

    from gem.model import multitask_loss

    def loss() -> float:
        with torch.no_grad():
            o = p.model(batch)
            g = multitask_loss(o.logits, batch.labels)[0].detach().clone()
        dist.all_reduce(g)
        return g.item()

    def plain(state) -> bool:
        return all(type(v._local_tensor) is torch.Tensor for v in state.values() if isinstance(v, DTensor))

    state = p.model.state_dict()
    res = {"plain_model_state": plain(state),
           "plain_optimizer_state": all(plain(s) for s in opt.state_dict()["state"].values())}
    dcp.save({"model": state}, checkpoint_id="fp8_ckpt")
    before = loss()
    with torch.no_grad():
        for q in p.dense_parameters():
            q.mul_(0.5)
    changed = loss()
    state = p.model.state_dict()
    dcp.load({"model": state}, checkpoint_id="fp8_ckpt")
    p.model.load_state_dict(state)
    res.update(before=before, changed=changed, after=loss())
    return res


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--global-batch", type=int, default=8)
    ap.add_argument("--compile", default='{"enabled": false}', help="the compile: group of the training runs (JSON)")
    ap.add_argument("--param-dtypes", default="fp32,bf16", help="train.param_dtype of the training runs")
    ap.add_argument("--no-layers", action="store_true", help="skip the layer checks")
    ap.add_argument("--parallel", default='{"dense": "fsdp"}', help="the parallel: group of the training runs (JSON)")
    a = ap.parse_args()

    from gem.ops import fp8_block as fb
    from gem.parallel.dims import init_distributed

    device = init_distributed()
    calls: list = []
    quantize = fb.quantize_128x128

    def counting(w, kernel="auto", transposed=True):  # the shards' quantizations (only they skip W^T)
        if not transposed:
            calls.append(w.shape)
        return quantize(w, kernel, transposed)

    fb.quantize_128x128 = counting
    layers = {} if a.no_layers else {str(dt).removeprefix("torch."): check_layers(dt, calls, device)
                                     for dt in (torch.float32, torch.bfloat16)}
    fb.quantize_128x128 = quantize
    compile_cfg = json.loads(a.compile)
    parallel = json.loads(a.parallel)
    runs = {dt: {on: train(on, a.steps, a.global_batch, dt, compile_cfg, parallel) for on in (True, False)}
            for dt in a.param_dtypes.split(",")}
    finish(a.out, {"layers": layers, "train": {k: {str(on): r for on, r in v.items()} for k, v in runs.items()}})


if __name__ == "__main__":
    main()
