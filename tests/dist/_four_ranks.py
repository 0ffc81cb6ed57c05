"""One 4-rank gloo launch shared by the layout tests (process start-up dominates on CPU): the real Trainer under
each training layout (tests/dist/test_trainer_parity.py) and the dense memory of each memory case
(tests/dist/test_plan_memory.py), on one Parquet file of synthetic rows."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from tests.dist._common import ROOT, torchrun

WORLD, GLOBAL_BATCH, STEPS = 4, 16, 5
BF16 = ["train.autocast=bf16"]
TRAIN_LAYOUTS = {
    "ddp": ["parallel=ddp"],
    "hsdp": ["parallel=hsdp", "parallel.reshard_after_forward=false", "activation_checkpoint.mode=selective",
             "activation_checkpoint.every=2"],
    "hsdp_ep": ["parallel=hsdp_ep", "activation_checkpoint.mode=full"],
    "hsdp_ep_bf16": ["parallel=hsdp_ep"] + BF16,
    # one expert per ep rank over two FSDP ranks: the experts' hidden dim is sharded (Shard(1))
    "fsdp_ep_few_experts": ["parallel.dense=fsdp", "parallel.ep=2", "model.moe.num_experts=2"],
}
# the one-rank reference each layout compares with
REFERENCE = {"ddp": "fp32", "hsdp": "fp32", "hsdp_ep": "fp32", "hsdp_ep_bf16": "bf16",
             "fsdp_ep_few_experts": "two_experts"}
REFERENCES = {"fp32": [], "bf16": BF16, "two_experts": ["model.moe.num_experts=2"]}
MEMORY_CASES = {
    "ddp": {"parallel": {"dense": "ddp"}},
    "fsdp": {"parallel": {"dense": "fsdp"}},
    "fsdp_no_reshard": {"parallel": {"dense": "fsdp", "reshard_after_forward": False}},
    "hsdp_selective_ac": {"parallel": {"dense": "fsdp", "dp_replicate": 2},
                          "activation_checkpoint": {"mode": "selective", "every": 2}},
    "hsdp_ep_full_ac": {"parallel": {"dense": "fsdp", "dp_replicate": 2, "ep": 2},
                        "activation_checkpoint": {"mode": "full"}},
    "hsdp_ep_no_reshard": {"parallel": {"dense": "fsdp", "dp_replicate": 2, "ep": 2, "reshard_after_forward": False}},
    "fsdp_ep_few_experts": {"parallel": {"dense": "fsdp", "ep": 2}, "num_experts": 2},
}
MEMORY_BLOCKS = 3  # blocks 0 and 2 dense, block 1 MoE: resharding after forward frees one of them


def train_overrides(rows: str) -> list[str]:
    return [
        "model.kernel=reference", "model.tower.num_blocks=2", "model.moe.aux_loss_coef=0",  # aux: a per-rank statistic
        "data=parquet", f"data.paths=[{rows}]", f"data.eval_paths=[{rows}]", "data.eval_batches=0",
        "data.histories.events.max_len=16",
        f"train.steps={STEPS}", "train.warmup_steps=2", "train.min_lr_ratio=0.1", "train.lr=0.01",
        "train.grad_clip=0.05", "train.autocast=none", "train.eval_every=0", "train.log_every=1",
        "train.tensorboard=false", "train.sparse_optimizer.lr=0.05",
    ]


def write_rows(directory: Path) -> str:
    """STEPS global batches of GLOBAL_BATCH synthetic rows in one Parquet file."""
    from omegaconf import OmegaConf

    from gem.data import DataConfig, SyntheticDataset
    from gem.data.parquet import write_parquet

    c = OmegaConf.to_container(OmegaConf.load(ROOT / "configs/data/synthetic.yaml"))
    c["histories"]["events"]["max_len"] = 16
    d = DataConfig.from_dict(c)
    path = directory / "train.parquet"
    write_parquet(SyntheticDataset(d.schema, 0, GLOBAL_BATCH), str(path), STEPS)
    return str(path)


def launch(directory: Path) -> dict:
    rows = write_rows(directory)
    args = ["--common", json.dumps(train_overrides(rows)), "--layouts", json.dumps(TRAIN_LAYOUTS),
            "--global-batch", str(GLOBAL_BATCH), "--memory-cases", json.dumps(MEMORY_CASES),
            "--memory-blocks", str(MEMORY_BLOCKS)]
    out = torchrun("run_trainer.py", WORLD, args, directory, timeout=500,
                   load=lambda p: torch.load(p, weights_only=True))
    return {"rows": rows, **out}
