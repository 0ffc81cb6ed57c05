"""gem.ops._tune.ConfigTuner: timing, caching per key (in memory and on disk), and skipping configs that do not
launch."""

import json
import random
import warnings
from typing import NamedTuple

import pytest
import torch

from gem.ops import _tune
from gem.ops._tune import ConfigTuner, tile_config

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


def _fake_bench(cost, calls, rng=None, noise=0.0):
    """A bench that runs the launch and reports cost[cfg] ms, scaled by up to +-noise at random."""

    def bench(fn):
        cfg = fn()
        calls.append(cfg)
        return cost[cfg] * (1 + (rng.uniform(-noise, noise) if rng else 0.0))

    return bench


def _tuner(monkeypatch, bench, name="test"):
    t = ConfigTuner(name, "GEM_TEST_AUTOTUNE")
    monkeypatch.setattr(t, "bench", bench)
    return t


def _ident(cfg):
    return cfg


@pytest.mark.parametrize("seed", range(20))
def test_near_ties_resolve_to_the_earlier_candidate_in_every_process(monkeypatch, seed):
    """Fresh tuners (as in separate processes) timing a near-tie with noise inside the margin all keep the first
    candidate; a later one that is clearly faster wins; among later ones, the earliest near the fastest."""
    monkeypatch.setenv("GEM_TUNE_CACHE", "0")
    rng = random.Random(seed)
    calls = []
    noise = _tune.MARGIN / 6  # +-0.5%: the tie (1%) plus noise stays inside the margin
    t = _tuner(monkeypatch, _fake_bench({"a": 1.0, "b": 0.99, "c": 0.995}, calls, rng, noise))
    assert t.pick("fwd", (1,), ["a", "b", "c"], _ident, CPU) == "a"
    t = _tuner(monkeypatch, _fake_bench({"a": 1.0, "b": 0.9, "c": 0.895}, calls, rng, noise))
    assert t.pick("fwd", (1,), ["a", "b", "c"], _ident, CPU) == "b"
    assert len(calls) == 6


def test_choose_needs_more_than_the_margin_to_switch():
    m = _tune.MARGIN
    assert _tune.choose([(1.0, "a"), (1.0 / (1 + m) + 1e-6, "b")]) == "a"
    assert _tune.choose([(1.0, "a"), (1.0 / (1 + m) - 1e-3, "b")]) == "b"
    assert _tune.choose([(3.0, "a"), (1.0, "b"), (1.0, "c")]) == "b"


def test_cpu_bench_is_the_median_of_repeated_runs(monkeypatch):
    ms = [1.0, 1.0, 50.0, 1.0, 2.0, 1.0, 1.0, 1.0]
    clock = iter([x for i in range(len(ms)) for x in (sum(ms[:i]) / 1e3, sum(ms[:i + 1]) / 1e3)])
    monkeypatch.setattr(_tune.time, "perf_counter", lambda: next(clock))
    runs = []
    assert ConfigTuner("test").bench(lambda: runs.append(1)) == pytest.approx(1.0)
    assert len(runs) == _tune.REPS + 1  # a warm-up, then REPS timed runs


class Tile(NamedTuple):
    layout: str
    block: int
    warps: int


class FakeTritonConfig:  # the attributes of triton.Config that the cache stores
    def __init__(self, kwargs, num_warps, num_stages):
        self.kwargs, self.num_warps, self.num_stages = kwargs, num_warps, num_stages


_CANDS = {
    "tuple": [(64, 64, 4, 2), (128, 64, 8, 2, 128), (32, 32, 4, 1)],
    "namedtuple": [Tile("halves", 16, 4), Tile("full", 64, 8), Tile("full", 32, 4)],
    "dict": [{"BLOCK_M": 16, "KT": False, "num_warps": 4, "num_stages": 2},
             {"BLOCK_M": 32, "KT": True, "num_warps": 8, "num_stages": 3},
             {"BLOCK_M": 64, "KT": True, "num_warps": 8, "num_stages": 3}],
    "triton.Config": [FakeTritonConfig({"BLOCK_M": 64}, 4, 2), FakeTritonConfig({"BLOCK_M": 128}, 8, 3),
                      FakeTritonConfig({"BLOCK_M": 32}, 4, 3)],
}
KEY = (128, torch.bfloat16, True, "v2", 0.5, None)


