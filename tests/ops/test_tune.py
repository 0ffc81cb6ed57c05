"""gem.ops._tune.ConfigTuner: timing, caching per key, and skipping configs that do not launch."""

import pytest
import torch

from gem.ops._tune import ConfigTuner

CPU = torch.device("cpu")


def _launcher(bad=()):
    launched = []

    def launch(cfg):
        if cfg in bad:
            raise RuntimeError(f"out of resource for {cfg}")
        launched.append(cfg)

    return launch, launched


def test_fastest_config_wins_and_is_cached_per_key(monkeypatch):
    t = ConfigTuner("test", "GEM_TEST_AUTOTUNE")
    cost = {"a": 3.0, "b": 1.0, "c": 2.0}
    timed = []

    def bench(fn):
        fn()
        timed.append(launched[-1])
        return cost[launched[-1]]

    monkeypatch.setattr(t, "bench", bench)
    launch, launched = _launcher()
    assert t.pick("fwd", (1,), ["a", "b", "c"], launch, CPU) == "b"
    assert t.pick("fwd", (1,), ["a", "b", "c"], launch, CPU) == "b"
    assert timed == ["a", "b", "c"]  # timed once per key
    t.pick("fwd", (2,), ["a", "b", "c"], launch, CPU)
    assert len(timed) == 6


def test_configs_that_do_not_launch_are_skipped(monkeypatch):
    t = ConfigTuner("test", "GEM_TEST_AUTOTUNE")
    monkeypatch.setattr(t, "bench", lambda fn: (fn(), 1.0)[1])
    launch, _ = _launcher(bad={"a"})
    assert t.pick("fwd", (), ["a", "b"], launch, CPU) == "b"
    launch, _ = _launcher(bad={"a", "b"})
    with pytest.raises(RuntimeError, match="no bwd config"):
        t.pick("bwd", (), ["a", "b"], launch, CPU)


def test_tuning_off_keeps_the_first_config_that_launches(monkeypatch):
    t = ConfigTuner("test", "GEM_TEST_AUTOTUNE")
    monkeypatch.setenv("GEM_TEST_AUTOTUNE", "0")
    monkeypatch.setattr(t, "bench", lambda fn: pytest.fail("timed with tuning off"))
    launch, launched = _launcher(bad={"a"})
    assert t.pick("fwd", (), ["a", "b", "c"], launch, CPU) == "b"
    assert launched == ["b"]
    launch, _ = _launcher(bad={"a", "b", "c"})
    with pytest.raises(RuntimeError, match="out of resource"):
        t.pick("bwd", (), ["a", "b", "c"], launch, CPU)


@pytest.mark.parametrize("msg", ["CUDA error: an illegal memory access was encountered",
                                 "Triton Error [CUDA]: unspecified launch failure"])
@pytest.mark.parametrize("tuning", ["0", "1"])
def test_a_device_fault_is_raised_not_skipped(monkeypatch, tuning, msg):
    """A CUDA fault leaves the context unusable: retrying the next config would only hide where it happened."""
    monkeypatch.setenv("GEM_TEST_AUTOTUNE", tuning)
    t = ConfigTuner("test", "GEM_TEST_AUTOTUNE")
    monkeypatch.setattr(t, "bench", lambda fn: fn() or 1.0)
    tried = []

    def launch(cfg):
        tried.append(cfg)
        raise RuntimeError(msg)

    with pytest.raises(RuntimeError, match="CUDA"):
        t.pick("fwd", (1,), ["a", "b"], launch, CPU)
    assert tried == ["a"]


def test_candidates_made_only_for_a_new_key(monkeypatch):
    t = ConfigTuner("test", "GEM_TEST_AUTOTUNE")
    monkeypatch.setattr(t, "bench", lambda fn: (fn(), 1.0)[1])
    made = []
    launch, _ = _launcher()

    def cands():
        made.append(1)
        return ["a", "b"]

    assert t.pick("fwd", (1,), cands, launch, CPU) == "a"
    assert t.pick("fwd", (1,), cands, launch, CPU) == "a"
    assert len(made) == 1  # a hit does not build the list
    t.pick("fwd", (2,), cands, launch, CPU)
    assert len(made) == 2


def test_host_integer_helpers_match_triton():
    import triton

    from gem.ops._common import cdiv, next_pow2

    for n in range(1100):
        assert next_pow2(n) == triton.next_power_of_2(n), n
        for b in (1, 16, 64, 127):
            assert cdiv(n, b) == triton.cdiv(n, b), (n, b)
