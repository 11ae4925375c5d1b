"""Source rows of a pipeline: JSONL lines or Parquet rows, each with a stable id and a hash.

The id is the row's ``id_field`` value, else its 1-based line (row) number; the sha256 of its
canonical JSON decides whether a finished row is still valid when the source has changed.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

from mimir_megatron.errors import UserError
from mimir_megatron.integrity import fingerprint


@dataclass(frozen=True)
class SourceRow:
    row_id: str
    number: int
    """1-based line (JSONL) or row (Parquet) number."""
    record: Any
    """The decoded object, or None when the line could not be decoded (see ``error``)."""
    sha256: str
    error: str | None = None


def record_sha256(record: Any) -> str:
    """A source row's fingerprint (what tells a row changed since it was decided)."""
    return str(fingerprint(record))


def source_kind(path: Path, declared: str = "auto") -> str:
    if declared != "auto":
        return declared
    name = path.name.lower()
    if name.endswith((".jsonl", ".ndjson", ".json")):
        return "jsonl"
    if name.endswith(".parquet"):
        return "parquet"
    raise UserError(f"{path}: cannot tell the format from the name; set source.format (jsonl or parquet)")


def _raw_records(path: Path, kind: str) -> Iterator[tuple[int, Any, str | None, bytes | None]]:
    if kind == "parquet":
        import pyarrow.parquet as pq

        number = 0
        for batch in pq.ParquetFile(path).iter_batches(batch_size=1024):
            for record in batch.to_pylist():
                number += 1
                yield number, record, None, None
        return
    with path.open("rb") as f:
        for number, raw in enumerate(f, start=1):
            raw = raw.rstrip(b"\r\n")
            if not raw.strip():
                continue  # blank lines are not rows
            try:
                record = json.loads(raw.decode("utf-8"))
            except (UnicodeDecodeError, json.JSONDecodeError) as exc:
                yield number, None, f"line {number}: not valid JSON ({exc})", raw
                continue
            if not isinstance(record, dict):
                yield number, None, f"line {number}: expected a JSON object, got {type(record).__name__}", raw
                continue
            yield number, record, None, None


def iter_source(path: Path, declared_format: str = "auto", id_field: str | None = None,
                limit: int | None = None) -> Iterator[SourceRow]:
    """Rows in file order; an undecodable line is a row with ``error`` set (counted, never dropped)."""
    if not path.is_file():
        raise UserError(f"source file not found: {path}")
    kind = source_kind(path, declared_format)
    seen: set[str] = set()
    count = 0
    for number, record, error, raw in _raw_records(path, kind):
        if limit is not None and count >= limit:
            return
        count += 1
        if error is not None:
            yield SourceRow(str(number), number, None, hashlib.sha256(raw or b"").hexdigest(), error)
            continue
        if id_field is not None:
            if record.get(id_field) in (None, ""):
                raise UserError(f"{path}:{number}: no {id_field!r} (source.id_field)")
            row_id = str(record[id_field])
        else:
            row_id = str(number)
        if row_id in seen:
            raise UserError(f"{path}:{number}: row id {row_id!r} occurs twice; ids must be unique "
                            f"(source.id_field={id_field!r})")
        seen.add(row_id)
        yield SourceRow(row_id, number, record, record_sha256(record))
