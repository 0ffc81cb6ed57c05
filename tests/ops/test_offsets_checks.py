"""Bad offsets / max_len get one clear error from every jagged op, before any kernel reads out of bounds."""

from __future__ import annotations

import pytest
import torch

from gem.ops import block_attention, gdpa, jagged_attention, rope
from gem.ops._common import check_offsets
from gem.ops.rotary import RopeConfig

T, H, D = 10, 2, 16


def _calls():
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(T, H, D, generator=g) for _ in range(3))

    def jfa(off, max_len):
        return jagged_attention(q, k, v, off, max_len, kernel="reference")

    def jfa_cross(off, max_len):
        return jagged_attention(q, k, v, torch.tensor([0, 5, 10]), 5, off, max_len, kernel="reference")

    def gdpa_q(off, max_len):
        return gdpa(q, k, v, off, max_len, torch.tensor([0, 5, 10]), 5, kernel="reference")

    def gdpa_k(off, max_len):
        return gdpa(q, k, v, torch.tensor([0, 5, 10]), 5, off, max_len, kernel="reference")

    def block(off, max_len):
        return block_attention(q, k, v, off, max_len, block_size=4, kernel="reference")

    def rope_op(off, max_len):
        return rope(q, off, max_len, config=RopeConfig(), kernel="reference")

    return {"jfa": jfa, "jfa_cross": jfa_cross, "gdpa_q": gdpa_q, "gdpa_k": gdpa_k, "block": block, "rope": rope_op}


BAD = [
    ([1, 5, 10], 9, "start at 0"),
    ([0, 7, 4], 7, "non-decreasing"),
    ([0, 5, 11], 6, "have 10 rows"),
    ([0, 5, 9], 5, "have 10 rows"),  # rows past offsets[-1] would be left unwritten
    ([0, 2, 10], 5, "more than max_len=5"),
]


@pytest.mark.parametrize("op", list(_calls()))
@pytest.mark.parametrize("offsets,max_len,message", BAD)
def test_bad_offsets_raise_one_clear_error(op, offsets, max_len, message):
    fn = _calls()[op]
    with pytest.raises(ValueError, match=message):
        fn(torch.tensor(offsets), max_len)
    fn(torch.tensor([0, 5, 10]), 5)  # the same call with good offsets runs


def test_check_is_kept_per_batch_version_and_limits(monkeypatch):
    from gem.ops import JaggedBatch

    off = torch.tensor([0, 3, 8])
    batch = JaggedBatch(off, 5)
    check_offsets("offsets", batch, 8, 5)
    calls = []
    real_diff = torch.Tensor.__sub__
    monkeypatch.setattr(torch.Tensor, "__sub__", lambda a, b: calls.append(1) or real_diff(a, b))
    check_offsets("offsets", batch, 8, 5)
    assert not calls  # checked before: nothing computed
    check_offsets("offsets", off, 8, 5)
    assert calls  # a plain tensor is checked every time
    monkeypatch.undo()
    with pytest.raises(ValueError, match="max_len=4"):
        check_offsets("offsets", batch, 8, 4)  # other limits: checked again
    off[2] = 20  # an in-place write bumps the version: checked again
    with pytest.raises(ValueError, match="have 8 rows"):
        check_offsets("offsets", batch, 8, 5)
    with pytest.raises(ValueError, match="contiguous"):
        check_offsets("offsets", torch.tensor([0, 9, 3, 9, 8, 9])[::2], 8, 5)


@pytest.mark.parametrize("offsets,rows,max_len", [([0], 0, 0), ([0, 0, 0], 0, 0), ([0, 4, 4], 4, 4)])
@pytest.mark.parametrize("dtype", [torch.int32, torch.int64])
def test_valid_edge_offsets_pass(offsets, rows, max_len, dtype):
    check_offsets("offsets", torch.tensor(offsets, dtype=dtype), rows, max_len)


def test_float_offsets_are_a_type_error():
    with pytest.raises(TypeError, match="int32 or int64"):
        check_offsets("offsets", torch.tensor([0.0, 3.0]), 3, 3)


def test_content_check_can_be_switched_off(monkeypatch):
    monkeypatch.setenv("GEM_OFFSETS_CHECK", "0")
    check_offsets("offsets", torch.tensor([0, 9, 3]), 3, 1)  # contents not checked
    with pytest.raises(TypeError, match="int32 or int64"):  # shape / dtype still are
        check_offsets("offsets", torch.tensor([0.0, 3.0]), 3, 3)
