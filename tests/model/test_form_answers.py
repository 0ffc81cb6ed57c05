"""The FLOP count of the targets form under a sliding window, against the visible pairs of an explicit mask."""

import torch

from gem.data.batch import lengths_to_offsets
from gem.model import flops as F
from tests.model._batches import tiny_cfg


def _targets_pairs(lengths: list[int], counts: list[int], window: int) -> float:
    """Visible (query, key) pairs of the targets form's tower attention, less half the diagonal: a history token sees
    itself and up to `window` tokens before it; a target sees the last `window` history tokens and itself only."""
    total = 0.0
    for L, k in zip(lengths, counts):
        n = L + k
        vis = torch.zeros(n, n, dtype=torch.bool)
        for i in range(L):
            vis[i, max(0, i - window):i + 1] = True
        for t in range(L, n):
            vis[t, max(0, L - window):L] = True
            vis[t, t] = True
        total += float(vis.sum()) - n / 2
    return total


def test_targets_form_flops_count_the_windowed_history_each_target_sees():
    """A window of 2 against one wider than every history: the FLOPs differ by exactly the attention on the pairs
    the window hides, histories and targets alike (the weight matmuls do not depend on the window)."""
    lengths, counts = [6, 0, 3, 9], [3, 2, 1, 2]
    offsets = lengths_to_offsets(torch.tensor(lengths))
    cand = lengths_to_offsets(torch.tensor(counts))
    got = {}
    for w in (2, 32):
        cfg = tiny_cfg(attention="swa", window=w)
        cfg.candidates = "targets"
        cfg.validate()
        got[w] = F.train_flops(cfg, offsets, cand)
    t = cfg.tower_for()
    per_pair = 3 * 4 * t.num_heads * t.head_dim * t.num_blocks
    hidden = _targets_pairs(lengths, counts, 32) - _targets_pairs(lengths, counts, 2)
    # by hand: histories 6 and 9 lose 6 and 21 pairs; their 3 and 2 targets lose 4 and 7 each, the one target
    # after the history of 3 loses 1
    assert hidden == 6 + 21 + 3 * 4 + 2 * 7 + 1
    assert got[32] - got[2] == per_pair * hidden
