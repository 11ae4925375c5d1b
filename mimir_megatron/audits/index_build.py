"""Building an audit index: the shard plan over prepared datasets, each shard's symbols and
document offsets, and its suffix array (infini-gram's ``rust_indexing``); the same for the
shard's word stream (its documents decoded and folded, :mod:`.normalise`). The format is
:mod:`.index_format`'s; :mod:`.index_query` reads what this writes."""

from __future__ import annotations

import logging
import math
import os
import shutil
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from mimir_megatron.errors import UserError
from mimir_megatron.integrity import atomic_files, remove_temporaries

from .index_format import (
    META_NAME,
    SYMBOLS_PER_TOKEN,
    WORDS_DIR,
    IndexedSource,
    IndexMetadata,
    IndexShard,
    ShardUnit,
    common_tokenizer,
    encode_documents,
    shard_file,
    tokenizer_of,
    write_shard_record,
)
from .normalise import WORD_FORM, WordNumbers, documents_text
from .sources import AuditSource

log = logging.getLogger("mimir.audit")

_HACK_BYTES = 100_000  # infini-gram's overlap between suffix-array parts (its default)
_DEFAULT_SHARD_TOKENS = 1 << 30  # keeps a shard's byte offsets within 4 bytes per suffix
_ENCODE_CHUNK_TOKENS = 1 << 24  # bounded memory while writing a shard
_WORD_CHUNK_DOCUMENTS = 4096  # documents decoded per tokenizer call for the word stream


# --- the plan -------------------------------------------------------------------------------


@dataclass
class _Plan:
    encoding: str
    sources: list[IndexedSource]
    tokenizer: dict | None = None
    shards: list[list[ShardUnit]] = field(default_factory=list)
    reader: Any = None
    """The datasets' tokenizer (``tokenizers.Tokenizer``) that reads documents as text for the
    word stream; None: the tokenizer is not here, and the index has no word stream."""

    def metadata(self) -> IndexMetadata:
        shards = [IndexShard(id=i, documents=sum(u.documents for u in units),
                             tokens=sum(u.tokens for u in units), units=tuple(units))
                  for i, units in enumerate(self.shards)]
        words = {"form": WORD_FORM} if self.reader is not None else None
        return IndexMetadata.new(self.encoding, self.sources, shards, self.tokenizer, words)


def _reader(tokenizer: dict | None) -> Any:
    """The tokenizer that reads the indexed documents as text (the one `mimir prepare` encoded
    them with, its sha256 checked), or None with a warning when it is not here."""
    from mimir_megatron.chat import load_tokenizer, tokenizer_sha256

    path = (tokenizer or {}).get("path")
    if not path or not (Path(path) / "tokenizer.json").is_file():
        log.warning("the datasets' tokenizer %s is not here: the index gets no word stream, and the "
                    "contamination check will ask for it to be rebuilt", path)
        return None
    if tokenizer_sha256(path) != tokenizer["sha256"]:
        log.warning("%s is not the tokenizer the datasets were prepared with (sha256 differs): the index "
                    "gets no word stream, and the contamination check will ask for it to be rebuilt", path)
        return None
    try:
        return load_tokenizer(path).backend_tokenizer
    except UserError as exc:  # transformers missing, a tokenizer without a chat template
        log.warning("%s: the index gets no word stream, and the contamination check will ask for it to be "
                    "rebuilt", exc)
        return None


def _open_prepared(source: AuditSource):
    from mimir_megatron.data.prepared import PreparedDataset

    return PreparedDataset(source.path)


def _make_plan(sources: list[AuditSource], shard_tokens: int, encoding: str) -> _Plan:
    """Whole prepared shard files, packed in order into index shards of <= shard_tokens tokens."""
    units: list[ShardUnit] = []
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
            units.append(ShardUnit(si, fi, first, n_docs, int(lengths.sum())))
            first += n_docs
        described.append(IndexedSource(
            name=source.name, path=str(source.path), category=source.category, documents=first,
            tokens=sum(u.tokens for u in units if u.source == si), outputs=dict(ds.record.outputs),
            tokenizer=tokenizer_of(ds.record),
        ))
    if encoding == "auto":
        # megatron stores ids as uint16 only for vocabularies < 65,500 (DType.optimal_dtype).
        encoding = "u16" if dtypes <= {np.dtype(np.uint16), np.dtype(np.uint8)} else "u16x2"
    if encoding not in SYMBOLS_PER_TOKEN:
        raise UserError(f"unknown index encoding {encoding!r}; use auto, u16 or u16x2")
    tokenizer = common_tokenizer([(d.name, d.tokenizer) for d in described])
    plan = _Plan(encoding, described, tokenizer, reader=_reader(tokenizer))
    current: list[ShardUnit] = []
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


