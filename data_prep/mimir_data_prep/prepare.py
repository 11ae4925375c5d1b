"""`mimir prepare`: tokenize chat data into a prepared dataset (see mimir_megatron.data.prepared).

Each shard is processed by one worker process and written under a temporary name, then renamed;
its statistics file is renamed last and marks it finished, so a rerun skips it. The manifest is
assembled from the shard statistics at the end. Nothing is held in memory beyond one shard's
document lengths.
"""

from __future__ import annotations

import hashlib
import json
import logging
import multiprocessing as mp
import os
import queue
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Callable

import numpy as np

from mimir_megatron.chat import ChatRenderer, ChatTemplateError
from mimir_megatron.chat import tokenizer_sha256 as tokenizer_hash
from mimir_megatron.data.prepared import (
    FORMAT,
    MANIFEST_NAME,
    REJECTS_NAME,
    SEQUENCES_PER_DOCUMENT,
    SHARDS_DIR,
    manifest_digest,
    sha256_file,
)
from mimir_megatron.data.provenance import (
    SIDECAR_SUFFIX,
    Provenance,
    checked_record,
    read_provenance,
    stored_record,
)
from mimir_megatron.errors import UserError

from .layouts import DETECT_LINES, INPUT_FORMATS, detect_layout, normalise, parse_columns
from .personal_data import POLICIES as PERSONAL_DATA_POLICIES
from .personal_data import screen_personal_data
from .records import (
    CONTROL_CHAR_POLICIES,
    REJECT_REASONS,
    RecordError,
    clean_control_chars,
    decode_json_line,
    to_conversation,
)
from .shards import (
    DEFAULT_SHARD_BYTES,
    CorruptRowGroup,
    ShardTask,
    iter_jsonl,
    iter_parquet,
    plan_shards,
    sample_records,
)

log = logging.getLogger(__name__)

TOO_LONG_POLICIES = ("drop", "truncate-prefix")
_PROGRESS_EVERY = 500  # documents between progress reports from a worker


class StrictModeError(UserError):
    """--strict met a bad line; the message names the file and line."""


@dataclass(frozen=True)
class PrepareSettings:
    """Everything besides the input bytes that decides the output: part of each shard's key."""

    tokenizer_dir: str
    tokenizer_sha256: str
    seq_len: int = 4096
    too_long: str = "drop"
    min_response_tokens: int = 2
    strict: bool = False
    input_format: str = "auto"
    columns: tuple[tuple[str, str], ...] = ()  # (target, column) pairs of the columns layout
    control_chars: str = "reject"
    denylist: str = ""  # `--denylist` file: documents holding one of its sequences are rejected
    denylist_sha256: str = ""
    personal_data: str = "reject"  # personal_data.POLICIES


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


def shard_key(task: ShardTask, settings: PrepareSettings) -> str:
    stat = os.stat(task.path)
    payload = {
        "task": task.to_dict(),
        "size": stat.st_size,
        "mtime_ns": stat.st_mtime_ns,
        "settings": {k: v for k, v in asdict(settings).items()
                     if k != "strict" and (v or k not in _KEY_WHEN_SET)},
        "format": FORMAT,
    }
    return hashlib.sha256(json.dumps(payload, sort_keys=True).encode()).hexdigest()


def fit_to_context(
    prefix: list[int], response: list[int], settings: PrepareSettings
) -> tuple[list[int], bool]:
    """Apply the too-long policy. Packed input length is len(prefix) + len(response) - 1."""
    if len(prefix) + len(response) - 1 <= settings.seq_len:
        return prefix, False
    keep = settings.seq_len + 1 - len(response)
    if settings.too_long == "truncate-prefix" and keep >= 1:
        # Keep the end of the prefix: it holds the generation prompt the response follows.
        return prefix[-keep:], True
    raise RecordError(
        "too_long",
        f"{len(prefix)} prefix + {len(response)} response tokens exceed seq_len={settings.seq_len}",
    )


