"""MFU accounting: exposed communication from kernel intervals (against a brute-force sweep), the name
classification, the MFU report's relations, and the trainer's report on 1 rank and on 2 ranks (gloo)."""

from __future__ import annotations

import random
import subprocess

import pytest

from gem.train.mfu import comm_times, is_comm, mfu_report
from tests.train._util import SMALL, compose, env, read_jsonl, train_cmd


def _sweep(intervals, grid: int) -> tuple[int, int, int]:
    """Busy / comm / exposed time of integer intervals, one unit cell at a time."""
    busy = comm = exposed = 0
    for t in range(grid):
        kinds = {k for s, e, k in intervals if s <= t < e}
        busy += bool(kinds)
        comm += "comm" in kinds
        exposed += kinds == {"comm"}
    return busy, comm, exposed


@pytest.mark.parametrize("intervals,want", [
    ([], (0, 0, 0)),
    ([(0, 4, "compute"), (6, 9, "comm")], (7, 3, 3)),  # no overlap
    ([(0, 10, "compute"), (2, 8, "comm")], (10, 6, 0)),  # comm fully hidden
    ([(0, 5, "compute"), (3, 9, "comm")], (9, 6, 4)),  # partial
    ([(0, 10, "comm"), (2, 3, "compute"), (5, 7, "compute")], (10, 10, 7)),  # compute nested in comm
    ([(0, 6, "comm"), (1, 2, "comm"), (4, 9, "comm")], (9, 9, 9)),  # comm on several streams, overlapping
    ([(0, 3, "compute"), (2, 5, "compute"), (1, 4, "comm"), (4, 6, "comm"), (8, 9, "compute")], (7, 5, 1)),
    ([(3, 3, "comm"), (1, 2, "compute")], (1, 0, 0)),  # empty interval
])
def test_comm_times_by_hand(intervals, want):
    t = comm_times(intervals)
    assert (t.busy, t.comm, t.exposed) == want
    assert want == _sweep(intervals, 12)


def test_comm_times_matches_a_sweep_on_random_intervals():
    rng = random.Random(0)
    for _ in range(300):
        grid = rng.randint(1, 40)
        ivs = []
        for _ in range(rng.randint(0, 12)):
            s = rng.randint(0, grid - 1)
            ivs.append((s, rng.randint(s, grid), rng.choice(["comm", "compute", "compute"])))
        t = comm_times(ivs)
        assert (t.busy, t.comm, t.exposed) == _sweep(ivs, grid), ivs
        assert 0 <= t.exposed <= t.comm <= t.busy


@pytest.mark.parametrize("name,comm", [
    ("ncclDevKernel_AllReduce_Sum_bf16_RING_LL(ncclDevKernelArgsStorage<4096ul>)", True),
    ("ncclKernel_AllGather_RING_LL_Sum_int8_t", True),
    ("gloo:all_reduce", True),
    ("c10d::allreduce_", True),
    ("c10d::_reduce_scatter_base_", True),
    ("record_param_comms", True),
    ("_functional_collectives::all_to_all_single", True),
    ("sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x128x64", False),
    ("void at::native::vectorized_elementwise_kernel<4, at::native::FillFunctor<float>>", False),
    ("aten::mm", False),
    ("Memcpy HtoD (Pinned -> Device)", False),
])
def test_comm_names(name, comm):
    assert is_comm(name) is comm