@pytest.mark.parametrize("form", _CANDS)
def test_a_tuned_pick_is_cached_on_disk_and_a_fresh_tuner_times_nothing(monkeypatch, tmp_path, form):
    monkeypatch.setenv("GEM_TUNE_CACHE", str(tmp_path))
    cands = _CANDS[form]
    cost = {id(c): t for c, t in zip(cands, (3.0, 1.0, 2.0))}
    calls = []


    def bench(fn):
        calls.append(1)
        return cost[id(fn())]

    t = _tuner(monkeypatch, bench)
    assert t.pick("fwd", KEY, cands, _ident, CPU) is cands[1]
    assert len(calls) == 3
    path = _tune.cache_file("test", CPU)
    assert path.parent.parent == tmp_path and json.loads(path.read_text())["op"] == "test"
    assert not [p for p in path.parent.iterdir() if p != path]  # no temp file left behind

    fresh = _tuner(monkeypatch, lambda fn: pytest.fail("timed with a warm cache"))
    launched = []
    equal = [type(c)(**vars(c)) if form == "triton.Config" else type(c)(c) if form != "namedtuple" else Tile(*c)
             for c in cands]  # equal candidates made anew, as a new process makes them
    got = fresh.pick("fwd", KEY, lambda: equal, launched.append, CPU)
    assert got is equal[1] and launched == []
    # another kind or key is not in the cache: timed
    calls.clear()
    assert t.pick("bwd", KEY, cands, _ident, CPU) is cands[1] and len(calls) == 3


def test_picks_of_several_tuners_share_one_file(monkeypatch, tmp_path):
    """Each write re-reads the file, so two processes' picks for different keys both survive."""
    monkeypatch.setenv("GEM_TUNE_CACHE", str(tmp_path))
    cost = {"a": 2.0, "b": 1.0}
    one = _tuner(monkeypatch, _fake_bench(cost, []))
    two = _tuner(monkeypatch, _fake_bench(cost, []))
    one.pick("fwd", (1,), ["a", "b"], _ident, CPU)
    two.pick("fwd", (2,), ["a", "b"], _ident, CPU)
    fresh = _tuner(monkeypatch, lambda fn: pytest.fail("timed with a warm cache"))
    assert fresh.pick("fwd", (1,), ["a", "b"], _ident, CPU) == "b"
    assert fresh.pick("fwd", (2,), ["a", "b"], _ident, CPU) == "b"


def test_a_stale_entry_matching_no_candidate_is_timed_again(monkeypatch, tmp_path):
    monkeypatch.setenv("GEM_TUNE_CACHE", str(tmp_path))
    _tuner(monkeypatch, _fake_bench({"a": 2.0, "b": 1.0}, [])).pick("fwd", (1,), ["a", "b"], _ident, CPU)
    calls = []
    t = _tuner(monkeypatch, _fake_bench({"a": 1.0, "c": 2.0}, calls))
    assert t.pick("fwd", (1,), ["a", "c"], _ident, CPU) == "a" and calls == ["a", "c"]
    assert json.loads(_tune.cache_file("test", CPU).read_text())["configs"] == {'["fwd",1]': "a"}


@pytest.mark.parametrize("content", ["{not json", "[1, 2]", '{"format": 1, "env": {}, "op": "test", "configs": {}}',
                                     '{"format": 99}', "\udcff"])
