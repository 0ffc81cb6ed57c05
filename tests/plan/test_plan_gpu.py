"""GPU: gem plan's HBM per rank against the allocator's peak of a real gpu_base run on one GPU.

Run on the GPU machine: `python -m pytest -m gpu tests/plan/test_plan_gpu.py -s` (prints both numbers).
"""

from __future__ import annotations

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

OVERRIDES = ["experiment=gpu_base", "train.steps=4", "train.eval_every=0", "data.eval_batches=0", "data.num_workers=0",
             "train.log_every=1", "train.tensorboard=false", "train.resume=false"]
TOL = 0.20  # the plan leaves out temporaries and allocator fragmentation (docs/PLAN.md)


def test_plan_hbm_matches_max_memory_allocated_of_gpu_base():
    from gem.cli.plan import compose as plan_compose
    from gem.parallel.dims import validate
    from gem.plan.estimate import estimate, ref_rate
    from gem.plan.topology import ClusterSpec
    from gem.train.trainer import Trainer
    from tests.train._util import compose

    cfgs = plan_compose(OVERRIDES)
    hbm_gb = torch.cuda.get_device_properties(0).total_memory / 1e9
    cluster = ClusterSpec(hosts=1, gpus_per_host=1, hbm_gb=hbm_gb)
    est = estimate(cfgs, validate(cfgs.parallel, 1), cluster, ref_rate(cfgs, 100.0))
    planned = est.hbm[0]

    torch.cuda.reset_peak_memory_stats()
    t = Trainer(compose(OVERRIDES))
    try:
        t.fit()
    finally:
        t.close()
    peak = torch.cuda.max_memory_allocated()
    d = est.dense
    print(f"gpu_base on {torch.cuda.get_device_name(0)}: max_memory_allocated {peak / 1e9:.2f} GB; plan "
          f"{planned / 1e9:.2f} GB (params {d.params / 1e9:.2f}, grads {d.grads / 1e9:.2f}, AdamW "
          f"{d.optimizer / 1e9:.2f}, gathered {d.gathered / 1e9:.2f}, activations {d.activations / 1e9:.2f} for "
          f"{est.work.tokens} tokens, tables {(planned - d.total) / 1e9:.2f}); ratio {planned / peak:.3f}")
    assert abs(planned - peak) <= TOL * peak
