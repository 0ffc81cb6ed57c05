"""Shared pieces of the multi-rank test scripts: a tiny GEM model + data, batch slicing, torchrun launching."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]


def sharded_tiny_model(parallel: str, *, moe_every: int = 2, sparse_opt: str = "rowwise_adagrad", lr: float = 0.05,
                       data: dict | None = None, candidates: str = "rows", compile: str = "{}",
                       activation_checkpoint: str = "{}", param_dtype: str = "fp32"):
    """(device, rank, world, Parallelized, SGD over the dense params) for the tiny model under a `parallel:` JSON
    and `compile:` / `activation_checkpoint:` JSONs (`data`: a data group's declaration instead of the default one;
    `candidates`: model.candidates; `param_dtype`: train.param_dtype)."""
    import torch.distributed as dist

    from gem.model import GEMModel
    from gem.parallel import init_distributed, parallelize

    device = init_distributed()
    torch.manual_seed(0)
    model = GEMModel(model_cfg(moe_every=moe_every, data=data, candidates=candidates), embedding_device=device)
    p = parallelize(model, json.loads(parallel), compile_cfg=json.loads(compile),
                    ac_cfg=json.loads(activation_checkpoint), param_dtype=param_dtype,
                    sparse_optimizer_cfg={"name": sparse_opt, "lr": lr}, device=device)
    return device, dist.get_rank(), dist.get_world_size(), p, torch.optim.SGD(p.dense_parameters(), lr=lr)


def model_cfg(moe_every: int = 2, num_experts: int = 4, aux: float = 0.0, blocks: int = 2, data: dict | None = None,
              candidates: str = "rows"):
    from omegaconf import OmegaConf

    from gem.model import ModelConfig

    c = OmegaConf.to_container(OmegaConf.load(ROOT / "configs/model/gem_tiny.yaml"))
    c["kernel"] = "reference"  # the dist tests check the parallel layer, not the kernels
    c["tower"]["num_blocks"] = blocks
    c["tower"]["moe_every"] = moe_every
    c["moe"]["num_experts"] = num_experts
    c["moe"]["aux_loss_coef"] = aux
    c["candidates"] = candidates
    return ModelConfig.from_dict(c, data if data is not None else data_dict())


def data_dict(batch_size: int = 128, seed: int = 0) -> dict:
    """The default data group with tables of at most 500 rows and histories of at most 12 events."""
    from omegaconf import OmegaConf

    c = OmegaConf.to_container(OmegaConf.load(ROOT / "configs/data/synthetic.yaml"))
    for t in c["tables"].values():
        t["num_embeddings"] = min(t["num_embeddings"], 500)
    c["histories"]["events"]["max_len"] = 12
    c["batch_size"] = batch_size
    c["seed"] = seed
    return c


def dataset(batch_size: int, seed: int = 0, data: dict | None = None, max_candidates: int = 1):
    from gem.data import DataConfig, SyntheticDataset

    d = DataConfig.from_dict({**data, "batch_size": batch_size, "seed": seed} if data is not None
                             else data_dict(batch_size, seed))
    return SyntheticDataset(d.schema, d.seed, batch_size, max_candidates=max_candidates)


def _slice_kjt(kjt, a: int, b: int):
    from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

    lengths, values = [], []
    for key in kjt.keys():
        jt = kjt[key]
        off = jt.offsets()
        lengths.append(jt.lengths()[a:b])
        values.append(jt.values()[off[a]:off[b]])
    return KeyedJaggedTensor.from_lengths_sync(keys=kjt.keys(), values=torch.cat(values), lengths=torch.cat(lengths))


def slice_batch(batch, a: int, b: int):
    """Rows (requests) [a, b) of a Batch as a Batch of its own, with their candidates."""
    from gem.data import Batch
    from gem.data.batch import history_fields, request_fields

    lengths = [(o[1:] - o[:-1])[a:b] for o in batch.history_offsets]
    co = batch.cand_offsets
    ca, cb = (a, b) if co is None else (int(co[a]), int(co[b]))
    counts = None if co is None else co[a + 1:b + 1] - co[a:b]
    return Batch(
        sequence=_slice_kjt(batch.sequence, a, b),
        sparse=_slice_kjt(batch.sparse, a, b),
        dense=batch.dense[a:b],
        labels=batch.labels[ca:cb],
        **history_fields(lengths),
        **request_fields(counts, None if batch.request_ids is None else batch.request_ids[a:b]),
    )


def train_losses(p, opt, ds, steps: int, rank: int, world: int, device) -> list[float]:
    """`steps` plain steps of the parallelized model `p` on this rank's rows of each global batch of `ds`; the
    losses averaged over ranks."""
    import torch.distributed as dist

    from gem.model import multitask_loss

    losses = []
    for step in range(steps):
        full = ds.global_batch(step)
        per = full.batch_size // world
        b = slice_batch(full, rank * per, (rank + 1) * per).to(device)
        out = p.model(b)
        loss, _ = multitask_loss(out.logits, b.labels)
        (loss + out.aux_loss).backward()
        opt.step()
        opt.zero_grad()
        g = loss.detach().clone()
        dist.all_reduce(g)
        losses.append(g.item() / world)
    return losses


def torchrun(script: str, nproc: int, args: list[str], tmp_path: Path, timeout: float = 240, load=None):
    """Run tests/dist/<script> on `nproc` gloo ranks; returns what rank 0 wrote to --out: JSON, or `load(path)`."""
    out = tmp_path / f"out_{nproc}_{len(list(tmp_path.iterdir()))}.json"
    tmp = tmp_path / "tmp"
    tmp.mkdir(exist_ok=True)
    env = dict(os.environ, TMPDIR=str(tmp), OMP_NUM_THREADS="1", GLOO_SOCKET_IFNAME="lo",
               PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
           str(Path(__file__).parent / script), "--out", str(out), *args]
    r = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout, cwd=str(tmp_path))
    if r.returncode != 0:
        raise AssertionError(f"{script} x{nproc} failed ({r.returncode}):\n{r.stdout[-4000:]}\n{r.stderr[-8000:]}")
    return json.loads(out.read_text()) if load is None else load(out)


def finish(out_path: str, result: dict) -> None:
    """Rank 0 writes the JSON result; then every rank leaves the process group together."""
    import torch.distributed as dist

    if dist.get_rank() == 0:
        with open(out_path, "w") as f:
            json.dump(result, f)
    dist.barrier()
    dist.destroy_process_group()
