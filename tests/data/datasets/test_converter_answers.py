"""The dataset converters' labels and actions against answers worked out by hand from the documented rules."""

from __future__ import annotations

from pathlib import Path

from gem.data.datasets import BadRows, movielens

MOVIES = 'movieId,title,genres\n10,"Heat (1995)",Action|Crime\n'


def test_movielens_half_stars_like_from_4_love_only_at_5(tmp_path: Path):
    """like: rating >= 4; love: rating = 5; the history's rating class: the rating rounded up, minus 1."""
    raw = tmp_path / "raw"
    raw.mkdir()
    ratings = [5.0, 4.5, 4.0, 3.5, 0.5]
    (raw / "ratings.csv").write_text("userId,movieId,rating,timestamp\n"
                                     + "".join(f"1,10,{r},{100 + i}\n" for i, r in enumerate(ratings)))
    (raw / "movies.csv").write_text(MOVIES)
    ev, _ = movielens.convert(raw, "20m", BadRows())
    assert list(ev.labels["like"]) == [1.0, 1.0, 1.0, 0.0, 0.0]
    assert list(ev.labels["love"]) == [1.0, 0.0, 0.0, 0.0, 0.0]
    assert list(ev.action) == [4, 4, 3, 3, 0]
