"""The denylist matcher against hand-made sequences: windows of an exact run, whole re-spaced
sequences of other lengths, near misses, and the file checks (one line naming file and field)."""

from __future__ import annotations

import json

import pytest

from mimir_megatron.audits.denylist import Denylist, write_denylist
from mimir_megatron.errors import UserError

ENTRIES = [{"ids": [5, 6, 7, 8], "window": 3, "benchmark": "gen", "item": "1"},  # [5 6 7], [6 7 8]
           {"ids": [9, 9, 4, 9, 9], "window": 5, "benchmark": "mc", "item": "2"}]


@pytest.fixture
def denylist(tmp_path):
    return Denylist(write_denylist(tmp_path / "d.json", {"sha256": "abc"}, 3, ENTRIES, {}), "abc")


@pytest.mark.parametrize("ids, expected", [
    ([0, 6, 7, 8, 1], (1, 3, "gen", "1")),          # the second window of the run
    ([5, 6, 7], (0, 3, "gen", "1")),                 # the whole document
    ([9, 9, 4, 9, 1, 9, 9, 4, 9, 9], (5, 5, "mc", "2")),  # a prefix first, then the sequence
    ([5, 6, 1, 7, 8], None), ([8, 7, 6, 5], None), ([9, 9, 4, 9], None), ([], None),
])
def test_first_hit(denylist, ids, expected):
    hit = denylist.first_hit(ids)
    assert (None if hit is None else (hit.position, hit.length, hit.benchmark, hit.item)) == expected


def test_an_empty_denylist_drops_nothing(tmp_path):
    empty = Denylist(write_denylist(tmp_path / "e.json", {"sha256": "abc"}, 13, [], {}), "abc")
    assert len(empty) == 0 and empty.first_hit(list(range(50))) is None


@pytest.mark.parametrize("body, message", [
    ({"format": "other"}, "format: expected 'mimir-denylist-v1'"),
    ({"tokenizer": {"sha256": "zzz"}}, "tokenizer.sha256 is zzz..., but this tokenizer's is abc..."),
    ({"entries": [{"ids": [1, -2], "window": 1}]}, "entries[0].ids: expected a non-empty list of token ids"),
    ({"entries": [{"ids": [1, 2], "window": 3}]}, "entries[0].window: expected an integer from 1 to len(ids) = 2"),
])
def test_bad_files_are_one_line_naming_file_and_field(tmp_path, body, message):
    path = tmp_path / "bad.json"
    path.write_text(json.dumps({"format": "mimir-denylist-v1", "tokenizer": {"sha256": "abc"}, "entries": [],
                                **body}))
    with pytest.raises(UserError) as err:
        Denylist(path, "abc")
    assert str(err.value).startswith(f"{path}: ") and message in str(err.value) and "\n" not in str(err.value)
