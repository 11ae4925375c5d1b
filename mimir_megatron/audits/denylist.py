"""Denylists: benchmark text found in the training data, for `mimir prepare --denylist`.

``mimir audit contamination --denylist FILE`` writes one; ``mimir prepare --denylist FILE`` drops
every document (prefix then response, the token ids the index holds) that contains one of its
sequences, and counts it as a ``benchmark_overlap`` reject. The sequences are the runs the
contamination audit found in training documents: token ids (an exact run) or the numbers of folded
words (a run of the index's word stream, :mod:`.normalise`: the document decoded and folded as the
index builder folds it), so a re-prepare with the same tokenizer drops exactly the documents the
audit reported. Layout::

    {"format": "mimir-denylist-v2",
     "tokenizer": {"sha256": "...", "path": "..."},      # as prepared manifests record it
     "ngram": 13,
     "words": "mimir-words-v1/unicode-15.0.0",           # the folding rules of the word entries
     "source": {...},                                    # suite, index, report (for the record)
     "entries": [{"ids": [...], "window": 13, "benchmark": "boolq", "item": "12", "part": "prompt"},
                 {"words": [...], "window": 6, "benchmark": "boolq", "item": "12", "part": "prompt"}]}

An entry stands for every run of ``window`` consecutive ids (or words) in ``ids`` (``words``): an
exact overlap of n tokens and more is stored once, not as one n-gram per position. A
``mimir-denylist-v1`` file (token entries only) still reads. Numpy only: prepare's workers import
this (and :mod:`.normalise`, stdlib).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from mimir_megatron.errors import UserError
from mimir_megatron.integrity import write_json_atomic

from .normalise import WORD_FORM, WordNumbers

FORMAT = "mimir-denylist-v2"
READABLE = ("mimir-denylist-v1", FORMAT)


@dataclass(frozen=True)
class DenylistHit:
    """Where a document meets a denylisted sequence."""

    position: int
    length: int
    benchmark: str
    item: str
    unit: str = "token"
    """``token`` or ``word`` (a folded word of the document's text)."""

    def describe(self, path: str | Path) -> str:
        return (f"{self.length} {self.unit}s at {self.unit} {self.position} are benchmark {self.benchmark} "
                f"item {self.item} (denylist {path})")


def write_denylist(path: str | Path, tokenizer: dict, ngram: int, entries: list[dict], source: dict) -> Path:
    """Write the denylist JSON atomically; ``entries`` as in the module docstring."""
    path = Path(path)
    body = {"format": FORMAT, "tokenizer": {"sha256": tokenizer["sha256"], "path": tokenizer.get("path")},
            "ngram": ngram, "words": WORD_FORM, "source": source, "entries": entries}
    path.parent.mkdir(parents=True, exist_ok=True)
    return write_json_atomic(path, body, indent=None)


class _Sequences:
    """Sequences of non-negative integers, each labelled, found in a longer sequence with a rolling
    hash over the shortest sequence's length (numpy) and an exact comparison where a hash agrees."""

    def __init__(self, sequences: dict[tuple[int, ...], tuple[str, str]]) -> None:
        self._sequences = sequences
        self._key = min((len(s) for s in sequences), default=0)
        by_key: dict[tuple[int, ...], list[tuple[int, ...]]] = {}
        for sequence in sequences:
            by_key.setdefault(sequence[:self._key], []).append(sequence)
        self._by_key = by_key
        rng = np.random.default_rng(0)
        self._weights = rng.integers(1, 2**62, size=self._key, dtype=np.uint64) | np.uint64(1)
        keys = np.array(list(by_key), dtype=np.uint64).reshape(len(by_key), self._key)
        self._hashes = np.sort(self._hash(keys))

    def __len__(self) -> int:
        return len(self._sequences)

    def _hash(self, windows: np.ndarray) -> np.ndarray:
        return (windows * self._weights).sum(axis=1, dtype=np.uint64)

    def first(self, values) -> tuple[int, int, str, str] | None:
        """(position, length, benchmark, item) of the first sequence in ``values``, or None."""
        if not self._sequences or len(values) < self._key:
            return None
        hashes = self._hash(np.lib.stride_tricks.sliding_window_view(np.asarray(values, dtype=np.uint64),
                                                                     self._key))
        found = np.searchsorted(self._hashes, hashes)
        candidates = np.nonzero(self._hashes[np.minimum(found, self._hashes.size - 1)] == hashes)[0]
        as_list = None
        for position in candidates.tolist():
            as_list = as_list or [int(v) for v in values]
            for sequence in self._by_key.get(tuple(as_list[position:position + self._key]), ()):
                if tuple(as_list[position:position + len(sequence)]) == sequence:
                    return (position, len(sequence), *self._sequences[sequence])
        return None


class Denylist:
    """The sequences of a denylist file, checked against documents."""

    def __init__(self, path: str | Path, tokenizer_sha256: str) -> None:
        """Read and check ``path``; a one-line :class:`UserError` naming the file and field when it
        is not a denylist, was written for another tokenizer than ``tokenizer_sha256``, or folds
        words by other rules than this mimir's."""
        self.path = Path(path)
        if not self.path.is_file():
            raise UserError(f"denylist not found: {self.path}")
        try:
            body = json.loads(self.path.read_text())
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise UserError(f"{self.path}: not a denylist (invalid JSON: {exc})") from None
        if not isinstance(body, dict) or body.get("format") not in READABLE:
            found = body.get("format") if isinstance(body, dict) else type(body).__name__
            raise UserError(f"{self.path}: format: expected {FORMAT!r}, found {found!r}")
        sha = (body.get("tokenizer") or {}).get("sha256")
        if sha != tokenizer_sha256:
            raise UserError(
                f"{self.path}: tokenizer.sha256 is {str(sha)[:12]}..., but this tokenizer's is "
                f"{tokenizer_sha256[:12]}...: the denylist was written for another tokenizer"
            )
        self.ngram = body.get("ngram")
        self.sha256 = hashlib.sha256(self.path.read_bytes()).hexdigest()
        tokens: dict[tuple[int, ...], tuple[str, str]] = {}
        words: dict[tuple[int, ...], tuple[str, str]] = {}
        for i, entry in enumerate(body.get("entries") if isinstance(body.get("entries"), list) else [None]):
            key, values, window = self._checked(entry, i)
            into = words if key == "words" else tokens
            for start in range(len(values) - window + 1):
                into.setdefault(tuple(values[start:start + window]),
                                (str(entry.get("benchmark", "?")), str(entry.get("item", "?"))))
        if words and body.get("words") != WORD_FORM:
            raise UserError(f"{self.path}: words: the word entries were folded by {body.get('words')!r}, "
                            f"this mimir folds by {WORD_FORM!r}: run `mimir audit contamination` again")
        self._tokens, self._words = _Sequences(tokens), _Sequences(words)
        self._numbers = WordNumbers() if words else None

    def _checked(self, entry, i: int) -> tuple[str, list[int], int]:
        where = f"{self.path}: entries[{i}]"
        if not isinstance(entry, dict):
            raise UserError(f"{self.path}: entries: expected a list of objects")
        key = "words" if "words" in entry else "ids"
        values, window = entry.get(key), entry.get("window")
        if not (isinstance(values, list) and values and all(isinstance(t, int) and t >= 0 for t in values)):
            what = "word numbers" if key == "words" else "token ids"
            raise UserError(f"{where}.{key}: expected a non-empty list of {what}")
        if not (isinstance(window, int) and 1 <= window <= len(values)):
            raise UserError(f"{where}.window: expected an integer from 1 to len({key}) = {len(values)}")
        return key, values, window

    def __len__(self) -> int:
        return len(self._tokens) + len(self._words)

    @property
    def reads_text(self) -> bool:
        """Whether matching needs each document's text (the denylist has word entries)."""
        return len(self._words) > 0

    def first_hit(self, ids, text: Callable[[], str] | None = None) -> DenylistHit | None:
        """The first denylisted sequence in a document: its token ids ``ids``, then (word entries)
        the folded words of its text, ``text()`` (:func:`~.normalise.document_text` of ``ids``,
        asked for only when needed); None when there is none."""
        found = self._tokens.first(ids)
        if found is not None:
            return DenylistHit(*found)
        if self._numbers is not None:
            if text is None:
                raise ValueError("this denylist has word entries: first_hit needs the document's text")
            found = self._words.first(self._numbers(text()))
            if found is not None:
                return DenylistHit(*found, unit="word")
        return None
