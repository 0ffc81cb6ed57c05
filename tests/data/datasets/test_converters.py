"""The public-dataset converters on small fixtures written in each dataset's raw format: histories oldest first,
labels and features as documented, the last event of each user held out, malformed rows named by file and line."""

from __future__ import annotations

import io
import math
import subprocess
import sys
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest
from omegaconf import OmegaConf

from gem.data.datasets import BadRows, RawError, convert
from gem.data.parquet import ParquetDataset
from gem.data.schema import Schema
from gem.data.validate import validate_batch

ROOT = Path(__file__).resolve().parents[3]

# user, movie, rating, timestamp (file order is not time order: the converter sorts by time)
ML_RATINGS = [(10, 1193, 5, 300), (10, 661, 3, 100), (10, 914, 4, 200), (20, 661, 1, 50), (20, 3408, 4, 60),
              (30, 914, 2, 10)]
ML_MOVIES = [(1193, "One Flew Over the Cuckoo's Nest (1975)", "Drama"),
             (661, "James and the Giant Peach (1996)", "Animation|Children's|Musical"),
             (914, "My Fair Lady (1964)", "Musical|Romance"), (3408, "Erin Brockovich (2000)", "Drama")]


def _write(path: Path, text: str, encoding: str = "utf-8") -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text, encoding=encoding)
    return path


def _ml_1m(raw: Path) -> Path:
    _write(raw / "ratings.dat", "".join(f"{u}::{m}::{r}::{t}\n" for u, m, r, t in ML_RATINGS))
    _write(raw / "movies.dat", "".join(f"{m}::{title}::{g}\n" for m, title, g in ML_MOVIES), "latin-1")
    return raw


def _ml_20m(raw: Path) -> Path:
    rows = [(u, m, r - 0.5 if u == 20 else float(r), t) for u, m, r, t in ML_RATINGS]  # half stars for user 20
    _write(raw / "ratings.csv", "userId,movieId,rating,timestamp\n" + "".join(f"{u},{m},{r},{t}\n" for u, m, r, t in rows))
    _write(raw / "movies.csv", "movieId,title,genres\n"
           + "".join(f'{m},"{title.replace(" (", ", The (")}",{g}\n' for m, title, g in ML_MOVIES))
    return raw


def _read(out: Path, split: str) -> dict[str, list]:
    tables = [pq.read_table(f) for f in sorted((out / split).glob("*.parquet"))]
    return {c: [v for t in tables for v in t.column(c).to_pylist()] for c in tables[0].column_names}


def _by_candidate(rows: dict[str, list], item: str) -> dict:
    """(candidate id, history length) -> row, for a dataset whose item is `item` (`<item>_id`, `<item>_ids`)."""
    return {(r[f"{item}_id"], len(r[f"{item}_ids"])): r for r in (dict(zip(rows, v)) for v in zip(*rows.values()))}


@pytest.mark.parametrize("variant", ["1m", "20m"])
def test_movielens(tmp_path, variant):
    raw = (_ml_1m if variant == "1m" else _ml_20m)(tmp_path / "raw")
    done = convert(f"movielens-{variant}", raw, tmp_path / "out", max_len=2, seed=3)
    assert (done.train_rows, done.eval_rows) == (4, 2)  # users 10 and 20 hold out their newest rating
    schema = done.schema
    assert schema["labels"] == {"like": "like", "love": "love"}
    assert {t: v["num_embeddings"] for t, v in schema["tables"].items()} == {"movie": 4, "ratings": 5, "user": 3,
                                                                             "genres": 5}
    assert schema["features"]["movie_id"] == {"kind": "candidate", "table": "movie"}  # shares the history's table
    ids = {m: i for i, m in enumerate(dict.fromkeys(m for _, m, _, _ in ML_RATINGS))}  # first appearance
    ev = _by_candidate(_read(tmp_path / "out", "eval"), "movie")
    # user 10, time order 661 (3) -> 914 (4) -> 1193 (5): the 5-star rating is held out, history oldest first
    r = ev[(ids[1193], 2)]
    assert r["movie_ids"] == [ids[661], ids[914]] and r["ratings"] == [2, 3]
    assert (r["like"], r["love"]) == (1.0, 1.0)
    assert r["user_events"] == pytest.approx(math.log1p(2))
    assert r["hours_since_last"] == pytest.approx(math.log1p(100 / 3600))
    assert len(r["genres"]) == 1  # Drama
    r = ev[(ids[3408], 1)]  # user 20: 661 then 3408
    assert r["movie_ids"] == [ids[661]]
    assert r["ratings"] == [0]  # 1 star (ML-20M: 0.5 stars, rounded up to 1)
    assert (r["like"], r["love"]) == ((1.0, 0.0) if variant == "1m" else (0.0, 0.0))  # 4 vs 3.5 stars
    tr = _by_candidate(_read(tmp_path / "out", "train"), "movie")
    assert set(tr) == {(ids[661], 0), (ids[914], 1), (ids[661], 0), (ids[914], 0)} and len(tr) == 3
    assert tr[(ids[914], 1)]["movie_ids"] == [ids[661]] and len(tr[(ids[914], 1)]["genres"]) == 2
    assert sorted([tr[(ids[914], 0)]["user_id"], tr[(ids[914], 1)]["user_id"]]) == [0, 2]