def test_a_corrupt_or_foreign_cache_file_is_ignored_with_one_warning(monkeypatch, tmp_path, content):
    monkeypatch.setenv("GEM_TUNE_CACHE", str(tmp_path))
    path = _tune.cache_file("test", CPU)
    path.parent.mkdir(parents=True)
    path.write_bytes(content.encode("utf-8", "surrogateescape"))
    calls = []
    t = _tuner(monkeypatch, _fake_bench({"a": 2.0, "b": 1.0}, calls))
    with pytest.warns(UserWarning, match=r"gem tuning cache .*ignored") as record:
        assert t.pick("fwd", (1,), ["a", "b"], _ident, CPU) == "b"
    assert len(record) == 1 and "\n" not in str(record[0].message) and len(calls) == 2
    # the tuned pick replaced the bad file
    fresh = _tuner(monkeypatch, lambda fn: pytest.fail("timed with a warm cache"))
    assert fresh.pick("fwd", (1,), ["a", "b"], _ident, CPU) == "b"


@pytest.mark.parametrize("off", ["0", ""])
def test_cache_disabled_by_env_writes_nothing_and_tunes_every_time(monkeypatch, tmp_path, off):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.setenv("GEM_TUNE_CACHE", off)
    assert _tune.cache_dir() is None
    calls = []
    for _ in range(2):
        _tuner(monkeypatch, _fake_bench({"a": 2.0, "b": 1.0}, calls)).pick("fwd", (1,), ["a", "b"], _ident, CPU)
    assert len(calls) == 4 and not list(tmp_path.iterdir())


def test_default_cache_dir_follows_xdg(monkeypatch, tmp_path):
    monkeypatch.delenv("GEM_TUNE_CACHE", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert _tune.cache_dir() == tmp_path / "gem" / "tuning"
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path))
    assert _tune.cache_dir() == tmp_path / ".cache" / "gem" / "tuning"


def test_entries_for_another_device_or_version_are_ignored(monkeypatch, tmp_path):
    monkeypatch.setenv("GEM_TUNE_CACHE", str(tmp_path))
    _tuner(monkeypatch, _fake_bench({"a": 2.0, "b": 1.0}, [])).pick("fwd", (1,), ["a", "b"], _ident, CPU)
    real = _tune.environment
    for field in ("device", "torch", "triton", "gem"):
        monkeypatch.setattr(_tune, "environment", lambda d, f=field: {**real(d), f: "other"})
        calls = []
        t = _tuner(monkeypatch, _fake_bench({"a": 1.0, "b": 2.0}, calls))
        assert t.pick("fwd", (1,), ["a", "b"], _ident, CPU) == "a" and len(calls) == 2, field
    monkeypatch.setattr(_tune, "environment", real)
    fresh = _tuner(monkeypatch, lambda fn: pytest.fail("timed with a warm cache"))
    assert fresh.pick("fwd", (1,), ["a", "b"], _ident, CPU) == "b"


def test_shipped_defaults_are_used_after_the_user_cache(monkeypatch, tmp_path):
    monkeypatch.setenv("GEM_TUNE_CACHE", str(tmp_path / "cache"))
    env = _tune.environment(CPU)
    shipped = tmp_path / "defaults.json"
    shipped.write_text(json.dumps({"format": 1, "entries": [
        {"env": env, "op": "test", "configs": {'["fwd",1]': "b", '["fwd",2]': "b"}},
        {"env": {**env, "device": "other"}, "op": "test", "configs": {'["fwd",3]': "b"}},
        {"env": env, "op": "another op", "configs": {'["fwd",4]': "b"}},
    ]}))
    monkeypatch.setattr(_tune, "SHIPPED", shipped)
    path = _tune.cache_file("test", CPU)
    path.parent.mkdir(parents=True)
    path.write_text(json.dumps({"format": 1, "env": env, "op": "test", "configs": {'["fwd",2]': "c"}}))
    calls = []
    t = _tuner(monkeypatch, _fake_bench({"a": 1.0, "b": 2.0, "c": 3.0}, calls))
    assert t.pick("fwd", (1,), ["a", "b", "c"], _ident, CPU) == "b"  # shipped
    assert t.pick("fwd", (2,), ["a", "b", "c"], _ident, CPU) == "c"  # the user's cache overrides
    assert calls == []
    assert t.pick("fwd", (3,), ["a", "b", "c"], _ident, CPU) == "a"  # another device's entry: timed
    assert t.pick("fwd", (4,), ["a", "b", "c"], _ident, CPU) == "a"  # another op's entry: timed
    assert len(calls) == 6


