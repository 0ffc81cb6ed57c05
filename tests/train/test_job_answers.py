"""The answers a long job relies on, checked against values worked out independently: which checkpoints retention
keeps, which one a resume picks, who holds a run dir, how run ids sort, which eval rows count, the step every rank
stops at, and the final checkpoint of a run."""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import time

import pytest
import torch
import torch.distributed as dist

from gem.train.checkpoint import Checkpointer, latest_checkpoint, list_checkpoints
from tests.train._util import SMALL, compose


def _state(step: int) -> dict:
    return {"model": {"w": torch.full((2,), float(step))}}


def _steps(ckpt_dir) -> list[int]:
    return [s for s, _ in list_checkpoints(ckpt_dir)]


# ---- retention and the checkpoint to resume from -----------------------------------------------------------------


def test_retention_and_the_newest_go_by_step_number_past_step_9(tmp_path):
    """step_10 is newer than step_9 although its name sorts before it."""
    c = Checkpointer(tmp_path, keep=2)
    for step in (8, 9, 10, 11):
        c.save(step, _state(step))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step_10", "step_11"]
    assert _steps(tmp_path) == [10, 11]
    step, path = latest_checkpoint(tmp_path)
    assert (step, path.name) == (11, "step_11")
    into = _state(0)
    c.load(path, into)
    assert torch.equal(into["model"]["w"], torch.full((2,), 11.0))


def test_keep_counts_the_newest_checkpoints_whether_pinned_or_not(tmp_path):
    """`keep` newest checkpoints, plus those of `keep_steps` (a pinned step among the newest is one of the `keep`)."""
    keep, pinned = 2, {4}
    c = Checkpointer(tmp_path, keep=keep, keep_steps=sorted(pinned))
    saved = []
    for step in range(1, 8):
        c.save(step, _state(step))
        saved.append(step)
        want = sorted(set(saved[-keep:]) | (pinned & set(saved)))
        assert _steps(tmp_path) == want, step
    assert _steps(tmp_path) == [4, 6, 7]


def test_resume_takes_the_newest_intact_checkpoint(tmp_path):
    """Of step_1..step_4 with step_4 cut short, the resume picks step_3 (not an older intact one)."""
    from gem.train.checkpoint import TrainCheckpointer

    c = Checkpointer(tmp_path, keep=4)
    for step in (1, 2, 3, 4):
        c.save(step, _state(step))
    shard = min((tmp_path / "step_4").glob("*.distcp"))
    shard.write_bytes(shard.read_bytes()[:4])
    tc = TrainCheckpointer(c, None, None, rank=0, world_size=1, device=torch.device("cpu"), info=lambda m: None)
    step, skipped = tc._newest_intact()
    assert step == 3
    assert len(skipped) == 1 and skipped[0].startswith(f"resume: skipped step_4: {shard.name}: 4 bytes"), skipped


# ---- the run dir lock and run ids ---------------------------------------------------------------------------------


def _in_child(fn):
    """Run `fn` in a forked process that then dies without cleaning up (a lock it took goes with it); returns the
    child's pid and what `fn` returned, or the text of what it raised."""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child
        try:
            os.close(r)
            try:
                out = {"ok": fn()}
            except BaseException as e:  # noqa: BLE001
                out = {"error": f"{type(e).__name__}: {e}"}
            os.write(w, json.dumps(out).encode())
        finally:
            os._exit(0)
    os.close(w)
    data = b""
    while chunk := os.read(r, 1 << 16):
        data += chunk
    os.close(r)
    os.waitpid(pid, 0)
    return pid, json.loads(data)


def test_run_dir_lock_refuses_a_live_holder_and_takes_over_a_dead_ones(tmp_path):
    from gem.train.rundir import RunDirLock

    run = tmp_path / "run"
    held = RunDirLock(run, "first")
    assert held.acquire() is None  # a new run dir: no one held it
    try:
        _, got = _in_child(lambda: RunDirLock(run, "second").acquire())
    finally:
        held.release()
    assert "error" in got, got  # another process may not take a lock this one holds
    want = f"in use by the job on host {socket.gethostname()} pid {os.getpid()}"
    assert want in got["error"], got

    pid, got = _in_child(lambda: RunDirLock(run, "dies").acquire())  # dies holding it
    assert got == {"ok": None}, got  # released above: the record was cleared
    again = RunDirLock(run, "third")
    previous = again.acquire()
    try:
        assert previous is not None and previous["pid"] == pid and previous["run_id"] == "dies", previous
        assert json.loads((run / ".gem-lock").read_text())["run_id"] == "third"
    finally:
        again.release()


def test_run_ids_carry_the_start_time_to_the_millisecond_and_sort_by_it():
    from gem.train.rundir import new_run_id

    t0 = 1_700_000_000  # a whole second
    offsets = (0.0505, 0.2505, 0.5005, 0.9995)
    ids = [new_run_id(t0 + dt) for dt in offsets]
    second = time.strftime("%Y-%m-%d/%H-%M-%S", time.localtime(t0))
    for run_id, ms in zip(ids, (50, 250, 500, 999)):
        assert re.fullmatch(re.escape(f"{second}.{ms:03d}-") + "[0-9a-f]{4}", run_id), (run_id, ms)
    assert sorted(ids) == ids
    assert new_run_id(t0 + 1.0005) > ids[-1]


