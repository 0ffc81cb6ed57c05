"""gpu_checkpoint_step's sorting of steps (a GPU measurement script; its bookkeeping runs anywhere)."""

from __future__ import annotations

import pytest

from tests.dist.gpu_checkpoint_step import classify, summarise


def test_steps_sorted_by_hand_when_a_write_outlasts_the_interval():
    # 12 steps, a save every 4: ms[i] is step i + 2. Steps 2..4 warm up; 8 and 12 save; the write started at step 8
    # is in flight through step 11, so this mode has no normal step after step 8.
    ms = [10.0, 11.0, 12.0, 5.0, 6.0, 7.0, 30.0, 9.0, 8.0, 8.5, 40.0]
    busy = [False, False, True, False, False, False, True, True, True, True, True]
    raw = classify(ms, busy, steps=12, every=4)
    assert raw["save_step_ms"] == [30.0, 40.0]
    assert raw["while_writing_ms"] == [9.0, 8.0, 8.5]
    assert raw["normal_ms"] == [5.0, 6.0, 7.0]  # steps 5..7; step 9 follows a save
    assert raw["write_spans_steps"] == 5
    out = summarise(raw, None)
    assert out["normal_ms"] == 6.0 and out["save_step_ratio"] == pytest.approx(35.0 / 6.0)
    assert out["while_writing_max_ratio"] == pytest.approx(9.0 / 6.0)


def test_the_other_modes_normal_step_stands_in_and_none_at_all_is_one_line():
    raw = {"save_step_ms": [20.0], "while_writing_ms": [12.0, 11.0], "normal_ms": [], "write_spans_steps": 8}
    out = summarise(raw, 10.0)
    assert out["normal_ms"] == 10.0 and out["while_writing_median_ratio"] == pytest.approx(1.15)
    with pytest.raises(SystemExit, match="no normal step in either mode"):
        summarise(raw, None)