def test_the_shipped_defaults_file_is_valid():
    body = json.loads(_tune.SHIPPED.read_text())
    assert body["format"] == _tune.FORMAT and isinstance(body["entries"], list)
    assert all(_tune._valid(e) for e in body["entries"])


def test_tuning_off_reads_no_cache(monkeypatch, tmp_path):
    monkeypatch.setenv("GEM_TUNE_CACHE", str(tmp_path))
    _tuner(monkeypatch, _fake_bench({"a": 2.0, "b": 1.0}, [])).pick("fwd", (1,), ["a", "b"], _ident, CPU)
    monkeypatch.setenv("GEM_TEST_AUTOTUNE", "0")
    t = _tuner(monkeypatch, lambda fn: pytest.fail("timed with tuning off"))
    assert t.pick("fwd", (1,), ["a", "b"], lambda cfg: None, CPU) == "a"


def test_ship_tuned_folds_a_cache_into_the_defaults_a_fresh_process_then_uses(monkeypatch, tmp_path):
    """gem.bench.tuned.ship_tuned (tools/ship_tuned.py): a tuned cache dir becomes shipped entries (replacing the
    same op + env, keeping others); with the user cache emptied, a fresh tuner picks from them without timing."""
    from gem.bench.tuned import ship_tuned

    monkeypatch.setenv("GEM_TUNE_CACHE", str(tmp_path / "cache"))
    _tuner(monkeypatch, _fake_bench({"a": 2.0, "b": 1.0}, [])).pick("fwd", (7,), ["a", "b"], _ident, CPU)
    env = _tune.environment(CPU)
    out = tmp_path / "defaults.json"
    out.write_text(json.dumps({"format": 1, "entries": [
        {"env": env, "op": "test", "configs": {'["fwd",1]': "a"}},  # replaced: same op and env
        {"env": {**env, "device": "other"}, "op": "test", "configs": {'["fwd",3]': "b"}}]}))
    assert ship_tuned(tmp_path / "cache", out) == (1, 2)
    body = json.loads(out.read_text())
    assert len(body["entries"]) == 2 and all(_tune._valid(e) for e in body["entries"])
    monkeypatch.setattr(_tune, "SHIPPED", out)
    monkeypatch.setenv("GEM_TUNE_CACHE", str(tmp_path / "empty"))
    fresh = _tuner(monkeypatch, lambda fn: pytest.fail("timed with shipped defaults"))
    assert fresh.pick("fwd", (7,), ["a", "b"], _ident, CPU) == "b"
    with pytest.raises(ValueError, match="nothing: no tuning files"):
        ship_tuned(tmp_path / "nothing", out)


# ---------------------------------------------------------------------------------- outputs checked while tuning


def _writer(out, results, cost, timed):
    """A launch writing results[cfg] into out (None: writes nothing), and a bench timing it at cost[cfg]."""
    def launch(cfg):
        if results[cfg] is not None:
            out.copy_(results[cfg])

    def bench(fn):
        before = len(timed)
        fn()
        return cost[timed[before]] if len(timed) > before else 0.0

    def tracked(cfg):
        timed.append(cfg)
        launch(cfg)

    return tracked, bench


