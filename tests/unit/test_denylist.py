"""The denylist matcher against hand-made sequences: windows of an exact run, whole sequences of
other lengths, near misses, word entries against the folded words of a document's text (any
spacing, case, look-alike letters), and the file checks (one line naming file and field)."""

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
    ({"format": "other"}, "format: expected 'mimir-denylist-v2'"),
    ({"tokenizer": {"sha256": "zzz"}}, "tokenizer.sha256 is zzz..., but this tokenizer's is abc..."),
    ({"entries": [{"ids": [1, -2], "window": 1}]}, "entries[0].ids: expected a non-empty list of token ids"),
    ({"entries": [{"ids": [1, 2], "window": 3}]}, "entries[0].window: expected an integer from 1 to len(ids) = 2"),
    ({"entries": [{"words": [], "window": 1}]}, "entries[0].words: expected a non-empty list of word numbers"),
    ({"words": "mimir-words-v0", "entries": [{"words": [1, 2], "window": 2}]},
     "words: the word entries were folded by 'mimir-words-v0', this mimir folds by 'mimir-words-v1/"),
])
def test_bad_files_are_one_line_naming_file_and_field(tmp_path, body, message):
    path = tmp_path / "bad.json"
    path.write_text(json.dumps({"format": "mimir-denylist-v1", "tokenizer": {"sha256": "abc"}, "entries": [],
                                **body}))
    with pytest.raises(UserError) as err:
        Denylist(path, "abc")
    assert str(err.value).startswith(f"{path}: ") and message in str(err.value) and "\n" not in str(err.value)


def test_word_entries_match_the_folded_words_of_a_documents_text(tmp_path):
    """A word entry stands for the words however the document writes them; the text is asked for
    only when no token entry matched, and a denylist of token entries only never asks."""
    from mimir_megatron.audits.normalise import word_spans

    words = [n for _, _, n in word_spans("the quick brown fox jumps")]
    path = write_denylist(tmp_path / "w.json", {"sha256": "abc"}, 3,
                          [ENTRIES[0], {"words": words, "window": 4, "benchmark": "gen", "item": "7"}], {})
    denylist = Denylist(path, "abc")
    assert denylist.reads_text and len(denylist) == 2 + 2
    copy = "Say: THE\u00a0Quick  bro\u200bwn\n\u0444ox? No: The quick brоwn fox!"  # the second: Cyrillic o
    hit = denylist.first_hit([1, 2, 3], lambda: copy)
    assert (hit.position, hit.length, hit.item, hit.unit) == (6, 4, "7", "word")
    assert "4 words at word 6 are benchmark gen item 7" in hit.describe(path)
    assert denylist.first_hit([1, 2, 3], lambda: "the quick brown dog jumps") is None
    asked = []
    assert denylist.first_hit([0, 5, 6, 7], lambda: asked.append(1) or copy).unit == "token" and not asked
    with pytest.raises(ValueError, match="needs the document's text"):
        denylist.first_hit([1, 2, 3])
    tokens_only = Denylist(write_denylist(tmp_path / "t.json", {"sha256": "abc"}, 3, ENTRIES, {}), "abc")
    assert not tokens_only.reads_text and tokens_only.first_hit([9, 9, 4, 9, 9]).unit == "token"


def test_a_version_1_denylist_still_reads(tmp_path):
    path = tmp_path / "v1.json"
    path.write_text(json.dumps({"format": "mimir-denylist-v1", "tokenizer": {"sha256": "abc"}, "ngram": 3,
                                "entries": ENTRIES}))
    assert Denylist(path, "abc").first_hit([0, 6, 7, 8, 1]).position == 1