# --- worker side -------------------------------------------------------------------------------

_renderer: ChatRenderer | None = None
_progress: Callable[[int, int, int], None] | None = None
_denylists: dict[tuple[str, str], object] = {}


def _init_worker(tokenizer_dir: str, progress_queue) -> None:
    global _renderer, _progress
    _renderer = ChatRenderer(tokenizer_dir)
    _progress = (lambda d, t, r: progress_queue.put((d, t, r))) if progress_queue else None


def _records(task: ShardTask, settings: PrepareSettings):
    """(line, conversation | RecordError | CorruptRowGroup, raw bytes | None) for each line."""
    columns = dict(settings.columns)

    def convert(obj):
        try:
            return to_conversation(normalise(obj, task.layout, columns))
        except RecursionError:
            raise RecordError("bad_schema", "nested too deeply") from None

    if task.kind == "jsonl":
        for line, raw in iter_jsonl(task):
            try:
                yield line, convert(decode_json_line(raw, settings.control_chars)), raw
            except RecordError as exc:
                yield line, exc, raw
    else:
        for row, record in iter_parquet(task):
            if isinstance(record, CorruptRowGroup):
                yield row, record, None
                continue
            try:
                yield row, convert(record), None
            except RecordError as exc:
                yield row, exc, None


def _denylist(settings: PrepareSettings):
    """The settings' denylist (read once per process), or None."""
    if not settings.denylist:
        return None
    key = (settings.denylist, settings.denylist_sha256)
    if key not in _denylists:
        from mimir_megatron.audits.denylist import Denylist

        denylist = Denylist(settings.denylist, settings.tokenizer_sha256)
        if denylist.sha256 != settings.denylist_sha256:
            raise UserError(f"{settings.denylist}: changed while `mimir prepare` was running")
        _denylists[key] = denylist
    return _denylists[key]


def process_shard(task: ShardTask, settings: PrepareSettings, out_dir: str) -> ShardStats:
    """Tokenize one shard into ``shards/<id>.bin/.idx`` plus its rejects and statistics."""
    from megatron.core.datasets.indexed_dataset import DType, IndexedDatasetBuilder

    assert _renderer is not None, "worker not initialised"
    renderer = _renderer
    out = Path(out_dir)
    name = f"{task.shard_id:05d}"
    final = {ext: out / SHARDS_DIR / f"{name}{ext}" for ext in (".bin", ".idx", ".rejects.jsonl")}
    tmp = {ext: p.with_name(p.name + f".tmp{os.getpid()}") for ext, p in final.items()}
    stats = ShardStats(task.shard_id, shard_key(task, settings), task.path, task.first_line)
    dtype = DType.optimal_dtype(renderer.vocab_size)
    builder = IndexedDatasetBuilder(str(tmp[".bin"]), dtype=dtype)
    try:
        _fill_shard(task, settings, renderer, builder, stats, tmp[".rejects.jsonl"])
    except BaseException:
        builder.data_file.close()
        for path in tmp.values():
            path.unlink(missing_ok=True)
        raise
    builder.finalize(str(tmp[".idx"]))
    for ext, path in final.items():
        os.replace(tmp[ext], path)
        rel = f"{SHARDS_DIR}/{path.name}"
        stats.files[rel] = sha256_file(path)
        stats.sizes[rel] = path.stat().st_size
    _write_json_atomic(out / SHARDS_DIR / f"{name}.json", asdict(stats))
    return stats


