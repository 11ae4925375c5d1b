"""Text as the contamination check compares it: a sequence of folded words, each a number.

A benchmark item copied into training data is often not copied byte for byte: re-wrapped or
re-spaced, Title Cased or ALL CAPS, with no-break or zero-width spaces, full-width letters, Cyrillic
or Greek letters that look Latin, punctuation dropped or changed. Token ids see each of these as
other text. Here both sides, every training document (when `mimir audit index` builds the index's
word stream) and every item (when `mimir audit contamination` checks it), become the same thing:

- **words**: runs of non-whitespace; any whitespace separates them (``str.isspace``: space, tab,
  line ends, no-break spaces, the ideographic space...), so the spacing between words never matters;
- each word **folded** (:func:`fold`): NFKC (full-width letters, ligatures, compatibility forms),
  format characters deleted (zero-width space, joiners, word joiner, BOM, soft hyphen, bidi marks:
  Unicode category Cf), punctuation deleted (category P*), letters that look Latin mapped to the
  Latin letter (:data:`CONFUSABLES`), then Unicode case folding (``str.casefold``); a word that
  folds to nothing (a dash, a lone quote) is dropped;
- each folded word **numbered** (:func:`word_id`): CRC-32 of its UTF-8, reduced to the index's
  ``u16x2`` id range (2^30 values). Distinct words share a number by chance (about one word in a
  hundred among ten million distinct words shares its number with another); a false match needs
  every word of an n-gram to collide, in order.

What folding does not undo: a zero-width space used *instead of* a space (the two words become one),
a word split by a space, words changed or reordered, a translation. The version of these rules,
:data:`WORD_FORM`, is recorded in the index and in denylists: a change refuses both until rebuilt.
"""

from __future__ import annotations

import re
import unicodedata
import zlib
from functools import lru_cache
from typing import Any

WORD_FORM = f"mimir-words-v1/unicode-{unicodedata.unidata_version}"
"""The folding rules' version and the Unicode tables they read (this Python's): an index or a
denylist of another is refused (rebuild it)."""
WORD_ID_LIMIT = (0xFFFF - 0x8000) * 0x8000
"""Word numbers are below this: the ``u16x2`` encoding's token-id range (index_format)."""

# Cyrillic and Greek letters that Unicode's confusables data (UTS #39, confusables.txt) lists as
# confusable with one ASCII Latin letter, read from the copy the confusable-homoglyphs package
# (3.3.1, January 2024) ships: each source letter, then its Latin look-alike. Capitals map to
# capitals (case folding follows), so Greek capital Nu and small nu each map to what they look
# like (N, v). Confusables prototype I-shaped capitals as "l"; here they map to "I", since case
# folding then makes every I-shape the "i" a Latin capital I folds to.
_CONFUSABLE_PAIRS = (
    # Cyrillic capitals
    "АA ВB ЕE ЅS ІI ЈJ КK МM НH ОO РP СC ТT УY ХX ЬB ӀI ԌG ԜW ѴV ҮY"
    # Cyrillic small letters
    " аa гr еe оo рp сc уy хx ѕs іi јj ѡw ѵv үy һh ҽe ӏi ԁd ԛq ԝw ꙇi"
    # Greek capitals
    " ΑA ΒB ΕE ΖZ ΗH ΙI ΚK ΜM ΝN ΟO ΡP ΤT ΥY ΧX ϜF ϹC ϺM ϿJ ϒY"
    # Greek small letters and symbols
    " αa γy ιi νv οo ρp σo υu ϱp ϲc ϳj ͺi ιi ᴦr"
)
CONFUSABLES: dict[str, str] = {pair[0]: pair[1] for pair in _CONFUSABLE_PAIRS.split()}
"""Cyrillic and Greek look-alikes of Latin letters, mapped to the Latin letter (before case folding)."""

_WORD = re.compile(r"\S+")
_ASCII_PUNCTUATION = str.maketrans("", "", "".join(chr(c) for c in range(128)
                                                  if unicodedata.category(chr(c))[0] == "P"))


@lru_cache(maxsize=1)
def _table() -> dict[int, str | None]:
    """``str.translate`` table: confusables to Latin, format characters and punctuation deleted
    (every code point of Unicode categories Cf and P*, as this Python's unicodedata knows them)."""
    table: dict[int, str | None] = {ord(k): v for k, v in CONFUSABLES.items()}
    for code in range(0x110000):
        category = unicodedata.category(chr(code))
        if category == "Cf" or category[0] == "P":
            table[code] = None
    return table


def fold(word: str) -> str:
    """``word`` as the contamination check compares it (module docstring); "" when nothing is left."""
    if word.isascii():  # the common case: NFKC changes nothing, case folding is lower-casing
        return word.translate(_ASCII_PUNCTUATION).lower()
    folded = unicodedata.normalize("NFKC", word).translate(_table()).casefold()
    return "".join(folded.split())  # NFKC makes a space of some characters (U+00A8)


def word_id(folded: str) -> int:
    """The number of a folded word in the index's word stream."""
    return zlib.crc32(folded.encode("utf-8", "surrogatepass")) % WORD_ID_LIMIT


def word_spans(text: str) -> list[tuple[int, int, int]]:
    """(start, end, number) of each word of ``text`` that folds to something, in order."""
    spans = []
    for m in _WORD.finditer(text):
        folded = fold(m.group())
        if folded:
            spans.append((m.start(), m.end(), word_id(folded)))
    return spans


class WordNumbers:
    """The numbers of the words of texts (:func:`word_spans` without the spans), with the words
    seen remembered: a training corpus repeats most of its words."""

    def __init__(self, limit: int = 1 << 20) -> None:
        self._known: dict[str, int] = {}
        self._limit = limit

    def __call__(self, text: str) -> list[int]:
        words = text.split()  # the words of _WORD (str.isspace either way; a unit test checks)
        numbers = list(map(self._known.get, words))  # the lookups in C: most words are known
        if None in numbers:
            if len(self._known) >= self._limit:
                self._known.clear()
            for k, word in enumerate(words):
                if numbers[k] is None:
                    folded = fold(word)
                    numbers[k] = self._known[word] = word_id(folded) if folded else -1
        return [n for n in numbers if n >= 0] if -1 in numbers else numbers


def document_text(tokenizer: Any, ids) -> str:
    """A training document's text from its token ids, the one way the index builder and `mimir
    prepare --denylist` both read it: ``tokenizer`` a ``tokenizers.Tokenizer`` (a Hugging Face
    fast tokenizer's ``backend_tokenizer``), special tokens (the chat template's markers) left out."""
    return tokenizer.decode(_int_list(ids), skip_special_tokens=True)


def documents_text(tokenizer: Any, documents) -> list[str]:
    """:func:`document_text` of each of ``documents`` (token id arrays), in one tokenizer call."""
    return tokenizer.decode_batch([_int_list(ids) for ids in documents], skip_special_tokens=True)


def _int_list(ids) -> list[int]:
    """Token ids as the tokenizer takes them: a list of Python ints (a numpy array's, converted)."""
    return ids.tolist() if hasattr(ids, "tolist") else ids if isinstance(ids, list) else list(ids)
