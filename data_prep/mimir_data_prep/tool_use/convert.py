"""`mimir synth tools`: convert public function-calling data into native tool use, line by line.

Every line read is accepted (converted unchanged in meaning), repaired (converted after a dangling
call or result was cut out) or rejected (with its reason, in the rejects file with file and line);
``accepted + repaired + rejected == lines_read``. Normalisations that keep the meaning (a
single-quoted argument string parsed, ``<|endoftext|>`` stripped, a schema recovered) are counted
as notes. The output is written under a temporary name and renamed when complete.
"""

from __future__ import annotations

import json
import logging
from collections import Counter
from pathlib import Path
from typing import Any, Iterator

from mimir_megatron.data.provenance import derived_provenance, write_sidecar
from mimir_megatron.errors import UserError
from mimir_megatron.integrity import atomic_files

from ..shards import CorruptRowGroup, iter_parquet, plan_shards
from .assemble import DANGLING_POLICIES, assemble
from .formats import FORMATS, detect_format, read
from .trace import REJECT_REASONS, REPAIR_REASONS, ConversionError

log = logging.getLogger(__name__)


def rejects_path(output: Path) -> Path:
    return output.with_name(output.name.removesuffix(".jsonl") + ".rejects.jsonl")


def report_path(output: Path) -> Path:
    return output.with_name(output.name.removesuffix(".jsonl") + ".report.json")


def convert_line(
    raw: bytes, fmt: str = "auto", dangling: str = "drop-part"
) -> tuple[dict, str, Counter, Counter]:
    """(sample, format, repairs, notes) for one JSONL line; ConversionError if it is rejected."""
    if not raw.strip():
        raise ConversionError("empty_line", "blank line")
    try:
        obj = json.loads(raw.decode("utf-8"))
    except UnicodeDecodeError as exc:
        raise ConversionError("invalid_utf8", f"byte {exc.start}: {exc.reason}") from None
    except json.JSONDecodeError as exc:
        raise ConversionError("malformed_json", f"column {exc.colno}: {exc.msg}") from None
    except RecursionError:  # json recurses once per nesting level
        raise ConversionError("malformed_json", "nested too deeply") from None
    return convert_record(obj, fmt, dangling)


def convert_record(
    obj: Any, fmt: str = "auto", dangling: str = "drop-part"
) -> tuple[dict, str, Counter, Counter]:
    """(sample, format, repairs, notes) for one decoded line or Parquet row."""
    found = detect_format(obj) if fmt == "auto" else fmt
    if found is None:
        keys = ", ".join(sorted(obj)[:12]) if isinstance(obj, dict) else type(obj).__name__
        raise ConversionError("unknown_format", f"no tool-use format fits (keys: {keys})")
    try:
        trace = read(obj, found)
        result = assemble(trace, dangling)
    except RecursionError:
        raise ConversionError("bad_schema", "nested too deeply") from None
    return result.sample, found, result.repairs, trace.notes


def _lines(path: Path, fmt: str, dangling: str) -> Iterator[tuple[int, int, Any, str]]:
    """(line or row number, lines it stands for, converted tuple or ConversionError, excerpt)."""
    if path.name.lower().endswith(".parquet"):
        for task in plan_shards([path]):
            for row, record in iter_parquet(task):
                if isinstance(record, CorruptRowGroup):
                    detail = f"row group {record.row_group}: {record.rows} row(s) unreadable: {record.detail}"
                    yield row, record.rows, ConversionError("corrupt_row_group", detail), ""
                    continue
                # Parquet fills the columns a row lacks with None; such keys are absent.
                record = {k: v for k, v in record.items() if v is not None}
                try:
                    yield row, 1, convert_record(record, fmt, dangling), ""
                except ConversionError as exc:
                    yield row, 1, exc, json.dumps(record, ensure_ascii=False, default=str)[:200]
        return
    with path.open("rb") as f:
        for number, line in enumerate(f, 1):
            raw = line.rstrip(b"\r\n")
            try:
                yield number, 1, convert_line(raw, fmt, dangling), ""
            except ConversionError as exc:
                yield number, 1, exc, raw[:200].decode("utf-8", errors="replace")