def _write_shard_data(plan: _Plan, units: tuple[ShardUnit, ...], sources: list[AuditSource],
                      tokenized: Path, offsets: Path, progress) -> int:
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


def _write_word_data(plan: _Plan, units: tuple[ShardUnit, ...], sources: list[AuditSource],
                     tokenized: Path, offsets: Path) -> None:
    """Writes the shard's word stream: each document decoded with the datasets' tokenizer, its
    words folded and numbered (:mod:`.normalise`), as ``u16x2`` symbols with their offsets."""
    numbers = WordNumbers()
    position = 0
    with tokenized.open("wb") as data_out, offsets.open("wb") as offset_out:
        for unit in units:
            idx = _open_prepared(sources[unit.source]).shard(unit.file).index
            lengths = np.asarray(idx.sequence_lengths, dtype=np.int64).reshape(-1, 2).sum(axis=1)
            bounds = np.concatenate([[0], np.cumsum(lengths)])
            tokens = np.memmap(_bin_path(sources[unit.source], unit.file), dtype=idx.dtype, mode="r")
            for first in range(0, len(lengths), _WORD_CHUNK_DOCUMENTS):
                last = min(first + _WORD_CHUNK_DOCUMENTS, len(lengths))
                texts = documents_text(plan.reader, [tokens[bounds[d]:bounds[d + 1]]
                                                     for d in range(first, last)])
                words = [numbers(text) for text in texts]
                counts = np.array([len(w) for w in words], dtype=np.int64)
                flat = np.fromiter((n for w in words for n in w), dtype=np.int64, count=int(counts.sum()))
                symbols = encode_documents(flat, counts, "u16x2")
                starts = np.zeros(len(counts), dtype=np.int64)
                starts[1:] = np.cumsum(counts[:-1] * 2 + 1)
                offset_out.write((position + 2 * starts).astype(np.uint64).tobytes())
                data_out.write(symbols.tobytes())
                position += 2 * symbols.size
            del tokens


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
    meta = plan.metadata()
    if (out / META_NAME).is_file():
        existing = IndexMetadata.read(out)
        if not existing.words_recorded:
            raise UserError(f"{out}: holds an index built before indexes had a word stream; choose a new "
                            "--output or delete the directory")
        if not existing.same_plan(meta):
            raise UserError(
                f"{out}: holds an index of other data or another shard plan; choose a new --output "
                "or delete the directory"
            )
    elif out.exists() and any(out.iterdir()):
        raise UserError(f"{out}: exists and is not an audit index; choose a new --output")
    out.mkdir(parents=True, exist_ok=True)
    meta.write(out)
    done = [s for s in meta.shards if shard_file(out, "shard", s.id).is_file()]
    bar = tqdm(total=meta.total_tokens, unit="tok", unit_scale=True, desc="audit index", disable=not progress)
    bar.update(sum(s.tokens for s in done))
    if done:
        log.info("%s: %d of %d shards already built; resuming", out, len(done), len(meta.shards))
    for shard in meta.shards:
        sid = shard.id
        if shard_file(out, "shard", sid).is_file():
            continue
        start = time.perf_counter()
        tokenized, offsets, table = (shard_file(out, kind, sid) for kind in ("tokenized", "offset", "table"))
        streams = [(tokenized, offsets, table)]
        if plan.reader is not None:
            (out / WORDS_DIR).mkdir(exist_ok=True)
            streams.append(tuple(shard_file(out / WORDS_DIR, kind, sid)
                                 for kind in ("tokenized", "offset", "table")))
        finals = [path for stream in streams for path in stream]
        for path in finals:
            path.unlink(missing_ok=True)
        remove_temporaries(*finals)  # a killed build's, gigabytes each
        with atomic_files(*finals) as staged:
            tmp = dict(zip(finals, staged))
            longest = _write_shard_data(plan, shard.units, sources, tmp[tokenized], tmp[offsets], bar)
            bar.set_postfix_str(f"shard {sid}: suffix array")
            _build_suffix_array(tmp[tokenized], tmp[table], mem_bytes, cpus, out / f"work.{sid}")
            if plan.reader is not None:
                words, word_offsets, word_table = streams[1]
                bar.set_postfix_str(f"shard {sid}: word stream")
                _write_word_data(plan, shard.units, sources, tmp[words], tmp[word_offsets])
                _build_suffix_array(tmp[words], tmp[word_table], mem_bytes, cpus, out / f"work.{sid}")
        write_shard_record(out, shard, longest, time.perf_counter() - start)
    bar.close()
    return out