def test_history_keeps_the_newest_max_len_events(tmp_path):
    raw = tmp_path / "raw"
    _write(raw / "UserBehavior.csv", "".join(f"1,{100 + t},7,pv,{t}\n" for t in range(6)))
    convert("taobao", raw, tmp_path / "out", max_len=3)
    rows = _read(tmp_path / "out", "eval")
    assert rows["item_ids"] == [[2, 3, 4]] and rows["item_id"] == [5]
    assert rows["user_events"][0] == pytest.approx(math.log1p(5))
    train = _read(tmp_path / "out", "train")
    assert sorted(map(len, train["item_ids"])) == [0, 1, 2, 3, 3]


def test_taobao(tmp_path):
    raw = tmp_path / "raw"
    events = [(1, 2268318, 2520377, "pv", 1511544070), (1, 2333346, 2520771, "pv", 1511561733),
              (1, 2268318, 2520377, "buy", 1511572885), (2, 2576651, 149192, "fav", 1511590000),
              (2, 3830808, 4181361, "cart", 1511600000), (3, 4365585, 2520377, "pv", 1511500000)]
    _write(raw / "UserBehavior.csv", "".join(",".join(map(str, e)) + "\n" for e in events))
    done = convert("taobao", raw, tmp_path / "out")
    assert (done.train_rows, done.eval_rows) == (4, 2)
    ev = _by_candidate(_read(tmp_path / "out", "eval"), "item")
    r = ev[(0, 2)]  # user 1 buys the item it viewed first
    assert r["behaviors"] == [0, 0] and r["category_ids"] == [0, 1] and r["category_id"] == 0
    assert (r["engage"], r["buy"]) == (1.0, 1.0)
    r = ev[(3, 1)]  # user 2: fav then cart
    assert r["behaviors"] == [2] and (r["engage"], r["buy"]) == (1.0, 0.0)
    # the candidate's category and the history's categories share one table
    assert done.schema["tables"]["category"]["num_embeddings"] == 4
    assert done.schema["features"]["category_id"] == {"kind": "candidate", "table": "category"}


KUAI_HEADER = ("user_id,video_id,date,hourmin,time_ms,is_click,is_like,is_follow,is_comment,is_forward,is_hate,"
               "long_view,play_time_ms,duration_ms,profile_stay_time,comment_stay_time,is_profile_enter,is_rand,tab")


def _kuai_row(user, video, t, click, like, long_view, duration, rand, tab):
    return f"{user},{video},20220408,1000,{t},{click},{like},0,0,0,0,{long_view},0,{duration},0,0,0,{rand},{tab}\n"


def test_kuairand(tmp_path):
    raw = tmp_path / "raw"
    _write(raw / "log_standard_4_08_to_4_21_pure.csv", KUAI_HEADER + "\n" + _kuai_row(0, 5, 3000, 1, 0, 1, 9000, 0, 1)
           + _kuai_row(0, 6, 1000, 0, 0, 0, 15000, 0, 1) + _kuai_row(1, 5, 500, 1, 1, 1, 9000, 0, 2))
    _write(raw / "log_random_4_22_to_5_08_pure.csv", KUAI_HEADER + "\n" + _kuai_row(0, 7, "9000.0", 1, 1, 0, "", 1, 4)
           + _kuai_row(1, 6, 800, 0, 0, 0, 15000, 1, 1))
    done = convert("kuairand", raw, tmp_path / "out")
    assert (done.train_rows, done.eval_rows) == (3, 2)
    assert [n for n, f in done.schema["features"].items() if f["kind"] == "dense"] == [
        "user_events", "hours_since_last", "duration", "is_rand"]
    ev = _by_candidate(_read(tmp_path / "out", "eval"), "video")
    # ids in order of first appearance, files in name order: video 7 -> 0, 6 -> 1, 5 -> 2
    r = ev[(0, 2)]  # user 0: video 6 (shown), video 5 (long view), then the random exposure of video 7 (liked)
    assert r["video_ids"] == [1, 2] and r["actions"] == [0, 2]
    assert (r["click"], r["long_view"], r["like"]) == (1.0, 0.0, 1.0)
    assert (r["duration"], r["is_rand"]) == (0.0, 1.0)  # empty duration; random exposure
    r = ev[(1, 1)]  # user 1: video 5 liked at 500 ms, video 6 shown at 800 ms
    assert r["video_ids"] == [2] and r["actions"] == [3] and r["duration"] == pytest.approx(math.log1p(15.0))
    assert done.schema["tables"]["tab"]["num_embeddings"] == 3


