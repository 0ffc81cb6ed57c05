"""The KuaiRand and Taobao converters' request form (--form requests): one row per request, a user's events of one
session (pauses of at most --request-gap), cut into near-equal requests of at most --max-candidates; candidates and
labels as aligned lists; the history is the user's events before the request's first event (none of its own, none
later); the files read with the request presets, and train in both request forms."""

from __future__ import annotations

import io
import itertools
import math
import subprocess
import sys
from contextlib import redirect_stderr, redirect_stdout
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest
from omegaconf import OmegaConf

from gem.data.datasets import convert
from gem.data.datasets._events import split_requests
from gem.data.parquet import ParquetDataset
from gem.data.schema import Schema
from gem.data.validate import validate_batch
from tests.data.datasets.test_converters import KUAI_HEADER, _kuai_row, _read, _write

ROOT = Path(__file__).resolve().parents[3]
BEHAVIORS = {"pv": 0, "cart": 1, "fav": 2, "buy": 3}


def _requests(out: Path, split: str) -> list[dict]:
    rows = _read(out, split)
    return [dict(zip(rows, v)) for v in zip(*rows.values())]


@pytest.mark.parametrize("n, k, sizes", [(1, 4, [1]), (4, 4, [4]), (5, 4, [3, 2]), (8, 4, [4, 4]), (9, 4, [3, 3, 3]),
                                         (5, 2, [2, 2, 1]), (7, 3, [3, 2, 2])])
def test_a_long_session_is_cut_into_near_equal_requests(n, k, sizes):
    user = np.zeros(n, dtype=np.int64)
    first, count = split_requests(user, np.zeros(n), gap_s=10.0, max_candidates=k)
    assert count.tolist() == sizes
    assert first.tolist() == np.r_[0, np.cumsum(sizes)[:-1]].tolist()


def test_sessions_end_at_a_pause_longer_than_the_gap_and_at_each_user():
    user = np.array([0, 0, 0, 0, 1, 1, 2])
    time_s = np.array([0.0, 10.0, 20.0, 31.0, 31.0, 41.0, 0.0])
    first, count = split_requests(user, time_s, gap_s=10.0, max_candidates=8)
    assert first.tolist() == [0, 3, 4, 6] and count.tolist() == [3, 1, 2, 1]  # 10 s apart: one request; 11 s: two


def _kuairand_raw(raw: Path) -> Path:
    """User 0: session A (3 exposures a minute apart), then an hour later session B of 5 exposures, one of them
    a random exposure in the other file; user 1: one session of 2 exposures."""
    # user, video, time_ms, click, like, long_view, duration_ms, is_rand, tab
    standard = [(0, 100, 0, 1, 0, 0, 5000, 0, 1), (0, 101, 60_000, 0, 0, 0, 20000, 0, 1),
                (0, 102, 120_000, 1, 1, 1, 60000, 0, 2), (0, 103, 4_000_000, 0, 0, 0, 1000, 0, 1),
                (0, 104, 4_010_000, 1, 0, 1, 1000, 0, 1), (0, 105, 4_020_000, 1, 0, 0, 0, 0, 3),
                (0, 107, 4_030_000, 0, 0, 0, 9_000_000, 0, 1), (1, 100, 500, 1, 0, 0, 5000, 0, 2),
                (1, 200, 1_000, 0, 0, 0, 7000, 0, 2)]
    random = [(0, 106, 4_015_000, 1, 1, 0, 3000, 1, 4)]
    _write(raw / "log_standard_4_08_to_4_21_pure.csv", KUAI_HEADER + "\n" + "".join(_kuai_row(*r) for r in standard))
    _write(raw / "log_random_4_22_to_5_08_pure.csv", KUAI_HEADER + "\n" + "".join(_kuai_row(*r) for r in random))
    return raw


