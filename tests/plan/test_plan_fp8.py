"""gem plan under train.precision=fp8_block: the weights FSDP2 all-gathers in FP8 (gem.parallel.fsdp's rule) are
counted at FP8 bytes in the all-gather and in the gathered memory, the others keep param_dtype and their per-step
FP8 copy."""

from __future__ import annotations

import math

import pytest
import torch

from gem.parallel.dims import ParallelConfig, validate
from gem.parallel.fsdp import FP8_GATHER_BYTES
from gem.plan import comm
from gem.plan.memory import FsdpUnit, dense_memory, fsdp_units
from tests.dist.run_fp8_all_gather import wide_model_cfg

SCALE = 4 / 128**2  # an element's share of its 128x128 tile's fp32 scale


def test_fsdp_units_mark_the_weights_apply_precision_converts():
    from gem.model import GEMModel
    from gem.model.precision import BlockFP8Linear, apply_precision

    cfg = wide_model_cfg()
    with torch.device("meta"):
        model = GEMModel(cfg, embedding_device="meta")
    apply_precision(model, "fp8_block", "cpu")
    want = sorted(tuple(m.weight.shape) for m in model.modules() if type(m) is BlockFP8Linear)
    units = fsdp_units(cfg, 1, "fp8_block")
    got = sorted(s for u in units for s, f in zip(u.shapes, u.fp8) if f)
    assert got == want and len(want) > 0
    assert not any(f for u in fsdp_units(cfg, 1, "bf16") for f in u.fp8)
    assert all(len(u.fp8) == len(u.shapes) for u in units)


def test_gather_and_memory_bytes_by_hand():
    # a 512-row FP8 weight, a 384-row FP8 weight (192 rows a shard on 2 ranks: not whole tiles), a bias
    u = FsdpUnit("u", [(512, 256), (384, 512), (256,)], fp8=(True, True, False))
    assert FP8_GATHER_BYTES == 1 + SCALE
    # 2 shards: the first in FP8, the second and the bias in bf16
    assert u.gather_bytes(2, 2) == pytest.approx(512 * 256 * (1 + SCALE) + 384 * 512 * 2 + 256 * 2, rel=1e-12)
    # 4 shards: 128 rows a shard for the first; 96 for the second
    assert u.fp8_gathered(0, 4) and not u.fp8_gathered(1, 4) and not u.fp8_gathered(2, 4)
    # 8 shards: 64 rows a shard, nothing in FP8; 1 shard: nothing is gathered
    assert u.gather_bytes(8, 4) == 8 * (64 * 256 + 48 * 512 + 32) * 4
    assert not u.fp8_gathered(0, 1)
    # gathered: codes, W^T's codes and scales for the FP8 weight; its FP8 copy for the other
    assert u.unsharded_bytes(2, 4) == pytest.approx(512 * 256 * (2 + SCALE) + (384 * 512 + 256) * 4, rel=1e-12)
    assert u.fp8_cache_bytes(2) == pytest.approx(384 * 512 * (2 + SCALE), rel=1e-12)
    assert u.fp8_cache_bytes(1) == pytest.approx((512 * 256 + 384 * 512) * (2 + SCALE), rel=1e-12)


def test_fp8_block_halves_the_planned_all_gather_of_its_weights():
    cfg = wide_model_cfg()
    par = validate(ParallelConfig.from_any({"dense": "fsdp", "dp_shard": 2}), 2)
    groups = comm.layout_groups(par, 2, 2)

    def plan(precision, param_dtype):
        units = fsdp_units(cfg, 1, precision)
        b = sum(c.bytes for c in comm.dense_collectives(units, par, groups, 2, 4) if c.op == comm.ALL_GATHER)
        return units, b, dense_memory(units, cfg, par, tokens=0, act_bytes=2, param_dtype=param_dtype)

    _, b16, m16 = plan("bf16", "bf16")
    units, b8, m8 = plan("fp8_block", "bf16")
    fp8 = sum(math.prod(s) * (2 if u.reshard else 1) for u in units for i, s in enumerate(u.shapes)
              if u.fp8_gathered(i, 2))
    fallback = [s for u in units for i, s in enumerate(u.shapes) if u.fp8[i] and not u.fp8_gathered(i, 2)]
    assert fp8 > 0 and fallback  # the wide model has both kinds
    assert b8 == pytest.approx(b16 - fp8 * (2 - FP8_GATHER_BYTES), rel=1e-12)
    # gathered in bf16: FP8 codes + W^T's codes take what the bf16 weight took, plus the scales; the fallback
    # weights add their per-step FP8 copies
    cache = sum(u.fp8_cache_bytes(2) for u in units)
    assert cache == pytest.approx(sum(math.prod(s) for s in fallback) * (2 + SCALE), rel=1e-12)
    assert m8.params == m16.params and m16.gathered <= m8.gathered - cache <= m16.gathered * (1 + SCALE) + 1
    # gathered in fp32: the FP8-gathered weights take 2 bytes an element instead of 4
    _, _, m32 = plan("bf16", "fp32")
    _, _, m8_32 = plan("fp8_block", "fp32")
    assert m8_32.gathered - cache < m32.gathered
