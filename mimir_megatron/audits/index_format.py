"""The audit index's on-disk format: the layout of its directory, the symbol encoding of token
ids, and its metadata record (:class:`IndexMetadata`, one validating ``read``, one ``write``).
:mod:`.index_build` writes an index, :mod:`.index_query` answers questions about one.

Layout of an index directory (infini-gram's v4 layout plus our metadata)::

    audit_index.json     format, symbol encoding, tokenizer, sources, shard plan (which documents)
    tokenized.S          the shard's documents as uint16 symbols, each preceded by 0xFFFF
    offset.S             uint64 byte offset of each document's separator in tokenized.S
    table.S              the suffix array of tokenized.S (infini-gram's ``rust_indexing``)
    words/tokenized.S    the word stream: the same documents as folded words
    words/offset.S       (:mod:`.normalise`), each word a number in the u16x2 encoding, the
    words/table.S        same document order; what the contamination check matches
    shard.S.json         written last: the shard is complete (a rerun skips it); its longest document

Token ids are read straight from the ``.bin``/``.idx`` files (no re-tokenisation); the word
stream decodes them with the datasets' tokenizer (the record's ``words`` names its folding rules,
:data:`~.normalise.WORD_FORM`; null when the tokenizer was not there to read the documents). A document is
the prefix followed by the response. The separator never occurs inside a document and never in a
query, so a match cannot span two documents; every hit maps back to (dataset, document, offset).

Symbol encodings: ``u16`` (ids < 65,535: one symbol per token) and ``u16x2`` (larger vocabularies
such as Gemma's 262,144: a token is two symbols, high half 0x8000 + id // 0x8000 then low half
id % 0x8000; a query always starts on a high symbol, which occurs only at a token's first symbol,
so every match is token-aligned). infini-gram also has a ``u32`` mode, but its suffix-array builder
allocates a 2^32-entry bucket table (32 GiB) per job, so two u16 symbols per token are cheaper.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from mimir_megatron.data.manifest import Manifest
from mimir_megatron.errors import UserError
from mimir_megatron.integrity import digest_matches, json_digest, write_json_atomic

FORMAT = "mimir-audit-index-v1"
META_NAME = "audit_index.json"
FINGERPRINT_KEY = "fingerprint"
SEPARATOR = 0xFFFF
_HIGH = 0x8000
MAX_TOKEN_ID = {"u16": SEPARATOR - 1, "u16x2": (SEPARATOR - _HIGH) * _HIGH - 1}
SYMBOLS_PER_TOKEN = {"u16": 1, "u16x2": 2}


WORDS_DIR = "words"
"""The word stream's subdirectory (its own tokenized, offset and table files per shard)."""


def shard_file(directory: Path, kind: str, shard: int) -> Path:
    """A shard's file: ``kind`` is tokenized, offset or table (its data), or shard (``shard.S.json``,
    its completion record). The word stream's files: ``shard_file(directory / WORDS_DIR, ...)``."""
    return directory / (f"shard.{shard}.json" if kind == "shard" else f"{kind}.{shard}")


def write_shard_record(directory: Path, shard: IndexShard, longest_document: int, seconds: float) -> Path:
    """``shard.S.json``, written last: the shard is complete; its longest document (tokens)."""
    return write_json_atomic(shard_file(directory, "shard", shard.id),
                             {"id": shard.id, "documents": shard.documents, "tokens": shard.tokens,
                              "longest_document": longest_document, "seconds": round(seconds, 3)}, indent=1)


def recorded_longest_document(directory: Path, shard: int) -> int | None:
    """The longest document a complete shard's record names (None: built before it was recorded)."""
    done = json.loads(shard_file(directory, "shard", shard).read_bytes())
    return done.get("longest_document") if isinstance(done, dict) else None


# --- symbols ----------------------------------------------------------------------------------