def convert_files(
    inputs: list[str | Path],
    output: str | Path,
    *,
    fmt: str = "auto",
    dangling: str = "drop-part",
    progress: bool = True,
) -> dict[str, Any]:
    """Convert JSONL or Parquet ``inputs`` into one JSONL file; returns the report (also written
    beside it)."""
    if fmt != "auto" and fmt not in FORMATS:
        raise UserError(f"--format must be auto or one of {FORMATS}, got {fmt!r}")
    if dangling not in DANGLING_POLICIES:
        raise UserError(f"--dangling must be one of {DANGLING_POLICIES}, got {dangling!r}")
    paths = [Path(p) for p in inputs]
    for path in paths:
        if not path.is_file():
            raise UserError(f"{path}: input file not found")
    out = Path(output)
    out.parent.mkdir(parents=True, exist_ok=True)
    counts = {"lines_read": 0, "accepted": 0, "repaired": 0, "rejected": 0}
    rejects = Counter({r: 0 for r in REJECT_REASONS})
    repairs = Counter({r: 0 for r in REPAIR_REASONS})  # lines repaired for each reason
    parts_dropped: Counter[str] = Counter()
    notes: Counter[str] = Counter()
    formats: Counter[str] = Counter()
    from tqdm import tqdm

    bar = tqdm(desc="synth tools", unit=" lines", disable=not progress, dynamic_ncols=True)
    try:
        with (atomic_files(out, rejects_path(out)) as (out_tmp, rejects_tmp),
              out_tmp.open("w", encoding="utf-8") as sink, rejects_tmp.open("w") as bad):
            for path in paths:
                for number, lines, converted, excerpt in _lines(path, fmt, dangling):
                    counts["lines_read"] += lines
                    bar.update(lines)
                    if isinstance(converted, ConversionError):
                        counts["rejected"] += lines
                        rejects[converted.reason] += lines
                        entry = {"file": str(path), "line": number, "reason": converted.reason}
                        entry.update(detail=converted.detail, excerpt=excerpt)
                        bad.write(json.dumps(entry, ensure_ascii=False) + "\n")
                        continue
                    sample, found, fixed, noted = converted
                    formats[found] += 1
                    notes.update({k: v for k, v in noted.items() if v})
                    if fixed:
                        counts["repaired"] += 1
                        repairs.update(dict.fromkeys(fixed, 1))
                        parts_dropped.update(fixed)
                    else:
                        counts["accepted"] += 1
                    meta = {"source": str(path), "line": number, "format": found}
                    if fixed:
                        meta["repairs"] = dict(sorted(fixed.items()))
                    sink.write(json.dumps({**sample, "meta": meta}, ensure_ascii=False) + "\n")
    finally:
        bar.close()
    assert counts["accepted"] + counts["repaired"] + counts["rejected"] == counts["lines_read"]
    report = {
        "inputs": [str(p) for p in paths],
        "output": str(out),
        "rejects_file": str(rejects_path(out)),
        "settings": {"format": fmt, "dangling": dangling},
        **counts,
        "formats": dict(sorted(formats.items())),
        "rejects": dict(rejects),
        "repairs": dict(repairs),
        "parts_dropped": dict(sorted(parts_dropped.items())),
        "notes": dict(sorted(notes.items())),
    }
    report_path(out).write_text(json.dumps(report, indent=2) + "\n")
    # A conversion keeps its inputs' basis and licences; the sidecar records them for `mimir prepare`.
    write_sidecar(out, derived_provenance(paths, id=out.name.removesuffix(".jsonl"),
                                          source=f"mimir synth tools ({', '.join(sorted(formats)) or fmt})",
                                          form="tool-call-formatted"))
    log.info(
        "%s: %d lines: %d accepted, %d repaired, %d rejected %s",
        out,
        counts["lines_read"],
        counts["accepted"],
        counts["repaired"],
        counts["rejected"],
        {k: v for k, v in rejects.items() if v},
    )
    return report
