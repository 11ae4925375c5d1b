"""The write-shards stage of `mimir prepare`: one shard of input through read, screen, render
and screen again into ``shards/<id>.bin/.idx``, its rejects and its statistics.

Everything is written under temporary names and renamed
(:func:`~mimir_megatron.integrity.atomic_files`); the statistics file is renamed last and marks
the shard finished, so a rerun (or ``--merge``) finds it by its key (:func:`finished_shard`).
Memory is bounded by one batch of documents and one shard's lengths.

Documents go through in batches of :data:`BATCH` so that the tokenizer encodes a batch per call
(``encode_batch``); rejects and accepted documents still come out in line order.
"""

from __future__ import annotations

import gc
import json
import os
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from functools import partial
from pathlib import Path
from typing import Callable

import numpy as np

from mimir_megatron.chat import ChatRenderer
from mimir_megatron.data.manifest import FORMAT
from mimir_megatron.data.prepared import SHARDS_DIR
from mimir_megatron.integrity import Fingerprint, atomic_files, fingerprint, sha256_file, write_json_atomic

from .read import read_records
from .records import REJECT_REASONS, RecordError
from .render import SingleRender, fit_document, render_texts
from .screen import load_denylist, screen_text, screen_tokens
from .settings import PrepareSettings, StrictModeError
from .shards import CorruptRowGroup, ShardTask

BATCH = 64  # documents rendered, then encoded with one tokenizer call
PROGRESS_EVERY = 500  # documents between progress reports from a worker

# Settings added after datasets were prepared: left out of the shard key while unset, so that a
# rerun of an older preparation still finds its finished shards.
_KEY_WHEN_SET = ("denylist", "denylist_sha256")


@dataclass
class ShardStats:
    shard_id: int
    key: str
    source: str
    first_line: int
    lines: int = 0
    documents: int = 0
    prefix_tokens: int = 0
    response_tokens: int = 0
    truncated: int = 0
    control_chars_stripped: int = 0  # lines that had control characters removed (strip policy)
    personal_data: dict[str, int] = field(default_factory=dict)  # personal data found, per kind
    rejects: dict[str, int] = field(default_factory=lambda: {r: 0 for r in REJECT_REASONS})
    files: dict[str, str] = field(default_factory=dict)  # relative path -> sha256
    sizes: dict[str, int] = field(default_factory=dict)


def shard_key(task: ShardTask, settings: PrepareSettings) -> Fingerprint:
    """The fingerprint of what decides a shard (its input's slice, size and time, the settings,
    the format): a rerun finds a finished shard by it."""
    stat = os.stat(task.path)
    payload = {
        "task": task.to_dict(),
        "size": stat.st_size,
        "mtime_ns": stat.st_mtime_ns,
        "settings": {k: v for k, v in asdict(settings).items()
                     if k != "strict" and (v or k not in _KEY_WHEN_SET)},
        "format": FORMAT,
    }
    return fingerprint(payload)


def stats_path(out: Path, shard_id: int) -> Path:
    return out / SHARDS_DIR / f"{shard_id:05d}.json"


def finished_shard(task: ShardTask, settings: PrepareSettings, out: Path) -> ShardStats | None:
    """The stats of a shard a previous run completed with the same inputs and settings."""
    path = stats_path(out, task.shard_id)
    if not path.is_file():
        return None
    try:
        data = json.loads(path.read_text())
    except json.JSONDecodeError:
        return None
    if not shard_key(task, settings).matches(data.get("key")):
        return None
    for rel, size in data.get("sizes", {}).items():
        path = out / rel
        if not path.is_file() or path.stat().st_size != size:
            return None
    return ShardStats(**data)


# --- the worker's state: a renderer per tokenizer, and where progress goes ---------------------

_renderers: dict[str, ChatRenderer] = {}
_single_renders: dict[str, SingleRender] = {}
Progress = Callable[[int, int, int, int], None]  # (job, documents, tokens, rejects)
_progress: Progress | None = None