def encode_tokens(ids: np.ndarray, encoding: str) -> np.ndarray:
    """Token ids as uint16 symbols (see the module docstring); no separators."""
    ids = np.asarray(ids, dtype=np.int64)
    if ids.size and (ids.min() < 0 or ids.max() > MAX_TOKEN_ID[encoding]):
        raise UserError(
            f"token id {int(ids.max() if ids.max() > 0 else ids.min())} outside the index's "
            f"{encoding} encoding (0..{MAX_TOKEN_ID[encoding]})"
        )
    if encoding == "u16":
        return ids.astype(np.uint16)
    out = np.empty(2 * ids.size, dtype=np.uint16)
    out[0::2] = _HIGH + ids // _HIGH
    out[1::2] = ids % _HIGH
    return out


def decode_symbols(symbols: np.ndarray, encoding: str) -> np.ndarray:
    """The inverse of :func:`encode_tokens`: token ids (int64) of separator-free symbols."""
    symbols = np.asarray(symbols, dtype=np.int64)
    if encoding == "u16":
        return symbols
    return (symbols[0::2] - _HIGH) * _HIGH + symbols[1::2]


def encode_documents(tokens: np.ndarray, lengths: np.ndarray, encoding: str) -> np.ndarray:
    """Concatenated documents (``lengths`` tokens each) as symbols, a separator before each."""
    symbols = encode_tokens(tokens, encoding)
    width = SYMBOLS_PER_TOKEN[encoding]
    n_docs = len(lengths)
    out = np.empty(symbols.size + n_docs, dtype=np.uint16)
    starts = np.zeros(n_docs, dtype=np.int64)
    if n_docs:
        starts[1:] = np.cumsum(lengths[:-1].astype(np.int64) * width + 1)
    out[starts] = SEPARATOR
    keep = np.ones(out.size, dtype=bool)
    keep[starts] = False
    out[keep] = symbols
    return out


# --- the datasets' tokenizer ------------------------------------------------------------------


def tokenizer_of(manifest: Manifest) -> dict | None:
    """``{"sha256", "path"}`` of the tokenizer a prepared dataset's manifest names (None: none)."""
    tokenizer = manifest.tokenizer
    return {"sha256": tokenizer.sha256, "path": tokenizer.path} if tokenizer.sha256 else None


def common_tokenizer(named: list[tuple[str, dict | None]]) -> dict | None:
    """The tokenizer every dataset (name, its tokenizer) was prepared with (None when none names
    one). Token ids of two tokenizers in one index would match each other by accident, so that
    is refused."""
    known: dict[str, tuple[str, dict]] = {}
    for name, tokenizer in named:
        if tokenizer:
            known.setdefault(tokenizer["sha256"], (name, tokenizer))
    if len(known) > 1:
        names = ", ".join(f"{name} ({sha[:12]})" for sha, (name, _) in known.items())
        raise UserError(f"the sources were prepared with different tokenizers: {names}; "
                        "index each separately")
    return next(iter(known.values()))[1] if known else None


# --- the metadata record ----------------------------------------------------------------------


@dataclass(frozen=True)
class ShardUnit:
    """A run of consecutive documents of one prepared shard file (stored as a list of five ints)."""

    source: int
    """The position of its dataset in :attr:`IndexMetadata.sources`."""
    file: int
    """The dataset's prepared shard file."""
    first_document: int
    """Its first document, counted within the dataset."""
    documents: int
    tokens: int

    def to_json(self) -> list[int]:
        return [self.source, self.file, self.first_document, self.documents, self.tokens]


@dataclass(frozen=True)
class IndexShard:
    """One index shard: whole prepared shard files, in order."""

    id: int
    documents: int
    tokens: int
    units: tuple[ShardUnit, ...]

    def to_json(self) -> dict[str, Any]:
        return {"id": self.id, "documents": self.documents, "tokens": self.tokens,
                "units": [u.to_json() for u in self.units]}


@dataclass(frozen=True)
class IndexedSource:
    """One prepared dataset the index holds, as it was when indexed."""

    name: str
    path: str
    category: str
    """Its audit group."""
    documents: int
    tokens: int
    outputs: dict[str, Any]
    """Its manifest's ``outputs`` when indexed: whether the manifest still describes these files."""
    tokenizer: dict | None = None
    """``{"sha256", "path"}`` of the tokenizer its manifest names (None: none)."""

    def to_json(self, with_tokenizer: bool = True) -> dict[str, Any]:
        body = {"name": self.name, "path": self.path, "category": self.category, "documents": self.documents,
                "tokens": self.tokens, "outputs": self.outputs}
        return body | {"tokenizer": self.tokenizer} if with_tokenizer else body