@pytest.mark.parametrize(
    "name, files, problem",
    [
        ("movielens-1m", {"ratings.dat": "1::1193::5::978300760\n1::661::3\n"},
         "ratings.dat:2: expected 4 fields separated by '::', got 3 ('1::661::3')"),
        ("movielens-1m", {"ratings.dat": "1::1193::6::978300760\n"}, "ratings.dat:1: rating out of range ('6')"),
        ("movielens-1m", {"ratings.dat": "1::1193::5::978300760\n1::9999::3::978300761\n"},
         "ratings.dat:2: movie 9999 is not in the movies file"),
        ("movielens-20m", {"ratings.csv": "userId,movieId,rating,timestamp\n1,1193,4.25,1\n"},
         "ratings.csv:2: rating out of range ('4.25')"),
        ("taobao", {"UserBehavior.csv": "1,2,3,pv,100\n1,2,3,click,101\n"},
         "UserBehavior.csv:2: behavior_type must be one of ['buy', 'cart', 'fav', 'pv'] (got 'click')"),
        ("taobao", {"UserBehavior.csv": "1,2,3,pv,100\n1,x,3,pv,101\n"}, "UserBehavior.csv:2: item id is not an integer ('x')"),
        ("kuairand", {"log_standard_pure.csv": KUAI_HEADER + "\n" + _kuai_row(0, 5, 1, 2, 0, 0, 9, 0, 1)},
         "log_standard_pure.csv:2: is_click must be 0 or 1 (got 2)"),
        ("kuairand", {"log_standard_pure.csv": "user_id,video_id\n0,5\n"}, "log_standard_pure.csv:1: header lacks column(s)"),
    ],
)
def test_malformed_rows_name_file_and_line(tmp_path, name, files, problem):
    raw = tmp_path / "raw"
    if name == "movielens-1m":
        _ml_1m(raw)
    elif name == "movielens-20m":
        _ml_20m(raw)
    for fname, text in files.items():
        _write(raw / fname, text)
    with pytest.raises(RawError) as e:
        convert(name, raw, tmp_path / "out")
    assert str(e.value).startswith(f"{raw}/{problem}"), str(e.value)
    assert not (tmp_path / "out").exists() or not any((tmp_path / "out").iterdir())  # nothing half-written


def test_skipped_rows_are_reported_and_counted(tmp_path):
    raw = tmp_path / "raw"
    _write(raw / "UserBehavior.csv", "1,2,3,pv,100\n1,2,3\n1,4,3,buy,300\n2,5,6,pv,1\n2,5,6,??,2\n2,7,6,pv,3\n")
    report = io.StringIO()
    done = convert("taobao", raw, tmp_path / "out", bad=BadRows(max_bad=2, stream=report))
    assert done.skipped == 2 and done.train_rows + done.eval_rows == 4
    assert report.getvalue().splitlines() == [
        f"skipped {raw}/UserBehavior.csv:2: expected 5 fields separated by ',', got 3 ('1,2,3')",
        f"skipped {raw}/UserBehavior.csv:5: behavior_type must be one of ['buy', 'cart', 'fav', 'pv'] (got '??')",
    ]
    with pytest.raises(RawError, match=r"UserBehavior.csv:5: .* \(after skipping 1 bad rows\)"):
        convert("taobao", raw, tmp_path / "out2", bad=BadRows(max_bad=1, stream=io.StringIO()))


