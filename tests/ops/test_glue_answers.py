"""The host-side helpers around the kernels, against answers written out by hand: offsets limits at their exact
edge, and tuning picks kept apart per dtype."""

from __future__ import annotations

import pytest
import torch

from gem.ops import jagged_attention
from gem.ops._common import check_offsets
from gem.ops._tune import ConfigTuner, _key_string

CPU = torch.device("cpu")


@pytest.mark.parametrize("dtype", [torch.int32, torch.int64])
def test_a_sequence_one_row_past_max_len_is_refused(dtype):
    off = torch.tensor([0, 6, 10], dtype=dtype)  # lengths 6 and 4
    check_offsets("offsets", off, 10, 6)  # the longest sequence exactly at max_len passes
    with pytest.raises(ValueError, match="has 6 rows, more than max_len=5"):
        check_offsets("offsets", off, 10, 5)
    q = torch.randn(10, 1, 16)
    with pytest.raises(ValueError, match="more than max_len=5"):
        jagged_attention(q, q, q, off, 5, kernel="reference")


def _tuner(monkeypatch, cost: dict, timed: list) -> ConfigTuner:
    t = ConfigTuner("glue", "GEM_TEST_AUTOTUNE")

    def bench(fn):
        cfg = fn()
        timed.append(cfg)
        return cost[cfg]

    monkeypatch.setattr(t, "bench", bench)
    return t


def test_a_pick_tuned_for_bf16_is_not_reused_for_fp32(monkeypatch, tmp_path):
    monkeypatch.setenv("GEM_TUNE_CACHE", str(tmp_path))
    assert _key_string("fwd", (128, torch.bfloat16)) != _key_string("fwd", (128, torch.float32))
    cands = ["small", "mid", "big"]
    timed: list = []
    bf16 = _tuner(monkeypatch, {"small": 3.0, "mid": 1.0, "big": 2.0}, timed)
    assert bf16.pick("fwd", (128, torch.bfloat16), cands, lambda c: c, CPU) == "mid"
    assert timed == cands
    # a fresh process on fp32, where the big tile is fastest: not in the cache, so timed, and its own pick
    timed.clear()
    fp32 = _tuner(monkeypatch, {"small": 3.0, "mid": 2.0, "big": 1.0}, timed)
    assert fp32.pick("fwd", (128, torch.float32), cands, lambda c: c, CPU) == "big"
    assert timed == cands
    # and each dtype's pick comes back from disk without timing
    timed.clear()
    again = _tuner(monkeypatch, {}, timed)
    assert again.pick("fwd", (128, torch.bfloat16), cands, lambda c: c, CPU) == "mid"
    assert again.pick("fwd", (128, torch.float32), cands, lambda c: c, CPU) == "big"
    assert timed == []
