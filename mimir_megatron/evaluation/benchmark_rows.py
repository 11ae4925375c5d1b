"""Rows of a benchmark from local files in the benchmark's own column layout.

JSONL, Parquet, or a directory written by `datasets`' ``save_to_disk``. No dataset hub is
reached. Nested columns are addressed with dotted paths (``choices.text``, ``translation.da``).
"""

from __future__ import annotations

import json
import string
from pathlib import Path
from typing import Any

from mimir_megatron.errors import UserError


class MissingData(UserError):
    """A task's data file is absent: the message names the task and the expected path."""


def load_rows(path: Path, task: str, split: str = "") -> list[dict[str, Any]]:
    """Every row of a JSONL / Parquet file or a save_to_disk directory, as plain dicts."""
    if not path.exists():
        raise MissingData(f"task {task}: data not found at {path} (expected a JSONL or Parquet file "
                          "or a datasets save_to_disk directory in the benchmark's column layout)")
    if path.is_dir():
        return _load_saved_dataset(path, task, split)
    if path.suffix == ".parquet":
        import pyarrow.parquet as pq

        return pq.read_table(path).to_pylist()
    if path.suffix in (".jsonl", ".json"):
        rows = []
        with path.open(encoding="utf-8") as f:
            for number, line in enumerate(f, 1):
                if line.strip():
                    try:
                        rows.append(json.loads(line))
                    except json.JSONDecodeError as exc:
                        raise UserError(f"task {task}: {path}:{number}: not JSON ({exc.msg})") from exc
        return rows
    raise UserError(f"task {task}: {path}: unsupported file type (use .jsonl, .parquet or a "
                    "save_to_disk directory)")


def _load_saved_dataset(path: Path, task: str, split: str) -> list[dict[str, Any]]:
    import datasets

    loaded = datasets.load_from_disk(str(path))
    if isinstance(loaded, datasets.DatasetDict):
        if not split:
            if len(loaded) != 1:
                raise UserError(f"task {task}: {path} holds splits {sorted(loaded)}; set the task's `split`")
            split = next(iter(loaded))
        if split not in loaded:
            raise UserError(f"task {task}: {path} has no split {split!r} (has {sorted(loaded)})")
        loaded = loaded[split]
    return loaded.to_list()


def lookup(row: dict[str, Any], path: str) -> Any:
    """The value at a dotted column path; KeyError naming the path when absent."""
    value: Any = row
    for part in path.split("."):
        if isinstance(value, dict) and part in value:
            value = value[part]
        elif isinstance(value, list) and part.isdigit() and int(part) < len(value):
            value = value[int(part)]
        else:
            raise KeyError(path)
    return value


class _RowFormatter(string.Formatter):
    """``str.format`` whose fields are dotted column paths."""

    def get_field(self, field_name: str, args, kwargs):  # noqa: ANN001 (string.Formatter's API)
        return lookup(kwargs, field_name), field_name


_FORMATTER = _RowFormatter()


def render(template: str, row: dict[str, Any]) -> str:
    return _FORMATTER.format(template, **row)


def template_fields(template: str) -> list[str]:
    """The ``{field}`` names a prompt template reads from a row, in order."""
    return [name for _, name, _, _ in string.Formatter().parse(template) if name]


def matches_filter(row: dict[str, Any], wanted: dict[str, Any]) -> bool:
    """True when every ``wanted`` column equals its value (always, for an empty filter)."""
    try:
        return all(lookup(row, k) == v for k, v in wanted.items())
    except KeyError:
        return False
