"""KuaiRand (Kuaishou): KuaiRand-1K or KuaiRand-Pure, the interaction logs `log_*.csv` of the `data/` folder
(standard and random exposures; every `log_*.csv` in the raw folder is read, in name order).

Every exposure is an event, clicked or not. History `video_ids` and `actions` (0 shown, 1 clicked, 2 long view,
3 liked: the highest reached); the candidate `video_id`; `user_id`, the app `tab`; dense: `duration` = log1p(video
duration in seconds) and `is_rand` (whether the exposure was random); tasks: click, long_view, like.

Requests (a user's exposures in one session): `user_id` is the request's; `tab` and the exposure's own numbers
become candidate ids, one per exposure: `duration_bucket` = min(floor(2 * log1p(duration in seconds)), 15) (16
buckets, half a log unit wide: 0.6 s, 1.7 s, 3.5 s, ... 30 min) and `is_rand` (0 standard, 1 random exposure).
"""

from __future__ import annotations

import math
from pathlib import Path

from gem.data.datasets._events import BadRows, Events, RawError, Spec, Vocab, parse_float, parse_int, read_rows

COLUMNS = ["user_id", "video_id", "time_ms", "is_click", "long_view", "is_like", "duration_ms", "is_rand", "tab"]
TASKS = ["click", "long_view", "like"]
DURATION_BUCKETS = 16


def convert(raw: Path, variant: str, bad: BadRows) -> tuple[Events, Spec]:
    files = sorted(raw.glob("log_*.csv"))
    if not files:
        raise RawError(f"{raw}: no log_*.csv (KuaiRand's data/ folder; see docs/DATASETS.md for the download)")
    users, items, tabs = Vocab(), Vocab(), Vocab()
    ev = Events(sparse={"user_id": [], "tab": []}, dense=[[], []], labels={t: [] for t in TASKS},
                cand_ids={"duration_bucket": [], "is_rand": []})
    for path in files:
        for where, row in read_rows(path, ",", 0, bad, header=COLUMNS):
            try:
                times = ("time_ms", "duration_ms")  # written as integers or as floats
                user, video, _, click, long_view, like, _, rand, tab = (
                    parse_int(v, c) if c not in times else 0 for v, c in zip(row, COLUMNS))
                t = parse_float(row[2], "time_ms")
                duration = parse_float(row[6], "duration_ms") if row[6] else 0.0  # an empty duration counts as 0
                for flag, name in ((click, "is_click"), (long_view, "long_view"), (like, "is_like"),
                                   (rand, "is_rand")):
                    if flag not in (0, 1):
                        raise ValueError(f"{name} must be 0 or 1 (got {flag})")
            except ValueError as e:
                bad(where, str(e))
                continue
            ev.user.append(users(str(user)))
            ev.time_s.append(t / 1000.0)
            ev.item.append(items(str(video)))
            ev.action.append(3 if like else 2 if long_view else 1 if click else 0)
            ev.sparse["user_id"].append(ev.user[-1])
            ev.sparse["tab"].append(tabs(str(tab)))
            log_s = math.log1p(max(duration, 0.0) / 1000.0)
            ev.dense[0].append(log_s)
            ev.dense[1].append(float(rand))
            ev.cand_ids["duration_bucket"].append(min(int(2.0 * log_s), DURATION_BUCKETS - 1))
            ev.cand_ids["is_rand"].append(rand)
            ev.labels["click"].append(float(click))
            ev.labels["long_view"].append(float(long_view))
            ev.labels["like"].append(float(like))
    spec = Spec(name="kuairand", item="video", num_items=len(items), action="actions", num_actions=4, seq_cards={},
                sparse_cards={"user_id": len(users), "tab": len(tabs)}, item_multi={}, tasks=TASKS,
                dense_names=["duration", "is_rand"],
                cand_id_cards={"duration_bucket": DURATION_BUCKETS, "is_rand": 2})
    return ev, spec
