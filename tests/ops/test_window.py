"""One window normaliser for jagged_attention and gdpa: the same spellings mean the same mask in both ops."""

from __future__ import annotations

import pytest
import torch

from gem.ops import gdpa, jagged_attention
from gem.ops._common import norm_window


@pytest.mark.parametrize("causal,window,want", [
    (False, None, (-1, -1)), (True, None, (-1, 0)), (False, 7, (7, 0)), (True, 7, (7, 0)), (False, (3, 5), (3, 5)),
    (True, (3, 5), (3, 0)), (False, (None, 2), (-1, 2)), (False, (-1, -1), (-1, -1)), (True, (4, -1), (4, 0)),
    (False, [2, 0], (2, 0)), (False, 0, (0, 0)),
])
def test_norm_window(causal, window, want):
    assert norm_window(causal, window) == want


@pytest.mark.parametrize("window,err", [(-3, ValueError), ((-2, 0), ValueError), ((0, -5), ValueError),
                                        ((1.5, 0), ValueError), (True, TypeError), ((1, 2, 3), TypeError),
                                        ("7", TypeError)])
def test_bad_windows_raise_the_same_in_both_ops(window, err):
    q = torch.randn(5, 1, 8)
    off = torch.tensor([0, 5])
    with pytest.raises(err, match="window"):
        norm_window(False, window)
    with pytest.raises(err, match="window"):
        jagged_attention(q, q, q, off, 5, window=window, kernel="reference")
    with pytest.raises(err, match="window"):
        gdpa(q, q, q, off, 5, off, 5, window=window, kernel="reference")


def _mask_of(op, window, causal=False):
    """Which keys each query sees, read off the op itself: one-hot values and a query that scores every key alike,
    so out[i, j] > 0 exactly where key j is visible to query i (for gdpa's relu, scores of 1 give act 1)."""
    n = 11
    q = torch.ones(n, 1, 16)
    k = torch.ones(n, 1, 16)
    v = torch.eye(n, 16)[:, None, :]
    off = torch.tensor([0, n])
    if op == "jfa":
        out = jagged_attention(q, k, v, off, n, causal=causal, window=window, kernel="reference")
    else:
        out = gdpa(q, k, v, off, n, off, n, activation="relu", causal=causal, window=window, kernel="reference")
    return out[:, 0, :n] > 0


@pytest.mark.parametrize("window,causal", [(7, False), (0, False), ((3, 2), False), ((None, 2), True), ((-1, 4), False),
                                           ((2, None), False)])
def test_ops_agree_on_every_spelling(window, causal):
    i, j = torch.arange(11)[:, None], torch.arange(11)[None, :]
    left, right = norm_window(causal, window)
    want = torch.ones(11, 11, dtype=torch.bool)
    if left >= 0:
        want &= j >= i - left
    if right >= 0:
        want &= j <= i + right
    assert torch.equal(_mask_of("jfa", window, causal), want)
    assert torch.equal(_mask_of("gdpa", window, causal), want)
    if isinstance(window, int):  # an int is the causal left window in both
        assert torch.equal(_mask_of("gdpa", window), _mask_of("gdpa", (window, 0), causal=True))