def test_mfu_report_relations():
    r = mfu_report(2e12, 0.1, peak_flops=100e12, exposed_comm_fraction=0.2, comm_fraction=0.5)
    assert r.mfu_e2e == pytest.approx(0.2)
    assert r.mfu_local == pytest.approx(2e12 / (0.1 - 0.02) / 100e12)  # FLOPs / (step - exposed) / peak
    assert r.scaling_ratio == pytest.approx(0.8)
    assert r.mfu_e2e == pytest.approx(r.mfu_local * r.scaling_ratio)
    s = r.scalars()
    assert s["time/exposed_comm_ms"] == pytest.approx(20.0) and s["time/comm_ms"] == pytest.approx(50.0)
    one = mfu_report(2e12, 0.1, peak_flops=100e12, exposed_comm_fraction=0.0).scalars()
    assert one["perf/scaling_ratio"] == 1.0 and one["perf/mfu_local"] == one["perf/mfu_e2e"]
    unmeasured = mfu_report(2e12, 0.1, peak_flops=100e12).scalars()  # no probe yet: E2E only
    assert "perf/mfu_e2e" in unmeasured and "perf/mfu_local" not in unmeasured
    assert "perf/scaling_ratio" not in unmeasured


_KEYS = ("perf/mfu_e2e", "perf/mfu_local", "perf/scaling_ratio", "time/exposed_comm_ms")


def test_one_rank_reports_scaling_one_and_no_exposed_comm(tmp_path):
    from gem.train.trainer import Trainer

    t = Trainer(compose(SMALL + ["train.steps=3", "train.eval_every=0", "train.mfu.peak_flops=1e11"]),
                run_dir=str(tmp_path))
    try:
        t.fit()
    finally:
        t.close()
    recs = [r for r in read_jsonl(tmp_path / "metrics.jsonl") if "train/loss" in r]
    assert [r["step"] for r in recs] == [1, 2, 3]
    for r in recs:
        assert all(k in r for k in _KEYS), r
        assert r["perf/scaling_ratio"] == 1.0 and r["time/exposed_comm_ms"] == 0.0
        assert r["perf/mfu_local"] == r["perf/mfu_e2e"] > 0
        assert r["perf/mfu_e2e"] == pytest.approx(r["perf/tflops_per_device"] * 1e12 / 1e11)  # train.mfu.peak_flops


def test_two_ranks_report_local_e2e_and_scaling(tmp_path):
    """torchrun, 2 ranks on gloo, dense DDP: the probe profiles steps 3 and 4 (after the LR warmup's log window), so
    windows from step 4 on carry all three MFU figures: E2E = local x scaling with scaling in (0, 1], and the exposed
    host time of gloo's all-reduce is positive and shorter than the step."""
    args = [*SMALL, "train.steps=6", "train.eval_every=0", "train.mfu.peak_flops=1e11", "hydra.run.dir=run"]
    p = subprocess.run(train_cmd(2) + args, cwd=tmp_path, env=env(tmp_path), capture_output=True, text=True,
                       timeout=240, check=False)
    assert p.returncode == 0, p.stderr[-3000:]
    recs = {r["step"]: r for r in read_jsonl(tmp_path / "run" / "metrics.jsonl") if "train/loss" in r}
    assert sorted(recs) == [1, 2, 3, 4, 5, 6]
    for step in (1, 2, 3):  # before the probe: E2E only
        assert "perf/mfu_e2e" in recs[step] and "perf/mfu_local" not in recs[step]
    for step in (4, 5, 6):
        r = recs[step]
        assert all(k in r for k in _KEYS), r
        assert 0 < r["perf/scaling_ratio"] <= 1
        assert r["perf/mfu_local"] >= r["perf/mfu_e2e"] > 0
        assert r["perf/mfu_e2e"] == pytest.approx(r["perf/mfu_local"] * r["perf/scaling_ratio"])
        step_ms = 1e3 * r["perf/step_time_s"]
        assert 0 < r["time/exposed_comm_ms"] <= r["time/comm_ms"] < step_ms
        assert r["perf/scaling_ratio"] == pytest.approx(1 - r["time/exposed_comm_ms"] / step_ms)
    assert "exposed comm" in p.stdout + p.stderr


class _FakeProbe:
    def __init__(self) -> None:
        self.running, self.overhead_s = False, 0.0

    def start(self) -> bool:
        self.running = True
        return True

    def stop(self) -> tuple[float, float]:
        self.running = False
        return 0.25, 0.5