@pytest.mark.parametrize("broken", ["nan", "skips its store", "wrong values"])
def test_a_config_whose_result_disagrees_is_not_picked(monkeypatch, broken):
    """The fastest candidate gives another result than the others (as a miscompile would): it is passed over with
    one warning and the fastest agreeing one is picked; outputs are NaN-filled before each candidate, so one that
    stores nothing cannot pass off the previous candidate's values as its own."""
    good = torch.randn(64, 8, generator=torch.Generator().manual_seed(0))
    bad = {"nan": good.clone().index_fill_(0, torch.tensor([3]), float("nan")), "skips its store": None,
           "wrong values": good * 1.5}[broken]
    results = {"a": good, "b": good + 1e-7 * torch.randn(64, 8), "c": bad}
    cost = {"a": 3.0, "b": 2.0, "c": 1.0}
    out, timed = torch.empty(64, 8), []
    launch, bench = _writer(out, results, cost, timed)
    t = ConfigTuner("test", "GEM_TEST_AUTOTUNE")
    monkeypatch.setattr(t, "bench", bench)
    with pytest.warns(UserWarning, match=r"config c for fwd .* another result"):
        assert t.pick("fwd", (1,), ["a", "b", "c"], launch, CPU, outputs=(out,)) == "b"
    assert timed == ["a", "b", "c"]


def test_agreeing_configs_keep_the_fastest_and_without_outputs_nothing_is_checked(monkeypatch):
    good = torch.randn(32)
    results = {"a": good, "b": None}  # b stores nothing: only an outputs check can see it
    out, timed = torch.empty(32), []
    launch, bench = _writer(out, results, {"a": 2.0, "b": 1.0}, timed)
    t = ConfigTuner("test", "GEM_TEST_AUTOTUNE")
    monkeypatch.setattr(t, "bench", bench)
    assert t.pick("fwd", (1,), ["a", "b"], launch, CPU) == "b"  # unchecked: the fastest
    results["b"] = good * (1 + 1e-6)  # summation-order noise
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert t.pick("fwd", (2,), ["a", "b"], launch, CPU, outputs=(out,)) == "b"


def test_when_all_disagree_the_first_candidate_is_the_reference():
    assert _tune.agreeing_configs([(0, 1.0), (0, 2.0), (1, 1.0)]) == [True, False, False]
    assert _tune.agreeing_configs([(0, 1.0), (0, 2.0), (0, 2.0 + 1e-9)]) == [False, True, True]
    assert _tune.agreeing_configs([]) == []
    x = torch.tensor([1.0, -2.0, float("inf"), float("nan")])
    assert _tune.fingerprint((x, torch.tensor([3], dtype=torch.int32))) == (2, 6.0)
    assert _tune.fingerprint((torch.empty(0, 4), torch.tensor(-2.5))) == (0, 2.5)
    big = torch.ones(3000, 7000)  # more than one slice of 2^24 values
    big[2999, 6999] = float("nan")
    assert _tune.fingerprint((big[:, 1:],)) == (1, 3000 * 6999 - 1.0)


def test_jfa_passes_over_a_miscompiled_tile(monkeypatch):
    """gem.ops.jfa hands the tuner its outputs: a forward and a dQ config that write NaN (standing in for a
    miscompile on some device) are timed fastest and still not picked, and the op's result is right."""
    from gem.ops import triton_jfa
    from tests.ops.test_jfa import _check, _inputs, _run

    monkeypatch.setenv("GEM_TUNE_CACHE", "0")
    monkeypatch.setattr(triton_jfa, "_BWD_DELTA_PRE_MIN_LEN", 1 << 30)
    monkeypatch.setattr(triton_jfa, "_TUNER", ConfigTuner("gem.ops.jfa"))
    good, bad = tile_config(16, 16, 4, 1), tile_config(16, 32, 4, 1)
    monkeypatch.setattr(triton_jfa, "_fwd_configs", lambda d: [good, bad])
    monkeypatch.setattr(triton_jfa, "_bwd_configs", lambda d, form: [(16, 16, 16, 16, 4, 1), (16, 16, 16, 32, 4, 1)])

    def corrupting(kernel, out_arg):
        class Wrapped:
            def __getitem__(self, grid):
                def run(*args, **kwargs):
                    kernel[grid](*args, **kwargs)
                    if kwargs["BLOCK_N"] == 32:
                        args[out_arg].fill_(float("nan"))
                return run
        return Wrapped()

    monkeypatch.setattr(triton_jfa, "_jfa_fwd_kernel", corrupting(triton_jfa._jfa_fwd_kernel, 3))
    monkeypatch.setattr(triton_jfa, "_jfa_bwd_dq_kernel", corrupting(triton_jfa._jfa_bwd_dq_kernel, 6))
    cost = iter([2.0, 1.0] * 4)
    monkeypatch.setattr(triton_jfa._TUNER, "bench", lambda fn: (fn(), next(cost))[1])
    lens = [5, 0, 33, 1]
    q, k, v = _inputs(lens, h=2, h_kv=1, d=16, dtype=torch.float32, device="cpu")
    with pytest.warns(UserWarning, match="another result"):
        got, want = _run(q, k, v, lens, causal=True)
    _check(got, want, torch.float32)
    assert {k[0]: v for k, v in triton_jfa._TUNER.best.items()} == {"fwd": good, "bwd_dq": good, "bwd_dkdv": good}