def init_worker(progress_queue) -> None:
    """A pool worker's set-up: progress to the driver's queue, the tokenizer on one thread (the
    pool's processes use the cores)."""
    global _progress
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    _progress = (lambda *counts: progress_queue.put(counts)) if progress_queue is not None else None


def set_progress(report: Progress | None) -> None:
    """Where an in-process run reports progress (None: nowhere)."""
    global _progress
    _progress = report


def renderer_for(tokenizer_dir: str) -> ChatRenderer:
    if tokenizer_dir not in _renderers:
        _renderers[tokenizer_dir] = ChatRenderer(tokenizer_dir)
    return _renderers[tokenizer_dir]


def single_render_for(tokenizer_dir: str) -> SingleRender:
    """The renderer's template, rendered once per conversation where that is proven equal."""
    if tokenizer_dir not in _single_renders:
        _single_renders[tokenizer_dir] = SingleRender(renderer_for(tokenizer_dir))
    return _single_renders[tokenizer_dir]


# --- one shard ---------------------------------------------------------------------------------


def process_shard(task: ShardTask, settings: PrepareSettings, out_dir: str, job: int = 0) -> ShardStats:
    """Tokenize one shard into ``shards/<id>.bin/.idx`` plus its rejects and statistics;
    progress is reported as ``job`` (the dataset's number in a multi-dataset run)."""
    with _collect_young_only():
        return _write_shard(task, settings, out_dir, job)


@contextmanager
def _collect_young_only():
    """The objects that exist before a shard (torch's, megatron's, transformers': ~500,000) left
    out of the garbage collector's full passes while it is written: each pass walked them all,
    15-20 % of `mimir prepare`'s CPU time on one worker. Afterwards every object is collectable again
    (nothing leaks; freezing is only a hint to the collector, so undoing a freeze a library made
    before is harmless)."""
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()


def _write_shard(task: ShardTask, settings: PrepareSettings, out_dir: str, job: int) -> ShardStats:
    from megatron.core.datasets.indexed_dataset import DType, IndexedDatasetBuilder

    renderer = renderer_for(settings.tokenizer_dir)
    out = Path(out_dir)
    name = f"{task.shard_id:05d}"
    final = {ext: out / SHARDS_DIR / f"{name}{ext}" for ext in (".bin", ".idx", ".rejects.jsonl")}
    stats = ShardStats(task.shard_id, str(shard_key(task, settings)), task.path, task.first_line)
    with atomic_files(*final.values()) as staged:
        tmp = dict(zip(final, staged))
        builder = IndexedDatasetBuilder(str(tmp[".bin"]), dtype=DType.optimal_dtype(renderer.vocab_size))
        try:
            with tmp[".rejects.jsonl"].open("w") as rejects:
                _ShardFill(task, settings, renderer, builder, stats, rejects, job).run()
        except BaseException:
            builder.data_file.close()
            raise
        builder.finalize(str(tmp[".idx"]))
    for path in final.values():
        rel = f"{SHARDS_DIR}/{path.name}"
        stats.files[rel] = sha256_file(path)
        stats.sizes[rel] = path.stat().st_size
    write_json_atomic(stats_path(out, task.shard_id), asdict(stats))
    return stats


