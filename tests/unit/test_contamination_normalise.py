"""Words as the contamination check compares them (mimir_megatron.audits.normalise): each way a
copy can hide an item without changing a word folds back to the item's words, words that differ
stay apart, and the index builder's path (WordNumbers) numbers words as the item's path does."""

from __future__ import annotations

import unicodedata

import pytest

from mimir_megatron.audits.normalise import CONFUSABLES, WORD_ID_LIMIT, WordNumbers, fold, word_spans

ITEM = "The quick brown fox jumps over the lazy dog, says Åse's rule."


def numbers(text: str) -> list[int]:
    return [n for _, _, n in word_spans(text)]


def cyrillic(text: str) -> str:
    return text.translate(str.maketrans("aeopcxyABEHKMOPCTX", "аеорсхуАВЕНКМОРСТХ"))


COPIES = {
    "title case": ITEM.title(),
    "all caps": ITEM.upper(),
    "mixed case": " ".join(w.upper() if i % 2 else w.lower() for i, w in enumerate(ITEM.split())),
    "no-break spaces": ITEM.replace(" ", "\u00a0"),
    "other whitespace": ITEM.replace(" ", "\u2003", 3).replace(" ", "\u3000", 2).replace(" ", "\t\n", 1),
    "re-wrapped": ITEM.replace(" ", "\n   ", 4),
    "zero-width in words": " ".join(w[:1] + "\u200b" + w[1:] + "\u2060" for w in ITEM.split()),
    "joiners, soft hyphens, BOM": "\ufeff" + " ".join("\u200d" + w + "\u00ad" for w in ITEM.split()),
    "Cyrillic look-alikes": cyrillic(ITEM),
    "Greek capitals": ITEM.upper().translate(str.maketrans("ABEHIKMNOPTXYZ", "ΑΒΕΗΙΚΜΝΟΡΤΧΥΖ")),
    "full-width": "".join(chr(ord(c) + 0xFEE0) if "!" <= c <= "~" else c for c in ITEM),
    "punctuation dropped": ITEM.replace(",", "").replace("'", "").replace(".", ""),
    "punctuation changed": ITEM.replace(",", ";").replace("'", "\u2019").replace(".", "!"),
    "decomposed letters": unicodedata.normalize("NFD", ITEM),
}


@pytest.mark.parametrize("copy", COPIES.values(), ids=COPIES.keys())
def test_each_way_of_hiding_an_item_folds_back_to_its_words(copy):
    assert numbers(copy) == numbers(ITEM)
    assert WordNumbers()(copy) == numbers(ITEM)  # the index builder's path, the same numbers


@pytest.mark.parametrize("other", [
    ITEM.replace("fox", "box"), ITEM.replace("lazy dog", "lazydog"), ITEM.replace("Åse", "Ase"),
    "Den hurtige brune ræv springer over den dovne hund.",  # a translation: out of scope
])
def test_different_words_stay_different(other):
    assert numbers(other) != numbers(ITEM)


def test_what_folds_to_nothing_is_no_word_and_spans_point_into_the_text():
    text = "a \u2014 b \u200b c -- d"
    assert [text[a:b] for a, b, _ in word_spans(text)] == ["a", "b", "c", "d"]
    assert fold("\u2014") == fold("--") == fold("\u200b") == ""
    assert fold("STRASSE") == fold("Straße") == "strasse" and fold("ﬁne") == "fine"
    assert all(0 <= n < WORD_ID_LIMIT for n in numbers(ITEM + " " + cyrillic(ITEM.upper())))


def test_the_confusables_table_maps_cyrillic_and_greek_letters_to_latin_ones():
    """Every entry: a Cyrillic or Greek letter (as Unicode names it) to an ASCII letter of the same
    case; the letters copies use most (a, c, e, o, p, x, y; A, B, E, H, K, M, O, P, T, X) are in."""
    for source, latin in CONFUSABLES.items():
        name = unicodedata.name(source)
        assert name.split()[0] in ("CYRILLIC", "GREEK") and unicodedata.category(source)[0] == "L", name
        assert latin.isascii() and latin.isalpha(), name
    assert {CONFUSABLES[c] for c in "асеорху"} == set("aceopxy")
    assert {CONFUSABLES[c] for c in "АВЕНКМОРТХ"} == set("ABEHKMOPTX")


def test_the_index_builder_and_the_item_cut_words_at_the_same_characters():
    """WordNumbers cuts with str.split, word_spans with the regex ``\\S+``: the same separators
    (str.isspace) among every code point."""
    import re

    every = "".join(map(chr, range(0x110000)))
    separators = set(filter(str.isspace, every))
    assert set(re.findall(r"\s", every)) == separators and "\u00a0" in separators and "\u3000" in separators
    assert every.split() == re.findall(r"\S+", every)