def test_kuairand_requests(tmp_path):
    done = convert("kuairand", _kuairand_raw(tmp_path / "raw"), tmp_path / "out", form="requests", max_candidates=2,
                   max_len=4)
    # user 0: session A (3) cut into 2 + 1, session B (5) into 2 + 2 + 1, the last held out; user 1: one request
    assert (done.form, done.train_rows, done.eval_rows) == ("requests", 5, 1)
    assert (done.train_candidates, done.eval_candidates) == (9, 1)
    features = done.schema["features"]
    assert done.schema["max_candidates"] == 2
    assert [n for n, f in features.items() if f["kind"] == "candidate"] == ["video_id", "tab", "duration_bucket",
                                                                            "is_rand"]
    assert [n for n, f in features.items() if f["kind"] == "dense"] == ["user_events", "hours_since_last"]
    assert features["user_id"]["kind"] == "sparse"
    # ids in order of first appearance, files in name order (log_random_* first)
    vid = {v: i for i, v in enumerate([106, 100, 101, 102, 103, 104, 105, 107, 200])}
    tab = {4: 0, 1: 1, 2: 2, 3: 3}
    train = {(r["user_id"], tuple(r["video_id"])): r for r in _requests(tmp_path / "out", "train")}
    v = lambda *raw: tuple(vid[x] for x in raw)
    assert set(train) == {(0, v(100, 101)), (0, v(102)), (0, v(103, 104)), (0, v(106, 105)), (1, v(100, 200))}
    # the history: the user's events before the request's first one, the newest max_len, oldest first
    assert train[0, v(100, 101)]["video_ids"] == [] and train[1, v(100, 200)]["video_ids"] == []
    assert train[0, v(102)]["video_ids"] == list(v(100, 101)) and train[0, v(102)]["actions"] == [1, 0]
    assert train[0, v(103, 104)]["video_ids"] == list(v(100, 101, 102))
    r = train[0, v(106, 105)]  # the random exposure (other file) sits between 104 and 105 in time
    assert r["video_ids"] == list(v(101, 102, 103, 104)) and r["actions"] == [0, 3, 0, 2]
    # per candidate, aligned with video_id: labels, tab, duration bucket, random exposure
    assert (r["click"], r["like"], r["long_view"]) == ([1.0, 1.0], [1.0, 0.0], [0.0, 0.0])
    assert (r["tab"], r["duration_bucket"], r["is_rand"]) == ([tab[4], tab[3]], [2, 0], [1, 0])  # 3 s, 0 s
    # the request's own features: taken at its first event
    assert r["user_events"] == pytest.approx(math.log1p(5)) and r["hours_since_last"] == pytest.approx(
        math.log1p(5 / 3600))
    assert train[0, v(103, 104)]["hours_since_last"] == pytest.approx(math.log1p(3880 / 3600))
    assert train[0, v(100, 101)]["click"] == [1.0, 0.0] and train[0, v(100, 101)]["duration_bucket"] == [3, 6]
    (ev,) = _requests(tmp_path / "out", "eval")
    assert (ev["user_id"], ev["video_id"], ev["video_ids"]) == (0, [vid[107]], list(v(103, 104, 106, 105)))
    assert ev["duration_bucket"] == [15] and ev["user_events"] == pytest.approx(math.log1p(7))  # 9000 s: the last