@dataclass(frozen=True)
class IndexMetadata:
    """``audit_index.json``: what an index holds and how it is cut into shards, fingerprinted.

    The fingerprint is :func:`~mimir_megatron.integrity.json_digest` of the rest of the record
    (the same value as the rule of the indexes written before the integrity module whenever the
    record is ASCII; a record with non-ASCII content written by that rule is still accepted by
    :func:`~mimir_megatron.integrity.digest_matches`, and its stored fingerprint is kept)."""

    encoding: str
    sources: tuple[IndexedSource, ...]
    shards: tuple[IndexShard, ...]
    tokenizer: dict | None = None
    """The tokenizer every indexed dataset was prepared with (None: no manifest names one)."""
    tokenizer_recorded: bool = True
    """False for an index built before the tokenizer was recorded (its record has no such keys;
    the query side then asks the datasets' manifests)."""
    words: dict | None = None
    """``{"form": WORD_FORM}``: the index holds the word stream, folded by those rules; None: it
    does not (the tokenizer was not there to read the documents)."""
    words_recorded: bool = True
    """False for an index built before the word stream existed (no ``words`` key): the
    memorisation audits read it, the contamination check asks for a rebuild."""
    fingerprint: str = field(default="", compare=False)

    @classmethod
    def new(cls, encoding: str, sources: list[IndexedSource], shards: list[IndexShard],
            tokenizer: dict | None, words: dict | None = None) -> IndexMetadata:
        """A record of a new shard plan, fingerprinted."""
        unsealed = cls(encoding, tuple(sources), tuple(shards), tokenizer, words=words)
        return cls(encoding, tuple(sources), tuple(shards), tokenizer, words=words,
                   fingerprint=json_digest(unsealed.body()))

    def body(self) -> dict[str, Any]:
        """The record without its fingerprint (what the fingerprint covers)."""
        head: dict[str, Any] = {"format": FORMAT, "encoding": self.encoding}
        if self.tokenizer_recorded:
            head["tokenizer"] = self.tokenizer
        if self.words_recorded:
            head["words"] = self.words
        return head | {"sources": [s.to_json(self.tokenizer_recorded) for s in self.sources],
                       "shards": [s.to_json() for s in self.shards]}

    def to_json(self) -> dict[str, Any]:
        return self.body() | {FINGERPRINT_KEY: self.fingerprint}

    def same_plan(self, other: IndexMetadata) -> bool:
        """Whether ``other`` describes the same data cut into the same shards (compared by content,
        so a record fingerprinted by the older rule compares equal to its rebuilt plan)."""
        return self.body() == other.body()

    @property
    def total_tokens(self) -> int:
        return sum(s.tokens for s in self.shards)

    def write(self, directory: str | Path) -> Path:
        """Write the record as ``directory/audit_index.json`` (atomically); the path written."""
        return write_json_atomic(Path(directory) / META_NAME, self.to_json(), indent=1)

    @classmethod
    def read(cls, directory: str | Path) -> IndexMetadata:
        """The record of the index in ``directory``, validated: its format (version), every field
        and its type, and its fingerprint. Anything else is refused with one line naming the file."""
        path = Path(directory) / META_NAME
        if not path.is_file():
            raise UserError(f"{Path(directory)}: not an audit index ({META_NAME} missing); "
                            "run `mimir audit index`")
        try:
            raw = json.loads(path.read_bytes())
        except (OSError, UnicodeDecodeError, ValueError) as exc:
            raise UserError(f"{path}: not a readable index record ({' '.join(str(exc).split())})") from None
        try:
            return _parse(raw)
        except _Invalid as exc:
            raise UserError(f"{path}: {exc}; rebuild the index with `mimir audit index`") from None


class _Invalid(Exception):
    """One line: what is wrong with the record."""


