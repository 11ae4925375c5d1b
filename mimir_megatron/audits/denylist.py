"""Denylists: benchmark text found in the training data, as token ids, for `mimir prepare --denylist`.

``mimir audit contamination --denylist FILE`` writes one; ``mimir prepare --denylist FILE`` drops
every document (prefix then response, the token ids the index holds) that contains one of its
sequences, and counts it as a ``benchmark_overlap`` reject. The sequences are the exact token runs
the contamination audit found in training documents, so a re-prepare with the same tokenizer
drops exactly the documents the audit reported. Layout::

    {"format": "mimir-denylist-v1",
     "tokenizer": {"sha256": "...", "path": "..."},      # as prepared manifests record it
     "ngram": 13,
     "source": {...},                                    # suite, index, report (for the record)
     "entries": [{"ids": [...], "window": 13, "benchmark": "boolq", "item": "12", "part": "prompt"}]}

An entry stands for every run of ``window`` consecutive ids in ``ids`` (an exact overlap of n
tokens and more is stored once, not as one n-gram per position; a re-spaced overlap is one
sequence, ``window == len(ids)``). Numpy only: prepare's workers import this.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from mimir_megatron.errors import UserError
from mimir_megatron.integrity import write_json_atomic

FORMAT = "mimir-denylist-v1"


@dataclass(frozen=True)
class DenylistHit:
    """Where a document meets a denylisted sequence."""

    position: int
    length: int
    benchmark: str
    item: str

    def describe(self, path: str | Path) -> str:
        return (f"{self.length} tokens at token {self.position} are benchmark {self.benchmark} item "
                f"{self.item} (denylist {path})")


def write_denylist(path: str | Path, tokenizer: dict, ngram: int, entries: list[dict], source: dict) -> Path:
    """Write the denylist JSON atomically; ``entries`` as in the module docstring."""
    path = Path(path)
    body = {"format": FORMAT, "tokenizer": {"sha256": tokenizer["sha256"], "path": tokenizer.get("path")},
            "ngram": ngram, "source": source, "entries": entries}
    path.parent.mkdir(parents=True, exist_ok=True)
    return write_json_atomic(path, body, indent=None)


class Denylist:
    """The sequences of a denylist file, checked against documents' token ids."""

    def __init__(self, path: str | Path, tokenizer_sha256: str) -> None:
        """Read and check ``path``; a one-line :class:`UserError` naming the file and field when it
        is not a denylist or was written for another tokenizer than ``tokenizer_sha256``."""
        self.path = Path(path)
        if not self.path.is_file():
            raise UserError(f"denylist not found: {self.path}")
        try:
            body = json.loads(self.path.read_text())
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise UserError(f"{self.path}: not a denylist (invalid JSON: {exc})") from None
        if not isinstance(body, dict) or body.get("format") != FORMAT:
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
        self._sequences: dict[tuple[int, ...], tuple[str, str]] = {}
        for i, entry in enumerate(body.get("entries") if isinstance(body.get("entries"), list) else [None]):
            ids, window = self._checked(entry, i)
            for start in range(len(ids) - window + 1):
                self._sequences.setdefault(tuple(ids[start:start + window]),
                                           (str(entry.get("benchmark", "?")), str(entry.get("item", "?"))))
        self._key = min((len(s) for s in self._sequences), default=0)
        by_key: dict[tuple[int, ...], list[tuple[int, ...]]] = {}
        for sequence in self._sequences:
            by_key.setdefault(sequence[:self._key], []).append(sequence)
        self._by_key = by_key
        rng = np.random.default_rng(0)
        self._weights = rng.integers(1, 2**62, size=self._key, dtype=np.uint64) | np.uint64(1)
        keys = np.array(list(by_key), dtype=np.uint64).reshape(len(by_key), self._key)
        self._hashes = np.sort(self._hash(keys))

    def _checked(self, entry, i: int) -> tuple[list[int], int]:
        where = f"{self.path}: entries[{i}]"
        if not isinstance(entry, dict):
            raise UserError(f"{self.path}: entries: expected a list of objects")
        ids, window = entry.get("ids"), entry.get("window")
        if not (isinstance(ids, list) and ids and all(isinstance(t, int) and t >= 0 for t in ids)):
            raise UserError(f"{where}.ids: expected a non-empty list of token ids")
        if not (isinstance(window, int) and 1 <= window <= len(ids)):
            raise UserError(f"{where}.window: expected an integer from 1 to len(ids) = {len(ids)}")
        return ids, window

    def __len__(self) -> int:
        return len(self._sequences)

    def _hash(self, windows: np.ndarray) -> np.ndarray:
        return (windows * self._weights).sum(axis=1, dtype=np.uint64)

    def first_hit(self, ids) -> DenylistHit | None:
        """The first denylisted sequence in ``ids`` (one document's token ids), or None."""
        if not self._sequences or len(ids) < self._key:
            return None
        tokens = np.asarray(ids, dtype=np.uint64)
        hashes = self._hash(np.lib.stride_tricks.sliding_window_view(tokens, self._key))
        found = np.searchsorted(self._hashes, hashes)
        candidates = np.nonzero(self._hashes[np.minimum(found, self._hashes.size - 1)] == hashes)[0]
        as_list = None
        for position in candidates.tolist():
            as_list = as_list or [int(t) for t in ids]
            for sequence in self._by_key.get(tuple(as_list[position:position + self._key]), ()):
                if tuple(as_list[position:position + len(sequence)]) == sequence:
                    benchmark, item = self._sequences[sequence]
                    return DenylistHit(position, len(sequence), benchmark, item)
        return None
