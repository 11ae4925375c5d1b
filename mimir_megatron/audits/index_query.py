"""Querying an audit index: match lengths, counts, hit locations and documents read back, over the
files :mod:`.index_build` wrote (format: :mod:`.index_format`)."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from mimir_megatron.errors import UserError

from .index_format import (
    SEPARATOR,
    SYMBOLS_PER_TOKEN,
    WORDS_DIR,
    IndexMetadata,
    common_tokenizer,
    decode_symbols,
    encode_tokens,
    recorded_longest_document,
    shard_file,
    tokenizer_of,
)
from .normalise import WORD_FORM
from .sources import AuditSource


@dataclass(frozen=True)
class Hit:
    """One occurrence of a span: source dataset, document within it, offset in the document
    (the document being its prefix followed by its response), in tokens or, for a span of the
    word stream, in words."""

    source: str
    category: str
    document: int
    offset: int
    unit: str = "token"
    """``token`` or ``word`` (a hit of the word stream)."""


class AuditIndex:
    """Read side of an index directory: match lengths, counts and hit locations."""

    def __init__(self, path: str | Path, prefetch: bool = False) -> None:
        """``prefetch``: infini-gram's read-ahead of the suffix-array search (its default). It pays
        off only for an index that is not in page cache; on one that is, it costs 5x the CPU per
        lookup (20M-token index: 405-460 us with it, 79-82 us without, same counts)."""
        self.path = Path(path)
        self.metadata = IndexMetadata.read(self.path)
        shards = self.metadata.shards
        missing = [s.id for s in shards if not shard_file(self.path, "shard", s.id).is_file()]
        if missing:
            raise UserError(f"{self.path}: shards {missing} unfinished; rerun `mimir audit index` to finish")
        self.encoding: str = self.metadata.encoding
        self._width = SYMBOLS_PER_TOKEN[self.encoding]
        # the engine numbers documents globally over shards in order; map back through the units
        units = [u for s in shards for u in s.units]
        self._unit_source = np.array([u.source for u in units], dtype=np.int64)
        self._unit_first = np.array([u.first_document for u in units], dtype=np.int64)
        self._unit_start = np.concatenate([[0], np.cumsum([u.documents for u in units])]).astype(np.int64)
        self._shard_first_doc = np.concatenate([[0], np.cumsum([s.documents for s in shards])])
        self._arrays: dict[int, tuple[np.ndarray, np.ndarray, int]] = {}
        self._prefetch = prefetch
        self._engine = _engine(self.path, prefetch)
        self._words: _WordStream | None = None

    @property
    def audit_sources(self) -> list[AuditSource]:
        """The indexed datasets as audit sources (name, prepared directory, audit group)."""
        return [AuditSource(s.name, Path(s.path), s.category) for s in self.metadata.sources]

    @property
    def num_documents(self) -> int:
        return int(self._unit_start[-1])

    @property
    def num_tokens(self) -> int:
        return self.metadata.total_tokens

    @property
    def tokenizer(self) -> dict | None:
        """``{"sha256", "path"}`` of the tokenizer the indexed datasets were prepared with; an index
        built before this was recorded answers from its sources' manifests (None if none says)."""
        if self.metadata.tokenizer_recorded:
            return self.metadata.tokenizer
        from mimir_megatron.data.manifest import Manifest

        named = []
        for s in self.metadata.sources:
            try:
                manifest = Manifest.read(s.path)
            except UserError:
                continue
            named.append((s.name, tokenizer_of(manifest)))
        return common_tokenizer(named)

    @property
    def longest_document(self) -> int:
        """Tokens in the longest indexed document: no longer span can match."""
        longest = 0
        for shard in self.metadata.shards:
            recorded = recorded_longest_document(self.path, shard.id)
            if recorded is not None:
                longest = max(longest, recorded)
            else:  # built before the figure was recorded: from the document offsets
                _, offsets, _ = self._shard_arrays(shard.id)
                size = shard_file(self.path, "tokenized", shard.id).stat().st_size
                symbols = np.diff(np.append(offsets, size)) // 2 - 1
                longest = max(longest, int(symbols.max(initial=0)) // self._width)
        return longest

    def document_tokens(self, source: str, document: int) -> np.ndarray:
        """The token ids of ``document`` of dataset ``source`` (prefix then response), read back
        from the index's own files (the prepared dataset need not be present)."""
        names = [s.name for s in self.metadata.sources]
        if source not in names:
            raise KeyError(source)
        si = names.index(source)
        unit = np.nonzero((self._unit_source == si) & (self._unit_first <= document)
                          & (document < self._unit_first + np.diff(self._unit_start)))[0]
        if unit.size == 0:
            raise IndexError(f"document {document} of {source} is not in the index")
        doc_ix = int(self._unit_start[unit[0]] + document - self._unit_first[unit[0]])
        shard = int(np.searchsorted(self._shard_first_doc, doc_ix, side="right") - 1)
        local = doc_ix - int(self._shard_first_doc[shard])
        _, offsets, _ = self._shard_arrays(shard)
        end = int(offsets[local + 1]) if local + 1 < offsets.size else \
            shard_file(self.path, "tokenized", shard).stat().st_size
        symbols = np.fromfile(shard_file(self.path, "tokenized", shard), dtype=np.uint16,
                              count=(end - int(offsets[local])) // 2 - 1, offset=int(offsets[local]) + 2)
        return decode_symbols(symbols, self.encoding)

    def documents_per_category(self) -> dict[str, int]:
        counts: dict[str, int] = {}
        for s in self.metadata.sources:
            counts[s.category] = counts.get(s.category, 0) + s.documents
        return counts

    def _symbols(self, ids) -> list[int]:
        return encode_tokens(np.asarray(ids, dtype=np.int64), self.encoding).tolist()

    def match_lengths(self, ids) -> np.ndarray:
        """For each position i: the longest L such that ids[i:i+L] occurs inside one document.

        Matching statistics with at most 2 len(ids) exact-match lookups: if ids[i:r] occurs, so
        does ids[i+1:r], so the end r never moves back. (infini-gram's own ``creativity`` query
        computes the same thing but under-reports inside runs of a repeated token; the
        brute-force property test caught it.)
        """
        symbols = self._symbols(ids)
        n, w = len(symbols) // self._width, self._width
        out = np.zeros(n, dtype=np.int64)
        end = 0
        for i in range(n):
            end = max(end, i)
            while end < n and self._occurs(symbols[i * w:(end + 1) * w]):
                end += 1
            out[i] = end - i
        return out

    def _occurs(self, symbols: list[int]) -> bool:
        return self._engine.find(symbols)["cnt"] > 0

    def occurs(self, ids) -> bool:
        """Whether ``ids`` (non-empty) occurs inside one document: one lookup."""
        return self._occurs(self._symbols(ids))

    def longest_match(self, ids) -> tuple[int, int]:
        """(start, length) of the longest span of ``ids`` found in any document (first on ties)."""
        lengths = self.match_lengths(ids)
        if lengths.size == 0:
            return 0, 0
        start = int(np.argmax(lengths))
        return start, int(lengths[start])

    def longest_matches(self, outputs: list[list[int]], workers: int | None = None) -> list[tuple[int, int]]:
        """:meth:`longest_match` of many outputs on a thread pool (the engine releases the GIL)."""
        from concurrent.futures import ThreadPoolExecutor

        workers = workers or max(1, len(os.sched_getaffinity(0)))
        if workers == 1 or len(outputs) < 2:
            return [self.longest_match(o) for o in outputs]
        with ThreadPoolExecutor(workers) as pool:
            return list(pool.map(self.longest_match, outputs))

    def count(self, ids) -> int:
        """How many times ``ids`` occurs in the indexed documents."""
        ids = list(ids)
        if not ids:
            return self.num_tokens
        return int(self._engine.count(self._symbols(ids))["count"])

    def locate(self, ids, limit: int = 100) -> list[Hit]:
        """Up to ``limit`` occurrences of ``ids``, in suffix-array order (deterministic)."""
        ids = list(ids)
        if not ids or limit <= 0:
            return []
        found = self._engine.find(self._symbols(ids))
        hits: list[Hit] = []
        for shard, (lo, hi) in enumerate(found["segment_by_shard"]):
            take = min(hi - lo, limit - len(hits))
            if take > 0:
                hits.extend(self._hits_at(shard, lo, lo + take))
            if len(hits) >= limit:
                break
        return hits

    def _shard_arrays(self, shard: int) -> tuple[np.ndarray, np.ndarray, int]:
        if shard not in self._arrays:
            self._arrays[shard] = _shard_arrays(self.path, shard)
        return self._arrays[shard]

    def _hits_at(self, shard: int, lo: int, hi: int) -> list[Hit]:
        """The hits of suffix-array ranks [lo, hi) of one shard, read from its table."""
        docs, symbol_offsets = _pointed(self._shard_arrays(shard), lo, hi)
        first = self._shard_first_doc[shard]
        return [self._hit(int(first + d), int(o) // self._width) for d, o in zip(docs, symbol_offsets)]

    def _hit(self, doc_ix: int, offset: int, unit: str = "token") -> Hit:
        at = int(np.searchsorted(self._unit_start, doc_ix, side="right") - 1)
        source = self.metadata.sources[int(self._unit_source[at])]
        document = int(self._unit_first[at] + doc_ix - self._unit_start[at])
        return Hit(source.name, source.category, document, offset, unit)

    # --- the word stream (:mod:`.normalise`) ---------------------------------------------------

    def words(self) -> _WordStream:
        """The index's word stream; a one-line UserError naming the index when it has none (built
        by an older mimir, or without its tokenizer) or folds words by other rules than these."""
        if self._words is None:
            recorded = (self.metadata.words or {}).get("form")
            if recorded is None:
                why = ("was built before indexes had a word stream" if not self.metadata.words_recorded
                       else "has no word stream (the datasets' tokenizer was not there when it was built)")
                raise UserError(f"{self.path}: the index {why}; rebuild it with `mimir audit index` to check "
                                "contamination")
            if recorded != WORD_FORM:
                raise UserError(f"{self.path}: the index's word stream folds words by {recorded!r}, this "
                                f"mimir by {WORD_FORM!r}; rebuild it with `mimir audit index`")
            self._words = _WordStream(self)
        return self._words


class _WordStream:
    """Matching and hit locations over an index's word stream: the same documents, as numbers of
    folded words (:mod:`.normalise`, ``u16x2`` symbols, two per word)."""

    def __init__(self, index: AuditIndex) -> None:
        self.index = index
        self.path = index.path / WORDS_DIR
        self._engine = _engine(self.path, index._prefetch)
        self._arrays: dict[int, tuple[np.ndarray, np.ndarray, int]] = {}

    def _occurs(self, symbols: list[int]) -> bool:
        return self._engine.find(symbols)["cnt"] > 0

    def match_lengths(self, words: list[int]) -> np.ndarray:
        """For each position i: the longest L such that words[i:i+L] occurs inside one document
        (matching statistics, at most 2 len(words) lookups, as :meth:`AuditIndex.match_lengths`)."""
        symbols = encode_tokens(np.asarray(words, dtype=np.int64), "u16x2").tolist()
        n = len(words)
        out = np.zeros(n, dtype=np.int64)
        end = 0
        for i in range(n):
            end = max(end, i)
            while end < n and self._occurs(symbols[2 * i:2 * (end + 1)]):
                end += 1
            out[i] = end - i
        return out

    def locate(self, words, limit: int = 100) -> list[Hit]:
        """Up to ``limit`` occurrences of the word run ``words`` (offsets in words)."""
        words = list(words)
        if not words or limit <= 0:
            return []
        found = self._engine.find(encode_tokens(np.asarray(words, dtype=np.int64), "u16x2").tolist())
        hits: list[Hit] = []
        for shard, (lo, hi) in enumerate(found["segment_by_shard"]):
            take = min(hi - lo, limit - len(hits))
            if take > 0:
                if shard not in self._arrays:
                    self._arrays[shard] = _shard_arrays(self.path, shard)
                docs, symbol_offsets = _pointed(self._arrays[shard], lo, lo + take)
                first = self.index._shard_first_doc[shard]
                hits += [self.index._hit(int(first + d), int(o) // 2, "word")
                         for d, o in zip(docs, symbol_offsets)]
            if len(hits) >= limit:
                break
        return hits


def _engine(directory: Path, prefetch: bool):
    from infini_gram.engine import InfiniGramEngine

    depth = {} if prefetch else {"ds_prefetch_depth": 0, "sa_prefetch_depth": 0, "od_prefetch_depth": 0}
    return InfiniGramEngine(index_dir=str(directory), eos_token_id=0, vocab_size=SEPARATOR, version=4,
                            token_dtype="u16", **depth)


def _shard_arrays(directory: Path, shard: int) -> tuple[np.ndarray, np.ndarray, int]:
    """A shard's suffix array (memory-mapped), its documents' byte offsets, bytes per pointer."""
    table = np.memmap(shard_file(directory, "table", shard), dtype=np.uint8, mode="r")
    size = shard_file(directory, "tokenized", shard).stat().st_size
    offsets = np.fromfile(shard_file(directory, "offset", shard), dtype=np.uint64).astype(np.int64)
    return table, offsets, table.size // (size // 2)


def _pointed(arrays: tuple[np.ndarray, np.ndarray, int], lo: int, hi: int) -> tuple[np.ndarray, np.ndarray]:
    """(document within the shard, symbol offset within it) of suffix-array ranks [lo, hi)."""
    table, offsets, ratio = arrays
    raw = np.asarray(table[lo * ratio:hi * ratio]).reshape(-1, ratio).astype(np.int64)
    pointers = (raw << (8 * np.arange(ratio, dtype=np.int64))).sum(axis=1)  # little-endian bytes
    docs = np.searchsorted(offsets, pointers, side="right") - 1
    return docs, (pointers - offsets[docs]) // 2 - 1  # after the separator