def test_correct_tiles_of_every_op_agree(monkeypatch):
    """The check never rejects a right answer: each op tuned between two different (correct) tiles on jagged rows
    under the interpreter fingerprints every candidate and warns about none."""
    from gem.ops import rotary, triton_block, triton_gdpa, triton_jfa

    monkeypatch.setenv("GEM_TUNE_CACHE", "0")
    checked = []
    real = _tune.fingerprint
    monkeypatch.setattr(_tune, "fingerprint", lambda outputs: checked.append(1) or real(outputs))
    for mod in (triton_jfa, triton_block, triton_gdpa, rotary):
        monkeypatch.setattr(mod._TUNER, "best", {})
        monkeypatch.setattr(mod._TUNER, "bench", lambda fn: (fn(), 1.0)[1])
    monkeypatch.setattr(triton_jfa, "_BWD_DELTA_PRE_MIN_LEN", 1 << 30)
    monkeypatch.setattr(triton_jfa, "_fwd_configs", lambda d: [tile_config(16, 16, 4, 1), tile_config(16, 32, 4, 1)])
    monkeypatch.setattr(triton_jfa, "_bwd_configs", lambda d, form: [(16, 16, 16, 16, 4, 1), (32, 16, 16, 32, 4, 1)])
    monkeypatch.setattr(triton_block, "configs", lambda kind, bs: [
        tile_config(16, 16, 4, 1), tile_config(32, 16, 4, 1), tile_config(16, 32, 4, 1)])
    two = {"fwd_short": [(), (1, 1), (2, 1)], "fwd_long": [("BLOCK_N",), (16, 1, 1), (32, 1, 1)],
           "bwd_dkdv": [("BLOCK_M",), (16, 1, 1), (32, 1, 1)], "bwd_dq_small": [("BLOCK_N",), (16, 1, 1), (32, 1, 1)],
           "bwd_short": [("BLOCK_M", "KT"), (16, False, 1, 1), (32, True, 1, 1)]}
    monkeypatch.setattr(triton_gdpa, "CONFIGS", {**triton_gdpa.CONFIGS, **{
        k: triton_gdpa._configs(v[0], v[1:]) for k, v in two.items()}})
    monkeypatch.setattr(rotary, "rope_configs", lambda rd, il: [
        rotary.rope_launch("halves", 16, "loop", 4), rotary.rope_launch("halves", 32, "grid", 4)])

    lens = [37, 1, 0, 20]
    off = torch.nn.functional.pad(torch.tensor(lens).cumsum(0), (1, 0))
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(sum(lens), 2, 16, generator=g) for _ in range(3))
    do = torch.randn(q.shape, generator=g)
    results = []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out, lse = triton_jfa._fwd(q, k, v, off, off, 37, 37, 0.25, -1, 0, False)
        results += [out, lse, *triton_jfa._bwd(do, q, k, v, out, lse, off, off, 37, 37, 0.25, -1, 0, False)]
        out, lse = triton_block._fwd(q, k, v, off, 37, 16, True, 0.25, 10000.0, 16, False)
        results += [out, lse, *triton_block._bwd(do, q, k, v, out, lse, off, 37, 16, True, 0.25, 10000.0, 16, False)]
        for short in (1, 0):
            args = (off, off, 37, 37, "silu", "", -1, -1, 0.25, 1.0, True, short)
            results += [triton_gdpa._gdpa_fwd(q, k, v, *args), *triton_gdpa._gdpa_bwd(do, q, k, v, *args)]
        results.append(rotary.rope_op.fwd_op(q, off, 37, 10000.0, 16, False, False))
    assert not [w for w in caught if "another result" in str(w.message)]
    # the pick's own launch rewrites every output the NaN fill touched
    assert all(torch.isfinite(r).all() for r in results)
    assert len(checked) >= 2 * 9  # two candidates each: jfa 3 kernels, block 3, gdpa >= 2, rope 1