def test_the_probe_runs_after_the_warmup_window_then_every_n_windows_and_not_across_an_evaluation():
    import torch

    from gem.train.config import TrainConfig
    from gem.train.metrics_log import TrainLogger
    from gem.train.reporting import MetricsReporter

    tc = TrainConfig(steps=60, warmup_steps=8, log_every=5, eval_every=11)
    tc.mfu.comm_probe_every, tc.mfu.comm_probe_steps = 3, 2
    rep = MetricsReporter(TrainLogger(None, enabled=False, tensorboard=False), None, tc, run_dir=None, rank=0,
                          world_size=2, device=torch.device("cpu"), tasks=["click"], global_batch=1)
    assert rep.exposed_comm_fraction is None  # nothing measured yet on 2 ranks
    rep.probe = probe = _FakeProbe()
    probed = []
    for step in range(1, 61):
        rep.step_begin(step)
        if probe.running:
            probed.append(step)
        rep.step_done(torch.zeros(()), 1.0)
        if step % tc.log_every == 0:
            rep._schedule_probe(step)  # what log_window does last
    # windows end at 5, 10, ...: the first past the warmup is 10, then every 3rd (25, 40, 55). Steps 11, 12 would
    # span the evaluation after step 11, so that probe waits a step; an evaluation after the last probed step is fine.
    assert probed == [12, 13, 26, 27, 41, 42, 56, 57]
    assert not probe.running and rep.exposed_comm_fraction == 0.25 and rep.comm_fraction == 0.5


def test_bench_compare_rows_and_an_older_result(tmp_path):
    """bench_compare shows the MFU figures and the breakdown; a result written before local MFU had its scaling
    against a 1-GPU run under `scaling_ratio`: that lands in the 1-GPU row, not beside the new ratio."""
    import json

    from gem.bench.compare import _load, compare

    new = {"aggregate": {"step_ms": 100.0, "mfu_e2e": 0.3, "mfu_local": 0.4, "scaling_ratio": 0.75,
                         "exposed_comm_ms": 25.0, "phase_ms": {"input": 1.0, "backward": 60.0}}}
    old = {"aggregate": {"step_ms": 120.0, "mfu_vendor": 0.25, "scaling_ratio": 0.9}}
    rows = {}
    for name, d in (("old.json", old), ("new.json", new)):
        (tmp_path / name).write_text(json.dumps(d))
    for line in compare(_load(str(tmp_path / "old.json")), _load(str(tmp_path / "new.json"))):
        cells = [c.strip() for c in line.strip("|").split("|")]
        rows[cells[0]] = cells[1:]
    assert rows["E2E MFU vs vendor peak"][:2] == ["25.0%", "30.0%"]
    assert rows["scaling ratio (E2E / local)"][:2] == ["n/a", "0.750"]
    assert rows["TFLOP/s per device vs 1 GPU"][:2] == ["0.900", "n/a"]
    assert rows["backward ms"][:2] == ["n/a", "60.00"] and rows["exposed comm ms"][:2] == ["n/a", "25.00"]


def test_the_probe_stands_aside_while_another_profiler_runs():
    import torch

    from gem.train.mfu import CommProbe

    probe = CommProbe(torch.device("cpu"))
    with torch.profiler.profile():
        assert probe.start() is False and not probe.running
    assert probe.start() is True and probe.running
    torch.ones(8) @ torch.ones(8)
    exposed, comm = probe.stop()
    assert (exposed, comm) == (0.0, 0.0) and not probe.running  # no collective ran


@pytest.mark.parametrize("key,value", [("comm_probe_steps", 0), ("comm_probe_every", -1), ("peak_flops", 0)])
def test_bad_mfu_settings_name_the_key(key, value):
    from gem.train.config import TrainConfig, TrainConfigError

    with pytest.raises(TrainConfigError, match=f"train.mfu.{key}: .*got {value}"):
        TrainConfig.from_dict({"mfu": {key: value}})