def test_output_is_never_overwritten(tmp_path):
    raw = _ml_1m(tmp_path / "raw")
    convert("movielens-1m", raw, tmp_path / "out")
    before = sorted(p.name for p in (tmp_path / "out" / "train").iterdir())
    with pytest.raises(RawError, match="already exists"):
        convert("movielens-1m", raw, tmp_path / "out")
    assert sorted(p.name for p in (tmp_path / "out" / "train").iterdir()) == before
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["eval", "schema.yaml", "train"]


def _taobao(raw: Path) -> Path:
    _write(raw / "UserBehavior.csv", "1,10,7,pv,1\n1,11,8,buy,2\n2,10,7,cart,3\n2,12,7,fav,4\n")
    return raw


def _kuairand(raw: Path) -> Path:
    _write(raw / "log_standard_pure.csv", KUAI_HEADER + "\n" + _kuai_row(0, 5, 3000, 1, 0, 1, 9000, 0, 1)
           + _kuai_row(0, 6, 1000, 0, 0, 0, 15000, 0, 1) + _kuai_row(1, 5, 500, 1, 1, 1, 9000, 0, 2)
           + _kuai_row(1, 6, 800, 0, 0, 0, 15000, 1, 1))
    return raw


@pytest.mark.parametrize("name, preset, make", [("movielens-1m", "movielens_1m", _ml_1m),
                                                ("movielens-20m", "movielens_20m", _ml_20m),
                                                ("taobao", "taobao", _taobao), ("kuairand", "kuairand_pure", _kuairand)])
def test_converted_files_fit_the_preset(tmp_path, name, preset, make):
    """The written schema.yaml declares the files (the Parquet reader and the batch validator accept them), and
    the dataset's data preset reads them: the same columns, within its sizes."""
    done = convert(name, make(tmp_path / "raw"), tmp_path / "out", max_len=64)
    written = Schema.from_dict(OmegaConf.load(tmp_path / "out" / "schema.yaml"))
    data = ParquetDataset(written, str(tmp_path / "out" / "train" / "*.parquet"), batch_size=2)
    batch = data.batch(0)
    validate_batch(batch, written)
    declared = Schema.from_dict(OmegaConf.load(ROOT / "configs" / "data" / f"{preset}.yaml"))
    from_preset = ParquetDataset(declared, str(tmp_path / "out" / "train" / "*.parquet"), batch_size=2).batch(0)
    validate_batch(from_preset, declared)
    assert list(done.schema["labels"]) == list(declared.tasks)
    assert [f.name for f in declared.features] == list(done.schema["features"])


def test_cli(tmp_path, capsys):
    from gem.data.datasets.__main__ import main

    raw = _ml_1m(tmp_path / "raw")
    args = ["movielens-1m", "--raw", str(raw), "--out", str(tmp_path / "o")]
    p = subprocess.run([sys.executable, "-m", "gem.data.datasets", *args], capture_output=True, text=True,
                       timeout=120, check=False, cwd=ROOT)
    assert p.returncode == 0, p.stderr
    assert p.stdout.splitlines()[0] == f"movielens-1m: 4 train and 2 eval examples in {tmp_path / 'o'}"
    assert f"gem-train experiment=movielens_1m data.paths='[{tmp_path / 'o'}/train/*.parquet]'" in p.stdout
    eval_rows = pq.read_table(tmp_path / "o" / "eval" / "part-00000.parquet")
    assert np.isfinite(eval_rows.column("hours_since_last").to_numpy()).all()
    assert main(args) == 2
    assert capsys.readouterr().err == f"gem.data.datasets: error: {tmp_path / 'o' / 'train'}: already exists " \
                                      "(remove it or pick another --out)\n"
    assert main([*args[:3], "--out", str(tmp_path / "p"), "--max-len", "0"]) == 2
    assert capsys.readouterr().err == "gem.data.datasets: error: --max-len must be >= 1 (got 0)\n"


def test_preset_trains_on_converted_files(tmp_path):
    """The documented path: convert into data/<preset>/ and train with the preset from that folder."""
    from tests.train._util import env

    convert("movielens-1m", _ml_1m(tmp_path / "raw"), tmp_path / "data" / "movielens_1m")
    cmd = [sys.executable, "-m", "gem.train", "experiment=movielens_1m", "data.batch_size=2", "data.eval_batches=1",
           "train.steps=2", "train.warmup_steps=1", "train.log_every=1", "model.kernel=reference",
           "train.tensorboard=false", f"hydra.run.dir={tmp_path / 'run'}"]
    p = subprocess.run(cmd, cwd=tmp_path, env=env(tmp_path), capture_output=True, text=True, timeout=240, check=False)
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-2000:]
    assert "gem-train summary: steps 2" in p.stdout