# ------------------------------------------------------------------------------------------- resource estimates


def test_fitting_keeps_order_and_falls_back_to_smaller_tiles():
    size = {"big": 300, "mid": 200, "small": 100, "tiny": 50, "huge_fb": 400}
    est = size.__getitem__
    assert _tune.fitting(["big", "mid", "small"], ["tiny"], est, 250) == (["mid", "small"], ["tiny"])
    assert _tune.fitting(["big"], ["huge_fb", "small", "tiny"], est, 250) == ([], ["small", "tiny"])
    # nothing fits at all: the smallest fallback is still tried (an estimate may be pessimistic)
    assert _tune.fitting(["big"], ["huge_fb", "small"], est, 10) == ([], ["small"])
    assert _tune.fitting(["small"], ["small"], est, 250) == (["small"], [])


@pytest.mark.parametrize("tuning", ["0", "1"])
def test_oversized_candidates_are_never_launched_and_fallbacks_take_over(monkeypatch, tuning):
    monkeypatch.setenv("GEM_TEST_AUTOTUNE", tuning)
    monkeypatch.setattr(_tune, "shared_memory_limit", lambda device: 1000)
    t = ConfigTuner("test", "GEM_TEST_AUTOTUNE")
    monkeypatch.setattr(t, "bench", lambda fn: (fn(), 1.0)[1])
    size = {(128, 3): 5000, (64, 2): 900, (32, 1): 400, (16, 1): 100}
    launch, launched = _launcher()
    cfg = t.pick("fwd", ("k1",), [(128, 3), (64, 2)], launch, CPU, estimate=size.__getitem__,
                 fallback=[(32, 1), (16, 1)])
    assert cfg == (64, 2) and (128, 3) not in launched and (32, 1) not in launched
    # no candidate fits: the first fitting fallback, untimed
    launch, launched = _launcher()
    cfg = t.pick("fwd", ("k2",), [(128, 3)], launch, CPU, estimate=size.__getitem__, fallback=[(32, 1), (16, 1)])
    assert cfg == (32, 1) and launched == [(32, 1)]


@pytest.mark.parametrize("tuning", ["0", "1"])
def test_when_no_candidate_launches_the_fallbacks_are_tried_in_order(monkeypatch, tuning):
    """An estimate that was too optimistic: every candidate fails at launch (out of resources)."""
    monkeypatch.setenv("GEM_TEST_AUTOTUNE", tuning)
    t = ConfigTuner("test", "GEM_TEST_AUTOTUNE")
    monkeypatch.setattr(t, "bench", lambda fn: (fn(), 1.0)[1])
    launch, launched = _launcher(bad=("a", "b", "fb1"))
    assert t.pick("k", (1,), ["a", "b"], launch, CPU, fallback=["fb1", "fb2", "fb3"]) == "fb2"
    assert launched[-1] == "fb2" and "fb3" not in launched
    assert t.pick("k", (1,), ["a", "b"], launch, CPU, fallback=["fb1", "fb2"]) == "fb2"  # kept for the key
    launch, _ = _launcher(bad=("a", "fb1"))
    with pytest.raises(RuntimeError, match="out of resource for fb1"):
        t.pick("k", (2,), ["a"], launch, CPU, fallback=["fb1"])