def _fill_shard(
    task: ShardTask,
    settings: PrepareSettings,
    renderer: ChatRenderer,
    builder,
    stats: ShardStats,
    rejects_path: Path,
) -> None:
    """Tokenize every record of the shard into ``builder``; rejects go to ``rejects_path``."""
    pending = [0, 0, 0]
    denylist = _denylist(settings)
    with rejects_path.open("w") as rejects:
        for line, conv, raw in _records(task, settings):
            if isinstance(conv, CorruptRowGroup):
                _reject_row_group(task, settings, stats, line, conv, rejects)
                pending[2] += conv.rows
                continue
            stats.lines += 1
            try:
                if isinstance(conv, RecordError):
                    raise conv
                conv, stripped = clean_control_chars(conv, settings.control_chars)
                stats.control_chars_stripped += stripped > 0
                conv = screen_personal_data(conv, settings.personal_data, stats.personal_data)
                try:
                    prefix, response = renderer.tokenize(conv.messages, conv.tools)
                except ChatTemplateError as exc:
                    raise RecordError("template_error", str(exc)) from None
                if len(response) < settings.min_response_tokens:
                    raise RecordError(
                        "response_too_short",
                        f"{len(response)} response tokens, need >= {settings.min_response_tokens}",
                    )
                prefix, truncated = fit_to_context(prefix, response, settings)
                if denylist is not None and (hit := denylist.first_hit(prefix + response)) is not None:
                    raise RecordError("benchmark_overlap", hit.describe(settings.denylist))
            except RecordError as exc:
                stats.rejects[exc.reason] += 1
                where = f"{task.path}:{line}"
                if settings.strict:
                    raise StrictModeError(f"{where}: {exc.reason}: {exc.detail}") from None
                entry = {
                    "file": task.path,
                    "line": line,
                    "reason": exc.reason,
                    "detail": exc.detail,
                }
                if raw is not None and exc.reason != "personal_data":  # never copy personal data out
                    entry["excerpt"] = raw[:200].decode("utf-8", errors="replace")
                rejects.write(json.dumps(entry, ensure_ascii=False) + "\n")
                pending[2] += 1
                continue
            stats.truncated += truncated
            builder.add_document(
                np.asarray(prefix + response), lengths=[len(prefix), len(response)]
            )
            stats.documents += 1
            stats.prefix_tokens += len(prefix)
            stats.response_tokens += len(response)
            pending[0] += 1
            pending[1] += len(prefix) + len(response)
            if _progress and pending[0] + pending[2] >= _PROGRESS_EVERY:
                _progress(*pending)
                pending = [0, 0, 0]
    if _progress and any(pending):
        _progress(*pending)


def _reject_row_group(
    task: ShardTask, settings: PrepareSettings, stats: ShardStats, row: int, bad: CorruptRowGroup, rejects
) -> None:
    """Every unread row of a corrupt row group is a line read and rejected; one rejects entry."""
    stats.lines += bad.rows
    stats.rejects["corrupt_row_group"] += bad.rows
    detail = f"row group {bad.row_group}: {bad.rows} row(s) from row {row} unreadable: {bad.detail}"
    if settings.strict:
        raise StrictModeError(f"{task.path}:{row}: corrupt_row_group: {detail}")
    entry = {
        "file": task.path,
        "line": row,
        "reason": "corrupt_row_group",
        "detail": detail,
        "row_group": bad.row_group,
        "rows": bad.rows,
    }
    rejects.write(json.dumps(entry, ensure_ascii=False) + "\n")


# --- driver side -------------------------------------------------------------------------------


def _write_json_atomic(path: Path, obj: dict) -> None:
    tmp = path.with_name(path.name + f".tmp{os.getpid()}")
    tmp.write_text(json.dumps(obj, indent=2, ensure_ascii=False) + "\n")
    os.replace(tmp, path)


def _finished(task: ShardTask, settings: PrepareSettings, out: Path) -> ShardStats | None:
    """The stats of a shard a previous run completed with the same inputs and settings."""
    stats_path = out / SHARDS_DIR / f"{task.shard_id:05d}.json"
    if not stats_path.is_file():
        return None
    try:
        data = json.loads(stats_path.read_text())
    except json.JSONDecodeError:
        return None
    if data.get("key") != shard_key(task, settings):
        return None
    for rel, size in data.get("sizes", {}).items():
        path = out / rel
        if not path.is_file() or path.stat().st_size != size:
            return None
    return ShardStats(**data)