class _ShardFill:
    """Every record of a shard into the builder (accepted) or the rejects file, in line order."""

    def __init__(self, task: ShardTask, settings: PrepareSettings, renderer: ChatRenderer, builder,
                 stats: ShardStats, rejects, job: int) -> None:
        self.task, self.settings, self.renderer = task, settings, renderer
        self.builder, self.stats, self.rejects, self.job = builder, stats, rejects, job
        self.single = single_render_for(settings.tokenizer_dir)
        self.denylist = load_denylist(settings)
        self.pending = [0, 0, 0]  # documents, tokens, rejects not yet reported

    def run(self) -> None:
        batch: list[tuple] = []
        for line, record, raw in read_records(self.task, self.settings):
            if isinstance(record, CorruptRowGroup):
                batch.append((line, record, raw))
            else:
                self.stats.lines += 1
                batch.append((line, self._texts(record, raw), raw))
            if len(batch) >= BATCH:
                self._flush(batch)
                batch = []
        self._flush(batch)
        if _progress and any(self.pending):
            _progress(self.job, *self.pending)

    def _texts(self, record, raw: bytes | None):
        """Screen and render one conversation: (prefix text, response text) or its RecordError."""
        if isinstance(record, RecordError):
            return record
        try:
            conv, stripped = screen_text(record, self.settings, self.stats.personal_data, raw)
            self.stats.control_chars_stripped += stripped
            return render_texts(conv, self.single)
        except RecordError as exc:
            return exc

    def _flush(self, batch: list[tuple]) -> None:
        texts = [t for _, item, _ in batch if isinstance(item, tuple) for t in item]
        ids = iter(self.renderer.encode_batch(texts)) if texts else iter(())
        for line, item, raw in batch:
            if isinstance(item, CorruptRowGroup):
                self._reject_row_group(line, item)
                self.pending[2] += item.rows
            elif isinstance(item, RecordError):
                self._reject(line, item, raw)
            else:
                prefix, response = next(ids), next(ids)
                try:
                    prefix, truncated = fit_document(prefix, response, self.settings)
                    document = prefix + response
                    if self.denylist is not None:
                        screen_tokens(document, self.denylist, self.settings,
                                      partial(self._text, document) if self.denylist.reads_text else None)
                except RecordError as exc:
                    self._reject(line, exc, raw)
                    continue
                self._accept(document, len(prefix), len(response), truncated)
            if _progress and self.pending[0] + self.pending[2] >= PROGRESS_EVERY:
                _progress(self.job, *self.pending)
                self.pending = [0, 0, 0]

    def _text(self, document: list[int]) -> str:
        """The document's text as the audit index's word stream reads it (for a denylist's word
        entries)."""
        from mimir_megatron.audits.normalise import document_text

        return document_text(self.renderer.tokenizer.backend_tokenizer, document)

    def _accept(self, document: list[int], prefix: int, response: int, truncated: bool) -> None:
        """Write a document of ``prefix`` + ``response`` tokens."""
        # an array of the builder's dtype, which it copies as it is: from a list the builder's
        # numpy.array first looks through the list for the items' types (~2 us a document more)
        ids = np.fromiter(document, self.builder.dtype, len(document))
        self.builder.add_document(ids, lengths=[prefix, response])
        s = self.stats
        s.truncated += truncated
        s.documents += 1
        s.prefix_tokens += prefix
        s.response_tokens += response
        self.pending[0] += 1
        self.pending[1] += prefix + response

    def _reject(self, line: int, exc: RecordError, raw: bytes | None) -> None:
        self.stats.rejects[exc.reason] += 1
        if self.settings.strict:
            raise StrictModeError(f"{self.task.path}:{line}: {exc.reason}: {exc.detail}") from None
        entry = {"file": self.task.path, "line": line, "reason": exc.reason, "detail": exc.detail}
        if raw is not None and exc.reason != "personal_data":  # never copy personal data out
            entry["excerpt"] = raw[:200].decode("utf-8", errors="replace")
        self.rejects.write(json.dumps(entry, ensure_ascii=False) + "\n")
        self.pending[2] += 1

    def _reject_row_group(self, row: int, bad: CorruptRowGroup) -> None:
        """Every unread row of a corrupt row group is a line read and rejected; one rejects entry."""
        self.stats.lines += bad.rows
        self.stats.rejects["corrupt_row_group"] += bad.rows
        detail = f"row group {bad.row_group}: {bad.rows} row(s) from row {row} unreadable: {bad.detail}"
        if self.settings.strict:
            raise StrictModeError(f"{self.task.path}:{row}: corrupt_row_group: {detail}")
        entry = {"file": self.task.path, "line": row, "reason": "corrupt_row_group", "detail": detail,
                 "row_group": bad.row_group, "rows": bad.rows}
        self.rejects.write(json.dumps(entry, ensure_ascii=False) + "\n")