def test_gdpa_fp32_wide_short_kv_takes_the_tiled_path():
    """gdpa in fp32 at head dim 64 with ~256 keys: the whole-K/V tile (128 q rows, 256 keys) needs more shared
    memory than an H100 / H200 has in every candidate, so the forward takes the tiled path; bf16 keeps it."""
    from gem.ops import triton_gdpa as tg

    limit = _tune.SMEM_LIMIT
    kw = {"BLOCK_M": 128, "BLOCK_N": 256, "BLOCK_D": 64}
    gpu_short = [_tune.LaunchConfig.of(w, s) for w, s in ((4, 1), (4, 2), (8, 1), (8, 2))]
    assert all(tg._smem("fwd_short", kw, 4)(c) > limit for c in gpu_short)
    assert not tg._fits("fwd_short", kw, 4, CPU)
    assert tg._fits("fwd_short", kw, 2, CPU)
    # the tiled forward at 128-row q tiles: the fallback tiles fit in fp32
    tiled = {"BLOCK_M": 128, "BLOCK_D": 64}
    assert any(tg._smem("fwd_long", tiled, 4)(c) <= limit for c in tg.FALLBACK["fwd_long"])


@pytest.mark.parametrize("elt", [2, 4])
@pytest.mark.parametrize("d", [16, 32, 64, 128, 256])
def test_every_pass_of_every_op_has_a_config_within_the_limit(d, elt):
    """At every tile width and element size, each kernel kind has some config (candidate or fallback) whose
    estimate fits an H100 / H200, so the tuner always has something to launch."""
    from gem.ops import triton_block as tb
    from gem.ops import triton_gdpa as tg
    from gem.ops import triton_jfa as tj

    limit = _tune.SMEM_LIMIT
    for p in ("fwd", "dkdv", "dq"):
        assert min(map(tj._smem(p, d, elt), tj._FALLBACK)) <= limit, ("jfa", p)
        assert min(map(tb._smem(p, d, elt), tb.FALLBACK)) <= limit, ("block", p)
    # the tile sizes the GPU work tables fix (triton_gdpa._blocks, _fwd_block_m, _dq_block_m)
    rows = 128 if d <= 64 else 64
    fixed = {"fwd_long" if rows == 128 else "fwd_long_small": {"BLOCK_M": rows}, "bwd_dkdv": {"BLOCK_N": rows},
             "bwd_dq" if rows == 128 else "bwd_dq_small": {"BLOCK_M": rows}}
    for kind, kw in fixed.items():
        est = tg._smem(kind, {**kw, "BLOCK_D": d}, elt)
        assert min(map(est, tg.FALLBACK[kind])) <= limit, ("gdpa", kind)


@pytest.mark.parametrize("d", [16, 32, 64, 128, 256])
def test_no_16_bit_jfa_candidate_is_dropped(d, monkeypatch):
    """The estimate stays below what Triton allocates: every bf16 / fp16 tile JFA lists for the GPU (all of which
    launch there) is kept, so 16-bit picks are the same as without it."""
    from gem.ops import triton_jfa as tj

    monkeypatch.setenv("TRITON_INTERPRET", "0")  # the GPU's lists (nothing is launched)
    limit = _tune.SMEM_LIMIT
    assert all(tj._smem("fwd", d, 2)(c) <= limit for c in tj._fwd_configs(d))
    for form in ("delta_pre", "fused_delta"):
        for p in ("dkdv", "dq"):
            assert all(tj._smem(p, d, 2)(c) <= limit for c in tj._pass_configs(d, form, p)), (form, p)