# ---- evaluation rows ----------------------------------------------------------------------------------------------


class _Batches:
    """Only the whole batches of a dataset (no last round)."""

    def __init__(self, ds) -> None:
        self.ds = ds

    def __iter__(self):
        return iter(self.ds)


def test_eval_counts_each_ranks_own_last_rows_and_no_padding(tmp_path):
    """101 rows, batches of 8, 4 ranks: 3 whole rounds of 4 x 8 rows (24 rows a rank), then the last 5 rows in shares
    of 2 in rank order: 2, 2, 1, 0. Ranks 2 and 3 pad their last batch to 2 rows; the padding adds nothing."""
    from gem.data import DataConfig, SyntheticDataset
    from gem.data.parquet import ParquetDataset, write_parquet
    from gem.train.trainer import Trainer

    data = DataConfig.from_dict(compose([*SMALL, "data=parquet"]).data)
    path = tmp_path / "eval.parquet"
    write_parquet(SyntheticDataset(data.schema, 0, 101), str(path), 1)
    t = Trainer(compose([*SMALL, "data=parquet", f"data.paths=[{path}]", f"data.eval_paths=[{path}]",
                         "data.batch_size=8", "train.steps=1", "train.eval_every=0"]))
    try:
        ev = t.evaluator
        got = []
        for rank in range(4):
            ev.dataset = ParquetDataset(t.schema, [str(path)], 8, rank, 4)
            assert ev.dataset.last_rows()[0].labels.shape[0] == 2  # every rank's last batch: one share
            got.append(ev())
        ev.dataset = _Batches(ParquetDataset(t.schema, [str(path)], 8, 3, 4))
        whole_only = ev()
    finally:
        t.close()
        if dist.is_initialized():
            dist.destroy_process_group()
    assert [m["num_samples"] for m in got] == [26, 26, 25, 24]
    assert got[3] == whole_only  # rank 3 has no rows of its own past the whole rounds: the same metrics, exactly


# ---- the stop vote ------------------------------------------------------------------------------------------------


class _TwoRanks:
    """`dist.all_reduce` for two StopVotes in one process, polled in turn: the vote of round k is reduced over both
    ranks' values when a rank waits on it."""

    def __init__(self) -> None:
        self.posted: dict[int, dict[str, int]] = {}
        self.rounds: dict[str, int] = {}

    def all_reduce(self, buf, op=None, group=None, async_op=False):
        k = self.rounds.get(group, 0)
        self.rounds[group] = k + 1
        self.posted.setdefault(k, {})[group] = int(buf.item())
        posted = self.posted

        class Work:
            def wait(self):
                vals = list(posted[k].values())
                assert len(vals) == 2, "a rank read a vote its peer has not joined"
                assert op == dist.ReduceOp.MAX
                buf.fill_(max(vals))

        return Work()


@pytest.mark.parametrize("signalled", [0, 1])
def test_a_signal_on_one_rank_stops_every_rank_after_the_same_step(monkeypatch, signalled):
    """A signal seen during step 3 on one rank: its vote starts after step 3 and is read after step 4, so both ranks
    stop after step 4, the signalled one included."""
    from gem.train import stop

    fake = _TwoRanks()
    monkeypatch.setattr(dist, "all_reduce", fake.all_reduce)
    signals = [stop.StopSignals(), stop.StopSignals()]
    votes = []
    for r in (0, 1):
        v = stop.StopVote(signals[r], world_size=1)
        v.world_size, v._group = 2, f"rank{r}"  # as a two-rank job's gloo group
        votes.append(v)
    stopped = {}
    for step in range(1, 7):
        if step == 3:
            signals[signalled].note(signal.SIGTERM)
        for r in (0, 1):
            name = votes[r].poll()
            if name is not None and r not in stopped:
                stopped[r] = (step, name)
    assert stopped == {0: (4, "SIGTERM"), 1: (4, "SIGTERM")}


# ---- the final checkpoint -----------------------------------------------------------------------------------------


def test_the_last_step_is_checkpointed_off_the_every_grid(tmp_path):
    """checkpoint.every=2 over 3 steps: step 2 on the grid, and step 3 because the run ends there."""
    from gem.train.trainer import Trainer

    t = Trainer(compose([*SMALL, "train.steps=3", "train.eval_every=0", "train.checkpoint.every=2",
                         "train.checkpoint.keep=3"]), run_dir=str(tmp_path))
    try:
        result = t.fit()
    finally:
        t.close()
        if dist.is_initialized():
            dist.destroy_process_group()
    assert _steps(tmp_path / "checkpoints") == [2, 3]
    assert result.last_checkpoint == str(tmp_path / "checkpoints" / "step_3")