def prepare(
    inputs: list[str | Path],
    tokenizer_dir: str | Path,
    output_dir: str | Path,
    *,
    seq_len: int = 4096,
    too_long: str = "drop",
    min_response_tokens: int = 2,
    strict: bool = False,
    input_format: str = "auto",
    columns: str | dict[str, str] | None = None,
    control_chars: str = "reject",
    workers: int | None = None,
    shard_bytes: int = DEFAULT_SHARD_BYTES,
    progress: bool = True,
    provenance: Provenance | None = None,
    denylist: str | Path | None = None,
    personal_data: str = "reject",
    part: str | None = None,
    merge: bool = False,
) -> dict | None:
    """Prepare ``inputs`` into ``output_dir`` and return the manifest (also written to disk).

    Spread over machines (a Slurm array, ``launchers/prepare_array.sh``): each job runs with
    ``part`` (``I/N``: the I-th of N contiguous ranges of the shards, from 0; or ``START:END``,
    shard ids) and writes only those shards, returning None; then one run with ``merge`` checks
    that every shard is finished and writes the manifest. The result equals a run over everything,
    byte for byte. Every job must see the same inputs and options (the shards' keys check it).

    ``provenance`` is the dataset's declared record (:mod:`mimir_megatron.data.provenance`);
    without one, the record the inputs' sidecars agree on, else ``unknown``. ``denylist``: a file
    from ``mimir audit contamination --denylist``; documents holding one of its token sequences
    are rejected as ``benchmark_overlap``."""
    if too_long not in TOO_LONG_POLICIES:
        raise UserError(f"--too-long must be one of {TOO_LONG_POLICIES}, got {too_long!r}")
    if seq_len < 2:
        raise UserError(f"--seq-len must be >= 2, got {seq_len}")
    if not inputs:
        raise UserError("no input files given")
    if input_format not in INPUT_FORMATS:
        raise UserError(f"--input-format must be one of {INPUT_FORMATS}, got {input_format!r}")
    if personal_data not in PERSONAL_DATA_POLICIES:
        raise UserError(f"--personal-data must be one of {PERSONAL_DATA_POLICIES}, got {personal_data!r}")
    if control_chars not in CONTROL_CHAR_POLICIES:
        raise UserError(f"--control-chars must be one of {CONTROL_CHAR_POLICIES}, got {control_chars!r}")
    column_map = parse_columns(columns)
    if input_format == "columns" and not column_map:
        raise UserError("--input-format columns needs --columns TARGET=COLUMN,...")
    paths = [Path(p) for p in inputs]
    out = Path(output_dir)
    checked_denylist = check_denylist(denylist, tokenizer_dir)  # before anything is written
    if provenance is None:
        provenance = _sidecar_provenance(paths, out)
    (out / SHARDS_DIR).mkdir(parents=True, exist_ok=True)
    tokenizer_dir = str(Path(tokenizer_dir).resolve())
    settings = PrepareSettings(
        tokenizer_dir=tokenizer_dir,
        tokenizer_sha256=tokenizer_hash(tokenizer_dir),
        seq_len=seq_len,
        too_long=too_long,
        min_response_tokens=min_response_tokens,
        strict=strict,
        input_format=input_format,
        columns=tuple(sorted(column_map.items())),
        control_chars=control_chars,
        denylist=str(checked_denylist.path.resolve()) if checked_denylist else "",
        denylist_sha256=checked_denylist.sha256 if checked_denylist else "",
        personal_data=personal_data,
    )
    renderer = ChatRenderer(tokenizer_dir)  # fail early, in the driver, on a bad tokenizer
    tasks = plan_shards(paths, shard_bytes)
    formats = _decide_layouts(tasks, input_format, column_map)
    tasks = [replace(t, layout=formats[t.path]["format"]) for t in tasks]
    selected = select_shards(part, len(tasks)) if part else range(len(tasks))
    done = {t.shard_id: s for t in tasks if (s := _finished(t, settings, out)) is not None}
    todo = [t for t in tasks if t.shard_id not in done and t.shard_id in selected]
    if merge and todo:
        raise UserError(f"{out}: cannot merge: {_id_list([t.shard_id for t in todo])} of {len(tasks)} "
                        "shards are not finished (run their --part first, with the same inputs and options)")
    workers = max(1, min(workers or os.cpu_count() or 1, len(todo) or 1))
    log.info(
        "%d input file(s), %d shard(s): %d already finished, %d to do with %d worker(s)",
        len(paths),
        len(tasks),
        len(done),
        len(todo),
        workers,
    )
    started = time.perf_counter()
    if part:
        _run(todo, settings, out, workers, progress)
        log.info("%s: shards %s of %d finished (%.1f s); when every part is, run once more with --merge",
                 out, _id_list(list(selected)), len(tasks), time.perf_counter() - started)
        return None
    # The inputs' sha256 (recorded for the data policy's check) is read beside the workers.
    with ThreadPoolExecutor(max_workers=min(4, len(paths))) as hashing:
        input_hashes = hashing.map(sha256_file, paths)
        done.update(_run(todo, settings, out, workers, progress))
        sources = [_source_record(p, digest) for p, digest in zip(paths, input_hashes)]
    manifest = _write_manifest(tasks, done, settings, renderer, sources, out, formats, provenance)
    elapsed = time.perf_counter() - started
    log.info(
        "%s: %d documents, %d tokens, %d rejected of %d lines (%.1f s)",
        out,
        manifest["documents"],
        manifest["tokens"]["total"],
        manifest["rejected"],
        manifest["lines_read"],
        elapsed,
    )
    return manifest


