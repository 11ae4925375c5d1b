"""Damage a stored record by hand, as someone with an editor would, and expect its reader's refusal.

Every record's tests make the same edits (a field dropped, a field set to a wrong type or an
unknown version, content changed under its digest) and expect the same answer: one line that
starts with the file's path and says what is wrong. ``reseal`` recomputes a record's own digest
after an edit, so that only the check under test can catch it.

    damage(path, put("3", "documents"), reseal())
    assert_refused(lambda: Manifest.read(path.parent), path, "documents: a non-negative integer")
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from mimir_megatron.errors import UserError

Change = Callable[[Any], None]
"""An edit of a parsed record, in place."""


def _parent(record: Any, keys: tuple[Any, ...]) -> Any:
    for key in keys[:-1]:
        record = record[key]
    return record


def drop(*keys: Any) -> Change:
    """Delete ``record[k1][k2]...[kn]``."""
    def change(record: Any) -> None:
        del _parent(record, keys)[keys[-1]]
    return change


def put(value: Any, *keys: Any) -> Change:
    """Set ``record[k1][k2]...[kn] = value``."""
    def change(record: Any) -> None:
        _parent(record, keys)[keys[-1]] = value
    return change


def reseal(key: str = "digest", *, leave_out: tuple[str, ...] = ()) -> Change:
    """A careful hand edit: the record's own digest (stored under ``key``) computed again over the
    rest of it (less ``leave_out``, for records whose digest does not cover every field)."""
    from mimir_megatron.integrity import json_digest

    def change(record: dict[str, Any]) -> None:
        record[key] = json_digest({k: v for k, v in record.items() if k not in leave_out}, exclude=key)
    return change


def damage(path: Path, *changes: Change) -> None:
    """Apply ``changes`` to the JSON record at ``path``, in order, and write it back."""
    record = json.loads(path.read_text())
    for change in changes:
        change(record)
    path.write_text(json.dumps(record) + "\n")  # one line: a JSONL record's file reads it too


def assert_refused(read: Callable[[], Any], path: Path, says: str) -> str:
    """``read()`` raises a :class:`UserError` of one line that starts with ``path`` and holds
    ``says``; the line."""
    with pytest.raises(UserError) as caught:
        read()
    line = str(caught.value)
    assert line.startswith(f"{path}: ") and "\n" not in line and says in line, line
    return line