def _parse(raw: Any) -> IndexMetadata:
    if not isinstance(raw, dict):
        raise _Invalid(f"holds {type(raw).__name__}, not an index record")
    if raw.get("format") != FORMAT:
        raise _Invalid(f"format {raw.get('format')!r}, expected {FORMAT!r}")
    encoding = _get(raw, "encoding", str, "")
    if encoding not in SYMBOLS_PER_TOKEN:
        raise _Invalid(f"encoding {encoding!r} is not one of {', '.join(SYMBOLS_PER_TOKEN)}")
    recorded = "tokenizer" in raw
    sources = tuple(_source(s, f"sources[{i}].", recorded)
                    for i, s in enumerate(_get(raw, "sources", list, "")))
    shards = tuple(_shard(s, f"shards[{i}].", len(sources))
                   for i, s in enumerate(_get(raw, "shards", list, "")))
    if not shards:
        raise _Invalid("shards is empty")
    if [s.id for s in shards] != list(range(len(shards))):
        raise _Invalid(f"shard ids {[s.id for s in shards]} are not 0..{len(shards) - 1} in order")
    tokenizer = _tokenizer(raw.get("tokenizer"), "tokenizer") if recorded else None
    words = raw.get("words")
    if words is not None and not (isinstance(words, dict) and isinstance(words.get("form"), str)):
        raise _Invalid(f"words must be null or {{form: string}}, got {words!r}")
    fingerprint = _get(raw, FINGERPRINT_KEY, str, "")
    if not digest_matches(raw, exclude=FINGERPRINT_KEY):
        raise _Invalid(f"{FINGERPRINT_KEY} {fingerprint[:12]}... does not match the content "
                       "(edited or damaged)")
    return IndexMetadata(encoding, sources, shards, tokenizer, recorded, words, "words" in raw,
                         fingerprint)


def _get(record: dict, key: str, kind: type, where: str) -> Any:
    if key not in record:
        raise _Invalid(f"{where}{key} is missing")
    value = record[key]
    if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
        raise _Invalid(f"{where}{key} must be {_KINDS[kind]}, got {value!r}")
    return value


_KINDS = {str: "a string", int: "an integer", list: "a list", dict: "a mapping"}


def _mapping(value: Any, where: str) -> dict:
    if not isinstance(value, dict):
        raise _Invalid(f"{where.rstrip('.')} must be a mapping, got {value!r}")
    return value


def _source(value: Any, where: str, recorded: bool) -> IndexedSource:
    s = _mapping(value, where)
    return IndexedSource(
        name=_get(s, "name", str, where), path=_get(s, "path", str, where),
        category=_get(s, "category", str, where), documents=_get(s, "documents", int, where),
        tokens=_get(s, "tokens", int, where), outputs=_get(s, "outputs", dict, where),
        tokenizer=_tokenizer(s.get("tokenizer"), f"{where}tokenizer") if recorded else None,
    )


def _shard(value: Any, where: str, n_sources: int) -> IndexShard:
    s = _mapping(value, where)
    units = []
    for i, unit in enumerate(_get(s, "units", list, where)):
        if not (isinstance(unit, list) and len(unit) == 5
                and all(isinstance(n, int) and not isinstance(n, bool) and n >= 0 for n in unit)):
            raise _Invalid(f"{where}units[{i}] must be five counts [source, file, first document, "
                           f"documents, tokens], got {unit!r}")
        if unit[0] >= n_sources:
            raise _Invalid(f"{where}units[{i}] names source {unit[0]}, but there are {n_sources}")
        units.append(ShardUnit(*unit))
    return IndexShard(id=_get(s, "id", int, where), documents=_get(s, "documents", int, where),
                      tokens=_get(s, "tokens", int, where), units=tuple(units))


def _tokenizer(value: Any, where: str) -> dict | None:
    if value is None:
        return None
    if not (isinstance(value, dict) and isinstance(value.get("sha256"), str)
            and isinstance(value.get("path"), (str, type(None)))):
        raise _Invalid(f"{where} must be null or {{sha256: string, path: string or null}}, got {value!r}")
    return value
