"""MovieLens ratings (GroupLens): ML-1M (`ratings.dat`, `movies.dat`, `::`-separated, Latin-1) and ML-20M (also
25M / 32M: `ratings.csv`, `movies.csv` with headers).

Per rating: history `movie_ids` and `ratings` (the rating rounded up, minus 1: 0..4; ML-20M's half stars round
up); the candidate `movie_id`; `user_id`; the movie's `genres` (multi-hot); tasks: like (rating >= 4) and
love (rating = 5).
"""

from __future__ import annotations

import csv
import math
from pathlib import Path

from gem.data.datasets._events import (
    BadRows,
    Events,
    RawError,
    Spec,
    Vocab,
    parse_float,
    parse_int,
    raw_file,
    read_rows,
    text_lines,
)

TASKS = ["like", "love"]


NO_GENRES = "(no genres listed)"  # MovieLens' entry for a movie without genres


def genre_names(text: str) -> list[str]:
    """The genres of a movies-file entry: `A|B`; none for MovieLens' '(no genres listed)' or an empty field."""
    text = text.strip()
    return [] if text in ("", NO_GENRES) else text.split("|")


def _movies_1m(path: Path, bad: BadRows) -> dict[str, list[str]]:
    genres = {}
    for where, (movie, _title, names) in read_rows(path, "::", 3, bad, encoding="latin-1"):
        genres[movie] = genre_names(names)
    return genres


def _movies_csv(path: Path, bad: BadRows) -> dict[str, list[str]]:
    genres = {}
    lines = text_lines(path)
    reader = csv.reader(line for _, line in lines)
    header = next(reader, None)
    if header is None or [h.strip() for h in header[:3]] != ["movieId", "title", "genres"]:
        raise RawError(f"{path}:1: expected the header movieId,title,genres (got {header})")
    for row in reader:
        if len(row) != 3:
            bad(f"{path}:{reader.line_num}", f"expected 3 fields (movieId,title,genres), got {len(row)}")
            continue
        genres[row[0]] = genre_names(row[2])
    return genres


def convert(raw: Path, variant: str, bad: BadRows) -> tuple[Events, Spec]:
    if variant == "1m":
        ratings_path, half_stars = raw_file(raw, "ratings.dat"), False
        movies = _movies_1m(raw_file(raw, "movies.dat"), bad)
        rows = read_rows(ratings_path, "::", 4, bad)
    else:
        ratings_path, half_stars = raw_file(raw, "ratings.csv"), True
        movies = _movies_csv(raw_file(raw, "movies.csv"), bad)
        rows = read_rows(ratings_path, ",", 4, bad, header=["userId", "movieId", "rating", "timestamp"])
    users, items, genre_ids = Vocab(), Vocab(), Vocab()
    item_genres: list[list[int]] = []
    ev = Events(sparse={"user_id": []}, labels={t: [] for t in TASKS})
    for where, (user, movie, rating, ts) in rows:
        try:
            r = parse_float(rating, "rating") if half_stars else parse_int(rating, "rating")
            if not (0.5 <= r <= 5.0 and float(r * 2).is_integer()) or (not half_stars and r < 1):
                raise ValueError(f"rating out of range ({rating!r})")
            t = parse_int(ts, "timestamp")
            parse_int(user, "user id")
            if movie not in movies:
                raise ValueError(f"movie {movie} is not in the movies file")
        except ValueError as e:
            bad(where, str(e))
            continue
        i = items(movie)
        if i == len(item_genres):
            item_genres.append([genre_ids(g) for g in movies[movie]])
        ev.user.append(users(user))
        ev.sparse["user_id"].append(ev.user[-1])
        ev.time_s.append(float(t))
        ev.item.append(i)
        ev.action.append(math.ceil(r) - 1)
        ev.labels["like"].append(float(r >= 4))
        ev.labels["love"].append(float(r >= 5))
    spec = Spec(name=f"movielens-{variant}", item="movie", num_items=len(items), action="ratings", num_actions=5,
                seq_cards={}, sparse_cards={"user_id": len(users)},
                item_multi={"genres": (item_genres, len(genre_ids))}, tasks=TASKS, dense_names=[])
    return ev, spec
