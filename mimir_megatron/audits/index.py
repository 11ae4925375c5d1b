"""An exact-match index over the token ids of prepared datasets (infini-gram suffix arrays).

Layout of an index directory (infini-gram's v4 layout plus our metadata)::

    audit_index.json     format, symbol encoding, tokenizer, sources, shard plan (which documents)
    tokenized.S          the shard's documents as uint16 symbols, each preceded by 0xFFFF
    offset.S             uint64 byte offset of each document's separator in tokenized.S
    table.S              the suffix array of tokenized.S (infini-gram's ``rust_indexing``)
    shard.S.json         written last: the shard is complete (a rerun skips it); its longest document

Token ids are read straight from the ``.bin``/``.idx`` files (no re-tokenisation). A document is
the prefix followed by the response. The separator never occurs inside a document and never in a
query, so a match cannot span two documents; every hit maps back to (dataset, document, offset).

Symbol encodings: ``u16`` (ids < 65,535: one symbol per token) and ``u16x2`` (larger vocabularies
such as Gemma's 262,144: a token is two symbols, high half 0x8000 + id // 0x8000 then low half
id % 0x8000; a query always starts on a high symbol, which occurs only at a token's first symbol,
so every match is token-aligned). infini-gram also has a ``u32`` mode, but its suffix-array builder
allocates a 2^32-entry bucket table (32 GiB) per job, so two u16 symbols per token are cheaper.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import os
import shutil
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from mimir_megatron.errors import UserError

from .sources import AuditSource

log = logging.getLogger("mimir.audit")

FORMAT = "mimir-audit-index-v1"
META_NAME = "audit_index.json"
SEPARATOR = 0xFFFF
_HIGH = 0x8000
MAX_TOKEN_ID = {"u16": SEPARATOR - 1, "u16x2": (SEPARATOR - _HIGH) * _HIGH - 1}
SYMBOLS_PER_TOKEN = {"u16": 1, "u16x2": 2}
_HACK_BYTES = 100_000  # infini-gram's overlap between suffix-array parts (its default)
_DEFAULT_SHARD_TOKENS = 1 << 30  # keeps a shard's byte offsets within 4 bytes per suffix
_ENCODE_CHUNK_TOKENS = 1 << 24  # bounded memory while writing a shard


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


# --- the plan -------------------------------------------------------------------------------


@dataclass
class _Unit:
    """A run of consecutive documents of one prepared shard file."""

    source: int
    file: int
    first_document: int  # within the source
    documents: int
    tokens: int


@dataclass
class _Plan:
    encoding: str
    sources: list[dict]
    tokenizer: dict | None = None
    shards: list[list[_Unit]] = field(default_factory=list)

    def to_json(self) -> dict:
        shards = [
            {
                "id": i,
                "documents": sum(u.documents for u in units),
                "tokens": sum(u.tokens for u in units),
                "units": [[u.source, u.file, u.first_document, u.documents, u.tokens] for u in units],
            }
            for i, units in enumerate(self.shards)
        ]
        body = {"format": FORMAT, "encoding": self.encoding, "tokenizer": self.tokenizer,
                "sources": self.sources, "shards": shards}
        body["fingerprint"] = hashlib.sha256(json.dumps(body, sort_keys=True).encode()).hexdigest()
        return body


def _open_prepared(source: AuditSource):
    from mimir_megatron.data.prepared import PreparedDataset

    return PreparedDataset(source.path)


def _make_plan(sources: list[AuditSource], shard_tokens: int, encoding: str) -> _Plan:
    """Whole prepared shard files, packed in order into index shards of <= shard_tokens tokens."""
    units: list[_Unit] = []
    dtypes = set()
    described = []
    for si, source in enumerate(sources):
        ds = _open_prepared(source)
        first = 0
        for fi in range(len(ds.shard_prefixes)):
            idx = ds.shard(fi).index
            dtypes.add(np.dtype(idx.dtype))
            lengths = np.asarray(idx.sequence_lengths, dtype=np.int64)
            n_docs = len(lengths) // 2
            units.append(_Unit(si, fi, first, n_docs, int(lengths.sum())))
            first += n_docs
        described.append(
            {
                "name": source.name,
                "path": str(source.path),
                "category": source.category,
                "documents": first,
                "tokens": sum(u.tokens for u in units if u.source == si),
                "outputs": ds.manifest.get("outputs", {}),
                "tokenizer": _tokenizer_of(ds.manifest),
            }
        )
    if encoding == "auto":
        # megatron stores ids as uint16 only for vocabularies < 65,500 (DType.optimal_dtype).
        encoding = "u16" if dtypes <= {np.dtype(np.uint16), np.dtype(np.uint8)} else "u16x2"
    if encoding not in SYMBOLS_PER_TOKEN:
        raise UserError(f"unknown index encoding {encoding!r}; use auto, u16 or u16x2")
    plan = _Plan(encoding, described, _common_tokenizer(described))
    current: list[_Unit] = []
    for unit in units:
        if unit.documents == 0:
            continue
        if current and sum(u.tokens for u in current) + unit.tokens > shard_tokens:
            plan.shards.append(current)
            current = []
        current.append(unit)
    if current:
        plan.shards.append(current)
    if not plan.shards:
        raise UserError("the sources hold no documents; nothing to index")
    return plan


def _tokenizer_of(manifest: dict) -> dict | None:
    tokenizer = manifest.get("tokenizer") or {}
    return {"sha256": tokenizer["sha256"], "path": tokenizer.get("path")} if tokenizer.get("sha256") else None


def _common_tokenizer(described: list[dict]) -> dict | None:
    """The tokenizer every source was prepared with (None when no manifest names one). Token ids
    of two tokenizers in one index would match each other by accident, so that is refused."""
    known: dict[str, tuple[str, dict]] = {}
    for d in described:
        if d["tokenizer"]:
            known.setdefault(d["tokenizer"]["sha256"], (d["name"], d["tokenizer"]))
    if len(known) > 1:
        names = ", ".join(f"{name} ({sha[:12]})" for sha, (name, _) in known.items())
        raise UserError(f"the sources were prepared with different tokenizers: {names}; "
                        "index each separately")
    return next(iter(known.values()))[1] if known else None


# --- building -------------------------------------------------------------------------------


def _rust_indexing() -> str:
    try:
        import infini_gram
    except ImportError:  # pragma: no cover - a declared dependency
        raise UserError("the audit index needs infini-gram: pip install 'infini-gram==2.6.0'") from None
    return str(Path(infini_gram.__file__).parent / "rust_indexing")


def _run(cmd: list[str]) -> None:
    proc = subprocess.run(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd[:2])} failed ({proc.returncode}): {proc.stderr[-2000:]}")


def _build_suffix_array(data_file: Path, table_file: Path, mem_bytes: int, cpus: int, work: Path) -> None:
    """infini-gram's three steps: sort parts that fit in memory, merge them, write the table."""
    binary = _rust_indexing()
    size = data_file.stat().st_size
    ratio = max(1, math.ceil(math.log2(max(size, 2)) / 8))  # bytes per suffix pointer
    batches = 1
    while batches * (mem_bytes // 8) < size:  # infini-gram's sizing for 2-byte tokens
        batches *= 2
    # rust_indexing needs parts longer than the overlap (shorter ones come out wrong)
    jobs = max(1, min(batches * cpus, size // (2 * _HACK_BYTES)))
    part = size // jobs + (size // jobs) % 2  # whole symbols
    threads = cpus if size >= 2 * _HACK_BYTES * cpus else 1  # more threads than data fails too
    parts_dir, merged_dir = work / "parts", work / "merged"
    shutil.rmtree(work, ignore_errors=True)
    parts_dir.mkdir(parents=True)
    merged_dir.mkdir()
    ranges = [(i * part, min((i + 1) * part + _HACK_BYTES, size)) for i in range(jobs) if i * part < size]
    for start in range(0, len(ranges), cpus):
        procs = [
            subprocess.Popen(
                [binary, "make-part", "--data-file", str(data_file), "--parts-dir", str(parts_dir),
                 "--start-byte", str(s), "--end-byte", str(e), "--ratio", str(ratio), "--token-width", "2"],
                stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
            )
            for s, e in ranges[start:start + cpus]
        ]
        errors = [p.communicate()[1] for p in procs]
        if any(p.returncode for p in procs):
            raise RuntimeError(f"rust_indexing make-part failed: {''.join(errors)[-2000:]}")
    _run([binary, "merge", "--data-file", str(data_file), "--parts-dir", str(parts_dir), "--merged-dir",
          str(merged_dir), "--num-threads", str(threads), "--hacksize", str(_HACK_BYTES),
          "--ratio", str(ratio), "--token-width", "2"])
    shutil.rmtree(parts_dir)
    _run([binary, "concat", "--data-file", str(data_file), "--merged-dir", str(merged_dir), "--merged-file",
          str(table_file), "--num-threads", str(threads), "--ratio", str(ratio), "--token-width", "2"])
    shutil.rmtree(work)


def _write_shard_data(plan: _Plan, units: list[_Unit], sources: list[AuditSource], tokenized: Path,
                      offsets: Path, progress) -> int:
    """Writes the shard's symbols and document offsets; returns its longest document (tokens)."""
    width = SYMBOLS_PER_TOKEN[plan.encoding]
    position = 0  # bytes written so far
    longest = 0
    with tokenized.open("wb") as data_out, offsets.open("wb") as offset_out:
        for unit in units:
            idx = _open_prepared(sources[unit.source]).shard(unit.file).index
            lengths = np.asarray(idx.sequence_lengths, dtype=np.int64).reshape(-1, 2).sum(axis=1)
            longest = max(longest, int(lengths.max(initial=0)))
            tokens = np.memmap(_bin_path(sources[unit.source], unit.file), dtype=idx.dtype, mode="r")
            doc = 0
            tok = 0
            while doc < len(lengths):
                # a chunk of whole documents of about _ENCODE_CHUNK_TOKENS tokens
                ends = np.searchsorted(np.cumsum(lengths[doc:]), _ENCODE_CHUNK_TOKENS, side="right")
                stop = doc + max(1, int(ends))
                chunk_lengths = lengths[doc:stop]
                n_tok = int(chunk_lengths.sum())
                symbols = encode_documents(np.asarray(tokens[tok:tok + n_tok]), chunk_lengths, plan.encoding)
                starts = np.zeros(len(chunk_lengths), dtype=np.int64)
                starts[1:] = np.cumsum(chunk_lengths[:-1] * width + 1)
                offset_out.write((position + 2 * starts).astype(np.uint64).tobytes())
                data_out.write(symbols.tobytes())
                position += 2 * symbols.size
                progress.update(n_tok)
                doc, tok = stop, tok + n_tok
            del tokens
    return longest


def _bin_path(source: AuditSource, file: int) -> str:
    return _open_prepared(source).shard_prefixes[file] + ".bin"


def build_index(
    sources: list[AuditSource],
    output: str | Path,
    *,
    shard_tokens: int = _DEFAULT_SHARD_TOKENS,
    mem_bytes: int = 8 << 30,
    cpus: int | None = None,
    encoding: str = "auto",
    progress: bool = True,
) -> Path:
    """Build (or finish building) the index of ``sources`` in ``output``; returns the directory.

    Shards are independent: an interrupted build resumes at the first unfinished shard. Memory
    stays bounded by ``mem_bytes`` (suffix-array parts) plus a chunk of documents being encoded.
    """
    from tqdm import tqdm

    out = Path(output)
    cpus = cpus or max(1, len(os.sched_getaffinity(0)))
    plan = _make_plan(sources, shard_tokens, encoding)
    meta = plan.to_json()
    meta_path = out / META_NAME
    if meta_path.is_file():
        old = json.loads(meta_path.read_text())
        if old.get("fingerprint") != meta["fingerprint"]:
            raise UserError(
                f"{out}: holds an index of other data or another shard plan; choose a new --output "
                "or delete the directory"
            )
    elif out.exists() and any(out.iterdir()):
        raise UserError(f"{out}: exists and is not an audit index; choose a new --output")
    out.mkdir(parents=True, exist_ok=True)
    _write_json_atomic(meta_path, meta)
    total = sum(s["tokens"] for s in meta["shards"])
    done = [s for s in meta["shards"] if (out / f"shard.{s['id']}.json").is_file()]
    bar = tqdm(total=total, unit="tok", unit_scale=True, desc="audit index", disable=not progress)
    bar.update(sum(s["tokens"] for s in done))
    if done:
        log.info("%s: %d of %d shards already built; resuming", out, len(done), len(meta["shards"]))
    for shard, units in zip(meta["shards"], plan.shards, strict=True):
        sid = shard["id"]
        if (out / f"shard.{sid}.json").is_file():
            continue
        start = time.perf_counter()
        tokenized, offsets, table = (out / f"{n}.{sid}" for n in ("tokenized", "offset", "table"))
        for path in (tokenized, offsets, table):
            path.unlink(missing_ok=True)
        tmp = {p: p.with_name(p.name + ".tmp") for p in (tokenized, offsets, table)}
        longest = _write_shard_data(plan, units, sources, tmp[tokenized], tmp[offsets], bar)
        bar.set_postfix_str(f"shard {sid}: suffix array")
        _build_suffix_array(tmp[tokenized], tmp[table], mem_bytes, cpus, out / f"work.{sid}")
        for final, temporary in tmp.items():
            os.replace(temporary, final)
        _write_json_atomic(
            out / f"shard.{sid}.json",
            {"id": sid, "documents": shard["documents"], "tokens": shard["tokens"],
             "longest_document": longest, "seconds": round(time.perf_counter() - start, 3)},
        )
    bar.close()
    return out


def _write_json_atomic(path: Path, payload: dict) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(payload, indent=1))
    os.replace(tmp, path)


# --- querying -------------------------------------------------------------------------------


@dataclass(frozen=True)
class Hit:
    """One occurrence of a span: source dataset, document within it, token offset in the document
    (the document being its prefix followed by its response)."""

    source: str
    category: str
    document: int
    offset: int


class AuditIndex:
    """Read side of an index directory: match lengths, counts and hit locations."""

    def __init__(self, path: str | Path, prefetch: bool = False) -> None:
        """``prefetch``: infini-gram's read-ahead of the suffix-array search (its default). It pays
        off only for an index that is not in page cache; on one that is, it costs 5x the CPU per
        lookup (20M-token index: 405-460 us with it, 79-82 us without, same counts)."""
        self.path = Path(path)
        meta_path = self.path / META_NAME
        if not meta_path.is_file():
            raise UserError(f"{self.path}: not an audit index ({META_NAME} missing); run `mimir audit index`")
        self.meta = json.loads(meta_path.read_text())
        if self.meta.get("format") != FORMAT:
            raise UserError(f"{meta_path}: format {self.meta.get('format')!r}, expected {FORMAT!r}")
        shards = self.meta["shards"]
        missing = [s["id"] for s in shards if not (self.path / f"shard.{s['id']}.json").is_file()]
        if missing:
            raise UserError(f"{self.path}: shards {missing} unfinished; rerun `mimir audit index` to finish")
        self.encoding: str = self.meta["encoding"]
        self._width = SYMBOLS_PER_TOKEN[self.encoding]
        self.sources: list[dict] = self.meta["sources"]
        # the engine numbers documents globally over shards in order; map back through the units
        units = [u for s in self.meta["shards"] for u in s["units"]]
        self._unit_source = np.array([u[0] for u in units], dtype=np.int64)
        self._unit_first = np.array([u[2] for u in units], dtype=np.int64)
        self._unit_start = np.concatenate([[0], np.cumsum([u[3] for u in units])]).astype(np.int64)
        self._shard_first_doc = np.concatenate([[0], np.cumsum([s["documents"] for s in shards])])
        self._arrays: dict[int, tuple[np.ndarray, np.ndarray, int]] = {}
        from infini_gram.engine import InfiniGramEngine

        depth = {} if prefetch else {"ds_prefetch_depth": 0, "sa_prefetch_depth": 0, "od_prefetch_depth": 0}
        self._engine = InfiniGramEngine(
            index_dir=str(self.path), eos_token_id=0, vocab_size=SEPARATOR, version=4, token_dtype="u16",
            **depth,
        )

    @property
    def num_documents(self) -> int:
        return int(self._unit_start[-1])

    @property
    def num_tokens(self) -> int:
        return sum(s["tokens"] for s in self.meta["shards"])

    @property
    def tokenizer(self) -> dict | None:
        """``{"sha256", "path"}`` of the tokenizer the indexed datasets were prepared with; an index
        built before this was recorded answers from its sources' manifests (None if none says)."""
        if "tokenizer" in self.meta:
            return self.meta["tokenizer"]
        from mimir_megatron.data.prepared import read_manifest

        described = []
        for s in self.sources:
            try:
                manifest = read_manifest(s["path"])
            except UserError:
                continue
            described.append({"name": s["name"], "tokenizer": _tokenizer_of(manifest)})
        return _common_tokenizer(described)

    @property
    def longest_document(self) -> int:
        """Tokens in the longest indexed document: no longer span can match."""
        longest = 0
        for shard in self.meta["shards"]:
            done = json.loads((self.path / f"shard.{shard['id']}.json").read_text())
            if "longest_document" in done:
                longest = max(longest, done["longest_document"])
            else:  # built before the figure was recorded: from the document offsets
                _, offsets, _ = self._shard_arrays(shard["id"])
                size = (self.path / f"tokenized.{shard['id']}").stat().st_size
                symbols = np.diff(np.append(offsets, size)) // 2 - 1
                longest = max(longest, int(symbols.max(initial=0)) // self._width)
        return longest

    def document_tokens(self, source: str, document: int) -> np.ndarray:
        """The token ids of ``document`` of dataset ``source`` (prefix then response), read back
        from the index's own files (the prepared dataset need not be present)."""
        names = [s["name"] for s in self.sources]
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
            (self.path / f"tokenized.{shard}").stat().st_size
        symbols = np.fromfile(self.path / f"tokenized.{shard}", dtype=np.uint16,
                              count=(end - int(offsets[local])) // 2 - 1, offset=int(offsets[local]) + 2)
        return decode_symbols(symbols, self.encoding)

    def documents_per_category(self) -> dict[str, int]:
        counts: dict[str, int] = {}
        for s in self.sources:
            counts[s["category"]] = counts.get(s["category"], 0) + s["documents"]
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
            table = np.memmap(self.path / f"table.{shard}", dtype=np.uint8, mode="r")
            size = (self.path / f"tokenized.{shard}").stat().st_size
            offsets = np.fromfile(self.path / f"offset.{shard}", dtype=np.uint64).astype(np.int64)
            self._arrays[shard] = (table, offsets, table.size // (size // 2))
        return self._arrays[shard]

    def _hits_at(self, shard: int, lo: int, hi: int) -> list[Hit]:
        """The hits of suffix-array ranks [lo, hi) of one shard, read from its table."""
        table, offsets, ratio = self._shard_arrays(shard)
        raw = np.asarray(table[lo * ratio:hi * ratio]).reshape(-1, ratio).astype(np.int64)
        pointers = (raw << (8 * np.arange(ratio, dtype=np.int64))).sum(axis=1)  # little-endian bytes
        docs = np.searchsorted(offsets, pointers, side="right") - 1
        symbol_offsets = (pointers - offsets[docs]) // 2 - 1  # after the separator
        first = self._shard_first_doc[shard]
        return [self._hit(int(first + d), int(o) // self._width) for d, o in zip(docs, symbol_offsets)]

    def _hit(self, doc_ix: int, offset: int) -> Hit:
        unit = int(np.searchsorted(self._unit_start, doc_ix, side="right") - 1)
        source = self.sources[int(self._unit_source[unit])]
        document = int(self._unit_first[unit] + doc_ix - self._unit_start[unit])
        return Hit(source["name"], source["category"], document, offset)
