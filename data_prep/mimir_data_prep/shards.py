"""Splitting input files into shards that workers process independently.

A JSONL shard is a byte range that starts and ends on line boundaries, together with the line
number of its first line, so that rejects can name the exact line without a worker reading the
whole file. A Parquet shard is one row group. Shards are small enough that a worker's memory is
bounded by the shard size, never by the input size.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Iterator, Union

from mimir_megatron.errors import UserError

DEFAULT_SHARD_BYTES = 64 * 1024 * 1024
_BLOCK = 1 << 20


@dataclass(frozen=True)
class ShardTask:
    """One unit of work: where to read, and which line number the first record has."""

    shard_id: int
    path: str
    kind: str  # "jsonl" or "parquet"
    start: int  # byte offset (jsonl) or row group index (parquet)
    stop: int  # byte offset, exclusive (jsonl) or row group index + 1 (parquet)
    first_line: int  # 1-based line (jsonl) or row (parquet) number of the first record
    layout: str = "messages"  # input layout of the file (see layouts.py), decided per file

    def to_dict(self) -> dict:
        return asdict(self)


def input_kind(path: Path) -> str:
    name = path.name.lower()
    if name.endswith((".jsonl", ".json", ".ndjson")):
        return "jsonl"
    if name.endswith(".parquet"):
        return "parquet"
    raise UserError(f"{path}: unsupported input type (expected .jsonl or .parquet)")


def plan_shards(paths: list[Path], shard_bytes: int = DEFAULT_SHARD_BYTES) -> list[ShardTask]:
    """Shards of all inputs in input order; shard ids are consecutive from 0."""
    tasks: list[ShardTask] = []
    for path in paths:
        if not path.is_file():
            raise UserError(f"{path}: input file not found")
        kind = input_kind(path)
        ranges = _jsonl_ranges(path, shard_bytes) if kind == "jsonl" else _parquet_ranges(path)
        for start, stop, first_line in ranges:
            tasks.append(ShardTask(len(tasks), str(path.resolve()), kind, start, stop, first_line))
    return tasks


def _jsonl_ranges(path: Path, shard_bytes: int) -> list[tuple[int, int, int]]:
    size = path.stat().st_size
    ranges = []
    start, line = 0, 1
    with path.open("rb") as f:
        while start < size:
            f.seek(min(start + shard_bytes, size) - 1)
            f.readline()  # finish the line that holds the target offset
            stop = min(f.tell(), size)
            ranges.append((start, stop, line))
            f.seek(start)
            remaining = stop - start
            while remaining:
                block = f.read(min(_BLOCK, remaining))
                line += block.count(b"\n")
                remaining -= len(block)
            start = stop
    return ranges


def _parquet_ranges(path: Path) -> list[tuple[int, int, int]]:
    import pyarrow.parquet as pq

    try:
        meta = pq.ParquetFile(path).metadata
    except Exception as exc:  # pyarrow raises ArrowInvalid and friends
        raise UserError(f"{path}: not a readable Parquet file ({exc})") from None
    ranges, row = [], 1
    for group in range(meta.num_row_groups):
        ranges.append((group, group + 1, row))
        row += meta.row_group(group).num_rows
    return ranges


def iter_jsonl(task: ShardTask) -> Iterator[tuple[int, bytes]]:
    """(line number, raw bytes without the line ending) of every line in the shard."""
    with open(task.path, "rb") as f:
        f.seek(task.start)
        line = task.first_line
        pos = task.start
        while pos < task.stop:
            raw = f.readline()
            if not raw:
                break
            pos += len(raw)
            yield line, raw.rstrip(b"\r\n")
            line += 1


@dataclass(frozen=True)
class CorruptRowGroup:
    """Rows of a Parquet row group that could not be read; counted as rejects, not a crash."""

    row_group: int
    rows: int  # rows of the group not read (all of them unless it broke part-way)
    detail: str


def iter_parquet(
    task: ShardTask, batch_size: int = 1024
) -> Iterator[tuple[int, Union[dict, CorruptRowGroup]]]:
    """(row number, row as a dict) of every row in the shard's row groups; a row group that
    fails to decode yields one (first unread row, CorruptRowGroup) and reading goes on."""
    import pyarrow.parquet as pq

    pf = pq.ParquetFile(task.path)
    row = task.first_line
    for group in range(task.start, task.stop):
        expected = pf.metadata.row_group(group).num_rows
        read = 0
        try:
            for batch in pf.iter_batches(batch_size=batch_size, row_groups=[group]):
                for record in batch.to_pylist():
                    yield row, record
                    row += 1
                    read += 1
        except Exception as exc:  # pyarrow raises OSError, ArrowInvalid, ... on corrupt pages
            yield row, CorruptRowGroup(group, expected - read, f"{type(exc).__name__}: {exc}")
            row += expected - read


def sample_records(path: Path, kind: str, limit: int) -> list:
    """The first ``limit`` decodable records of a file (for layout detection)."""
    import json

    out: list = []
    if kind == "jsonl":
        with path.open("rb") as f:
            for raw in f:
                if len(out) >= limit:
                    break
                try:
                    out.append(json.loads(raw))
                except (json.JSONDecodeError, UnicodeDecodeError):
                    continue  # blank or broken lines are rejected later, they do not vote
        return out
    import pyarrow.parquet as pq

    pf = pq.ParquetFile(path)
    for group in range(pf.metadata.num_row_groups):
        try:
            for batch in pf.iter_batches(batch_size=limit, row_groups=[group]):
                out += batch.to_pylist()[: limit - len(out)]
                break
        except Exception:  # a corrupt group does not vote; it is counted when prepared
            continue
        if len(out) >= limit:
            break
    return out
