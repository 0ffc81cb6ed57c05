"""Taobao User Behavior (Alibaba, Tianchi): `UserBehavior.csv`, no header, one row per event:
user_id,item_id,category_id,behavior_type,timestamp with behavior_type in pv / cart / fav / buy.

History: `item_ids`, `behaviors` (pv 0, cart 1, fav 2, buy 3) and the items' categories `category_ids`; the
candidate `item_id` and its `category_id` (sharing the category table); `user_id`; tasks: engage (cart, fav or
buy) and buy. Requests (a user's events in one session): `item_id`, `category_id` and the labels one per event,
`user_id` the request's.
"""

from __future__ import annotations

from pathlib import Path

from gem.data.datasets._events import BadRows, Events, Spec, Vocab, parse_int, raw_file, read_rows

BEHAVIORS = {"pv": 0, "cart": 1, "fav": 2, "buy": 3}
TASKS = ["engage", "buy"]


def convert(raw: Path, variant: str, bad: BadRows) -> tuple[Events, Spec]:
    users, items, cats = Vocab(), Vocab(), Vocab()
    ev = Events(seq={"category_ids": []}, sparse={"category_id": [], "user_id": []},
                labels={t: [] for t in TASKS})
    for where, (user, item, cat, behavior, ts) in read_rows(raw_file(raw, "UserBehavior.csv"), ",", 5, bad):
        try:
            for value, what in ((user, "user id"), (item, "item id"), (cat, "category id")):
                parse_int(value, what)
            t = parse_int(ts, "timestamp")
            if behavior not in BEHAVIORS:
                raise ValueError(f"behavior_type must be one of {sorted(BEHAVIORS)} (got {behavior!r})")
        except ValueError as e:
            bad(where, str(e))
            continue
        act, c = BEHAVIORS[behavior], cats(cat)
        ev.user.append(users(user))
        ev.time_s.append(float(t))
        ev.item.append(items(item))
        ev.action.append(act)
        ev.seq["category_ids"].append(c)
        ev.sparse["category_id"].append(c)
        ev.sparse["user_id"].append(ev.user[-1])
        ev.labels["engage"].append(float(act > 0))
        ev.labels["buy"].append(float(act == 3))
    spec = Spec(name="taobao", item="item", num_items=len(items), action="behaviors", num_actions=len(BEHAVIORS),
                seq_cards={"category_ids": ("category", len(cats))},
                sparse_cards={"category_id": len(cats), "user_id": len(users)}, item_multi={}, tasks=TASKS,
                dense_names=[], candidate_attrs={"category_id": "category"})
    return ev, spec