def select_shards(part: str, shards: int) -> range:
    """The shard ids of ``part``: ``I/N`` (the I-th of N contiguous, near-equal ranges, I from 0;
    a Slurm array's ``$SLURM_ARRAY_TASK_ID/$SLURM_ARRAY_TASK_COUNT``) or ``START:END``."""
    try:
        if "/" in part:
            i, n = (int(x) for x in part.split("/"))
            if not 0 <= i < n:
                raise ValueError
            return range(i * shards // n, (i + 1) * shards // n)
        start, end = (int(x) for x in part.split(":"))
        if not 0 <= start < end:
            raise ValueError
        return range(start, min(end, shards))
    except ValueError:
        raise UserError(f"--part {part!r}: expected I/N (0 <= I < N) or START:END shard ids") from None


def _id_list(ids: list[int]) -> str:
    """``3``, ``3-7`` or ``3-7 (and 2 more ranges)``: shard ids for a log or an error."""
    if not ids:
        return "none"
    runs, start = [], ids[0]
    for prev, cur in zip(ids, ids[1:] + [None]):
        if cur != prev + 1:
            runs.append(f"{start}" if start == prev else f"{start}-{prev}")
            start = cur
    more = f" (and {len(runs) - 3} more ranges)" if len(runs) > 3 else ""
    return "shard " + ", ".join(runs[:3]) + more if len(ids) == 1 else "shards " + ", ".join(runs[:3]) + more


def _sidecar_provenance(paths: list[Path], out: Path) -> Provenance | None:
    """The record the inputs' provenance sidecars agree on (a pipeline's output), else None."""
    records = [read_provenance(p) for p in paths]
    if False in records:
        return None  # a missing input: planning the shards names it
    for path, record in zip(paths, records):
        if not isinstance(record, dict):
            raise UserError(f"{path}{SIDECAR_SUFFIX}: not a provenance record (a JSON object expected)")
    digests = {r.get("digest") for r in records}
    if len(digests) == 1 and None not in digests:
        provenance = checked_record(records[0], paths[0])
        log.info("%s: provenance from the inputs' sidecar (%s)", out, records[0]["id"])
        return provenance
    log.warning("%s: no provenance declared (--source/--license/--basis/--form, or a provenance "
                "section in the prepare YAML): the dataset's provenance is unknown, and the default "
                "data policy refuses to train on it", out)
    return None


def _source_record(path: Path, sha256: str) -> dict:
    stat = path.stat()
    return {"path": str(path.resolve()), "bytes": stat.st_size, "mtime_ns": stat.st_mtime_ns,
            "sha256": sha256}


def check_denylist(denylist: str | Path | None, tokenizer_dir: str | Path):
    """The denylist, read and checked against the tokenizer (one-line UserError otherwise)."""
    if not denylist:
        return None
    from mimir_megatron.audits.denylist import Denylist

    if not (Path(tokenizer_dir) / "tokenizer.json").is_file():
        return None  # ChatRenderer names the bad tokenizer directory
    checked = Denylist(denylist, tokenizer_hash(tokenizer_dir))
    log.info("denylist %s: %d token sequences (%s-gram overlaps)", denylist, len(checked), checked.ngram)
    return checked


def _decide_layouts(tasks: list[ShardTask], input_format: str, columns: dict[str, str]) -> dict[str, dict]:
    """Per input file: its layout and, for ``auto``, the votes of its first lines."""
    if input_format == "auto" and columns:
        input_format = "columns"  # a column mapping names the layout
    decided: dict[str, dict] = {}
    for task in tasks:
        if task.path in decided:
            continue
        if input_format != "auto":
            decided[task.path] = {"requested": input_format, "format": input_format}
            continue
        sample = sample_records(Path(task.path), task.kind, DETECT_LINES)
        record = detect_layout(sample, task.path, columns)
        decided[task.path] = {"requested": "auto", **record}
        log.info("%s: input layout %s (first %d lines: %s)", task.path, record["format"],
                 record["sampled"], record["matches"])
    return decided


def _run(
    todo: list[ShardTask], settings: PrepareSettings, out: Path, workers: int, show: bool
) -> dict[int, ShardStats]:
    from tqdm import tqdm

    results: dict[int, ShardStats] = {}
    if not todo:
        return results
    bar = tqdm(total=None, unit="doc", disable=not show, dynamic_ncols=True, desc="prepare")
    counts = {"docs": 0, "tokens": 0, "rejects": 0}
    start = time.perf_counter()

    def report(docs: int, tokens: int, rejects: int) -> None:
        counts["docs"] += docs
        counts["tokens"] += tokens
        counts["rejects"] += rejects
        rate = time.perf_counter() - start
        bar.update(docs + rejects)
        bar.set_postfix(
            docs_s=f"{counts['docs'] / max(rate, 1e-9):.0f}",
            tok_s=f"{counts['tokens'] / max(rate, 1e-9):.0f}",
            rejects=counts["rejects"],
            refresh=False,
        )

    global _progress
    try:
        if workers == 1:
            _init_worker(settings.tokenizer_dir, None)
            _progress = report
            for task in todo:
                results[task.shard_id] = process_shard(task, settings, str(out))
            return results
        ctx = mp.get_context("spawn")  # fork after torch/tokenizers threads start is unsafe
        progress_queue = ctx.Queue()
        with ctx.Pool(workers, _init_worker, (settings.tokenizer_dir, progress_queue)) as pool:
            pending = [pool.apply_async(process_shard, (t, settings, str(out))) for t in todo]
            while pending:
                try:
                    while True:
                        report(*progress_queue.get(timeout=0.2))
                except queue.Empty:
                    pass
                for job in [j for j in pending if j.ready()]:
                    stats = job.get()  # re-raises a worker's StrictModeError here
                    results[stats.shard_id] = stats
                    pending.remove(job)
            while not progress_queue.empty():
                report(*progress_queue.get())
        return results
    finally:
        _progress = None
        bar.close()


def _write_manifest(
    tasks: list[ShardTask],
    stats: dict[int, ShardStats],
    settings: PrepareSettings,
    renderer: ChatRenderer,
    sources: list[dict],
    out: Path,
    formats: dict[str, dict],
    provenance: Provenance | None,
) -> dict:
    rejects = {r: 0 for r in REJECT_REASONS}
    personal: dict[str, int] = {}
    totals = {"lines": 0, "documents": 0, "prefix": 0, "response": 0, "truncated": 0, "stripped": 0}
    outputs: dict[str, str] = {}
    shards = []
    rejects_tmp = out / (REJECTS_NAME + f".tmp{os.getpid()}")
    with rejects_tmp.open("wb") as merged:
        for task in tasks:
            s = stats[task.shard_id]
            totals["lines"] += s.lines
            totals["documents"] += s.documents
            totals["prefix"] += s.prefix_tokens
            totals["response"] += s.response_tokens
            totals["truncated"] += s.truncated
            totals["stripped"] += s.control_chars_stripped
            for reason, n in s.rejects.items():
                rejects[reason] += n
            for kind, n in s.personal_data.items():
                personal[kind] = personal.get(kind, 0) + n
            outputs.update({k: v for k, v in s.files.items() if not k.endswith(".rejects.jsonl")})
            shards.append(
                {
                    "prefix": f"{SHARDS_DIR}/{task.shard_id:05d}",
                    "documents": s.documents,
                    "source": task.path,
                    "first_line": task.first_line,
                    "lines": s.lines,
                }
            )
            with (out / SHARDS_DIR / f"{task.shard_id:05d}.rejects.jsonl").open("rb") as part:
                while block := part.read(1 << 22):
                    merged.write(block)
    os.replace(rejects_tmp, out / REJECTS_NAME)
    outputs[REJECTS_NAME] = sha256_file(out / REJECTS_NAME)
    rejected = sum(rejects.values())
    assert totals["documents"] + rejected == totals["lines"], "accepted + rejected != lines read"
    from megatron.core.datasets.indexed_dataset import DType

    manifest = {
        "format": FORMAT,
        "layout": f"{SEQUENCES_PER_DOCUMENT} sequences per document: prefix, then response",
        "sources": sources,
        "provenance": stored_record(provenance),
        "tokenizer": {
            "path": settings.tokenizer_dir,
            "sha256": settings.tokenizer_sha256,
            "vocab_size": renderer.vocab_size,
            "pad_token_id": renderer.tokenizer.pad_token_id,
            "eos_token_id": renderer.tokenizer.eos_token_id,
            # What generation stops on; every response ends with one of them when the template
            # writes one (mimir_megatron.chat.end_of_turn_ids).
            "end_of_turn_ids": renderer.end_of_turn_ids,
        },
        "dtype": np.dtype(DType.optimal_dtype(renderer.vocab_size)).name,
        "settings": {
            "seq_len": settings.seq_len,
            "too_long": settings.too_long,
            "min_response_tokens": settings.min_response_tokens,
            "input_format": settings.input_format,
            "columns": dict(settings.columns),
            "control_chars": settings.control_chars,
            "denylist": ({"path": settings.denylist, "sha256": settings.denylist_sha256}
                         if settings.denylist else None),
        },
        "input_formats": {path: formats[path] for path in dict.fromkeys(t.path for t in tasks)},
        "lines_read": totals["lines"],
        "accepted": totals["documents"],
        "rejected": rejected,
        "rejects": rejects,
        "truncated": totals["truncated"],
        "control_chars_stripped": totals["stripped"],
        "personal_data": {"policy": settings.personal_data, "found": dict(sorted(personal.items())),
                          "documents_rejected": rejects["personal_data"]},
        "documents": totals["documents"],
        "tokens": {
            "prefix": totals["prefix"],
            "response": totals["response"],
            "total": totals["prefix"] + totals["response"],
        },
        "shards": shards,
        "outputs": dict(sorted(outputs.items())),
    }
    manifest["digest"] = manifest_digest(manifest)
    _write_json_atomic(out / MANIFEST_NAME, manifest)
    return manifest
