"""Reading the public datasets' raw files: a UTF-8 byte-order mark is skipped, MovieLens' '(no genres listed)' is no
genre, and text that is not in the file's encoding is named by file and line."""

from __future__ import annotations

from pathlib import Path

import pytest

from gem.data.datasets import BadRows, RawError, movielens
from gem.data.datasets._events import read_rows

RATINGS = "userId,movieId,rating,timestamp\n1,10,4.0,100\n1,20,3.5,200\n2,10,5.0,150\n2,20,2.0,160\n"
MOVIES = 'movieId,title,genres\n10,"Heat (1995)",Action|Crime\n20,"Some Film (2015)",(no genres listed)\n'


def _raw(tmp_path: Path, ratings: bytes, movies: bytes) -> Path:
    raw = tmp_path / "raw"
    raw.mkdir()
    (raw / "ratings.csv").write_bytes(ratings)
    (raw / "movies.csv").write_bytes(movies)
    return raw


@pytest.mark.parametrize("bom", [False, True])
def test_byte_order_mark_is_skipped_and_no_genres_listed_is_no_genre(tmp_path, bom):
    mark = b"\xef\xbb\xbf" if bom else b""
    raw = _raw(tmp_path, mark + RATINGS.encode(), mark + MOVIES.encode())
    events, spec = movielens.convert(raw, "20m", BadRows())
    genres, num_genres = spec.item_multi["genres"]
    assert num_genres == 2  # Action, Crime; '(no genres listed)' is not a genre
    assert sorted(len(g) for g in genres) == [0, 2]
    assert len(events.item) == 4


def test_byte_order_mark_in_a_latin_1_file(tmp_path):
    path = tmp_path / "movies.dat"
    path.write_bytes(b"\xef\xbb\xbf" + "10::Caf\xe9 (1990)::Drama\n20::X (1991)::(no genres listed)\n".encode("latin-1"))
    rows = [fields for _, fields in read_rows(path, "::", 3, BadRows(), encoding="latin-1")]
    assert rows[0] == ["10", "Caf\xe9 (1990)", "Drama"] and rows[1][0] == "20"
    assert movielens.genre_names(rows[1][2]) == [] and movielens.genre_names(" A|B ") == ["A", "B"]


def test_text_in_another_encoding_names_file_and_line(tmp_path):
    raw = _raw(tmp_path, RATINGS.encode(), MOVIES.encode() + "30,Caf\xe9 (1990),Drama\n".encode("latin-1"))
    with pytest.raises(RawError, match=rf"^{raw / 'movies.csv'}:4: not utf-8 text"):
        movielens.convert(raw, "20m", BadRows())


def test_a_bad_value_names_file_and_line(tmp_path):
    raw = _raw(tmp_path, (RATINGS + "3,10,lots,170\n").encode(), MOVIES.encode())
    with pytest.raises(RawError, match=rf"^{raw / 'ratings.csv'}:6: rating is not a number \('lots'\)"):
        movielens.convert(raw, "20m", BadRows())