def _taobao_log(rng: np.random.Generator, users: int = 7, events: int = 400) -> list[tuple]:
    """Events in UserBehavior.csv's form, sessions of bursts: gaps of 0 s (ties), seconds or hours."""
    out = []
    for u in range(users):
        t = int(rng.integers(1_511_000_000, 1_512_000_000))
        for _ in range(int(rng.integers(1, 2 * events // users))):
            t += int(rng.choice([0, 1, 5, 60, 599, 600, 601, 7200]))
            item = int(rng.integers(1, 40))
            out.append((1000 + u, 500 + item, 90 + item % 5, str(rng.choice(list(BEHAVIORS))), t))
    order = rng.permutation(len(out))  # file order is not time order
    return [out[i] for i in order]


def _reference_requests(log: list[tuple], gap: int, k: int, max_len: int) -> tuple[list[dict], list[int]]:
    """The request form written out by hand: per user, events by (time, line); a new session after a pause > gap;
    a session of n events cut into ceil(n / k) consecutive requests, the first n % pieces one larger. Returns the
    requests and the sessions' lengths."""
    ids = {}
    for name, col in (("user", 0), ("item", 1), ("cat", 2)):
        ids[name] = {}
        for e in log:
            ids[name].setdefault(e[col], len(ids[name]))
    by_user: dict[int, list] = {}
    for line, e in enumerate(log):
        by_user.setdefault(e[0], []).append((e[4], line, e))
    requests, lengths = [], []
    for u, evs in by_user.items():
        evs = [e for _, _, e in sorted(evs)]
        sessions, cur = [], [evs[0]]
        for prev, e in itertools.pairwise(evs):
            if e[4] - prev[4] > gap:
                sessions.append(cur)
                cur = []
            cur.append(e)
        sessions.append(cur)
        lengths += [len(s) for s in sessions]
        done = 0
        mine = []
        for s in sessions:
            pieces = -(-len(s) // k)
            sizes = [len(s) // pieces + (j < len(s) % pieces) for j in range(pieces)]
            for n in sizes:
                cands, hist = evs[done: done + n], evs[max(done - max_len, 0): done]
                mine.append({
                    "user_id": ids["user"][u], "user_events": math.log1p(done),
                    "item_id": [ids["item"][e[1]] for e in cands], "category_id": [ids["cat"][e[2]] for e in cands],
                    "engage": [float(e[3] != "pv") for e in cands], "buy": [float(e[3] == "buy") for e in cands],
                    "item_ids": [ids["item"][e[1]] for e in hist], "behaviors": [BEHAVIORS[e[3]] for e in hist],
                    "category_ids": [ids["cat"][e[2]] for e in hist], "eval": False})
                done += n
        if len(mine) > 1:
            mine[-1]["eval"] = True
        requests += mine
    return requests, lengths


def _key(r: dict) -> tuple:
    return (r["user_id"], round(r["user_events"], 5), *(tuple(r[c]) for c in (
        "item_id", "category_id", "engage", "buy", "item_ids", "behaviors", "category_ids")))


@pytest.mark.parametrize("seed, gap, k, max_len", [(0, 600, 4, 5), (1, 0, 3, 64), (2, 10**9, 7, 3)])
def test_taobao_requests_match_the_reference(tmp_path, seed, gap, k, max_len):
    """Every event is a candidate of exactly one request; requests, their histories (no event of the request or
    after it), labels and the held-out last request of each user are the reference's."""
    log = _taobao_log(np.random.default_rng(seed))
    raw = tmp_path / "raw"
    _write(raw / "UserBehavior.csv", "".join(",".join(map(str, e)) + "\n" for e in log))
    done = convert("taobao", raw, tmp_path / "out", form="requests", max_candidates=k, request_gap_s=gap,
                   max_len=max_len, seed=seed)
    ref, sessions = _reference_requests(log, gap, k, max_len)
    got = {split: sorted(map(_key, _requests(tmp_path / "out", split))) for split in ("train", "eval")}
    assert got["train"] == sorted(_key(r) for r in ref if not r["eval"])
    assert got["eval"] == sorted(_key(r) for r in ref if r["eval"])
    assert done.train_candidates + done.eval_candidates == len(log)
    # the fixture exercises what the case is about: sessions cut at k, or (gap 0) only events at one time together
    assert max(sessions) > (1 if gap == 0 else k) and max(len(r["item_id"]) for r in ref) <= k


def _taobao_raw(raw: Path) -> Path:
    _write(raw / "UserBehavior.csv", "1,10,7,pv,1\n1,11,8,buy,2\n1,12,8,pv,5000\n1,13,8,cart,5001\n2,10,7,cart,3\n"
           "2,12,7,fav,4\n2,12,7,pv,9000\n")
    return raw


@pytest.mark.parametrize("name, make", [("kuairand", _kuairand_raw), ("taobao", _taobao_raw)])
def test_request_files_fit_the_request_preset(tmp_path, name, make):
    """The written schema.yaml and the dataset's request preset (configs/data/<name>_requests.yaml) read the files
    as request batches that pass the batch checks; both declare the same inputs."""
    done = convert(name, make(tmp_path / "raw"), tmp_path / "out", form="requests")
    files = str(tmp_path / "out" / "train" / "*.parquet")
    written = OmegaConf.load(tmp_path / "out" / "schema.yaml")
    preset = OmegaConf.load(ROOT / "configs" / "data" / f"{name}_requests.yaml")
    assert written.max_candidates == preset.max_candidates == 32
    for cfg in (written, preset):
        schema = Schema.from_dict(cfg)
        batch = ParquetDataset(schema, files, batch_size=2, max_candidates=cfg.max_candidates).batch(0)
        validate_batch(batch, schema)
        assert batch.cand_offsets is not None and batch.num_requests == 2
    assert list(preset.features) == list(done.schema["features"])
    assert {n: f.kind for n, f in preset.features.items()} == {n: f["kind"] for n, f in done.schema["features"].items()}
    assert list(preset.labels) == list(done.schema["labels"])


@pytest.mark.parametrize("name, make, form", [("kuairand", _kuairand_raw, "interaction"),
                                              ("taobao", _taobao_raw, "targets")])
def test_request_preset_trains_on_converted_files(tmp_path, name, make, form):
    """The documented path: convert into data/<name>_requests/ and train with the request preset from there, in
    each request form (one request per batch: the fixtures hold few)."""
    from tests.train._util import env

    convert(name, make(tmp_path / "raw"), tmp_path / "data" / f"{name}_requests", form="requests")
    cmd = [sys.executable, "-m", "gem.train", f"experiment={name}_requests", f"model.candidates={form}",
           "data.batch_size=1", "data.eval_batches=1", "train.steps=2", "train.warmup_steps=1", "train.log_every=1",
           "model.kernel=reference", "train.tensorboard=false", f"hydra.run.dir={tmp_path / 'run'}"]
    p = subprocess.run(cmd, cwd=tmp_path, env=env(tmp_path), capture_output=True, text=True, timeout=240, check=False)
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-2000:]
    assert "gem-train summary: steps 2" in p.stdout


def _main(args: list[str]) -> tuple[int, str, str]:
    from gem.data.datasets.__main__ import main

    out, err = io.StringIO(), io.StringIO()
    with redirect_stdout(out), redirect_stderr(err):
        code = main(args)
    return code, out.getvalue(), err.getvalue()


def test_cli_request_form(tmp_path):
    raw = _kuairand_raw(tmp_path / "raw")
    code, out, err = _main(["kuairand", "--raw", str(raw), "--out", str(tmp_path / "o"), "--form", "requests",
                            "--max-candidates", "2", "--max-len", "4"])
    assert code == 0, err
    lines = out.splitlines()
    assert lines[0] == f"kuairand: 5 train and 1 eval requests (9 and 1 candidates) in {tmp_path / 'o'}"
    assert lines[2] == (f"train: gem-train experiment=kuairand_requests data.paths='[{tmp_path / 'o'}/train/*.parquet]' "
                        f"data.eval_paths='[{tmp_path / 'o'}/eval/*.parquet]' data.histories.events.max_len=4 "
                        "data.max_candidates=2")
    assert pq.read_table(tmp_path / "o" / "eval" / "part-00000.parquet").num_rows == 1
    for args, problem in [
        (["--form", "requests", "--max-candidates", "1"],
         "--max-candidates must be >= 2 (one candidate per row is --form rows) (got 1)"),
        (["--max-candidates", "4"], "--max-candidates applies to --form requests (got 4 with --form rows)"),
        (["--request-gap", "60"], "--request-gap applies to --form requests (got 60.0 with --form rows)"),
        (["--form", "requests", "--request-gap", "-1"], "--request-gap must be >= 0 seconds (got -1.0)"),
    ]:
        code, out, err = _main(["kuairand", "--raw", str(raw), "--out", str(tmp_path / "p"), *args])
        assert (code, err) == (2, f"gem.data.datasets: error: {problem}\n")
        assert not (tmp_path / "p").exists()
    code, _, err = _main(["movielens-1m", "--raw", str(raw), "--out", str(tmp_path / "p"), "--form", "requests"])
    assert code == 2
    assert err == ("gem.data.datasets: error: --form requests: movielens-1m has no sessions to group into requests "
                   "(datasets with sessions: kuairand, taobao)\n")
