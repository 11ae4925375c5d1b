"""The project's integrity primitives: file digests, the canonical digest of a JSON record, and
atomic writes. Every stored record (checkpoint state, manifest, provenance, reports, indexes,
the run lock) uses these, so one file decides how a digest is computed and how a file appears.

- :func:`sha256_file` hashes a file in blocks (``hashlib.file_digest`` releases the GIL, so
  threads hash files in parallel).
- :func:`json_digest` is the sha256 of a record's canonical encoding: keys sorted, non-ASCII kept
  as UTF-8 (``ensure_ascii=False``), json's default separators. A record's own ``digest`` entry is
  left out, so a self-digesting record stores ``digest = json_digest(record)``. Records written
  before this module used ``ensure_ascii=True`` for the trainer state; the encodings agree on ASCII
  content, and :func:`digest_matches` accepts either for records that may predate it.
- :func:`write_bytes_atomic` / :func:`write_json_atomic`: a temporary file in the same directory
  (named per process, so two writers never share one), flushed and fsynced, then renamed over the
  target: a reader sees the old file or the new one, never a torn one, and a crash leaves no
  partial record under the real name.
- :func:`read_json_object` / :func:`refuse_if_edited`: the reading side of a self-digesting JSON
  record: the stored object (a one-line error naming the file when it is missing, not JSON or not
  an object) and the refusal of one whose content no longer matches its digest, or that lacks the
  digest its format always carries.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from mimir_megatron.errors import UserError

DIGEST_KEY = "digest"


def sha256_file(path: str | Path) -> str:
    """sha256 (hex) of a file's bytes."""
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def sha256_bytes(data: bytes) -> str:
    """sha256 (hex) of ``data``."""
    return hashlib.sha256(data).hexdigest()


def canonical_json(value: Any) -> bytes:
    """The one encoding digests are computed over (sorted keys, UTF-8, default separators)."""
    return json.dumps(value, sort_keys=True, ensure_ascii=False).encode("utf-8")


def json_digest(record: Mapping[str, Any], exclude: str = DIGEST_KEY) -> str:
    """sha256 of ``record``'s canonical encoding without its ``exclude`` entry (its own digest)."""
    return sha256_bytes(canonical_json({k: v for k, v in record.items() if k != exclude}))


def digest_matches(record: Mapping[str, Any], exclude: str = DIGEST_KEY) -> bool:
    """Whether ``record[exclude]`` is the digest of the rest of it, under the canonical encoding
    or the ASCII-escaped one that records written before this module used."""
    stored = record.get(exclude)
    if stored == json_digest(record, exclude):
        return True
    body = {k: v for k, v in record.items() if k != exclude}
    return stored == sha256_bytes(json.dumps(body, sort_keys=True).encode("ascii"))


def with_digest(record: Mapping[str, Any]) -> dict[str, Any]:
    """``record`` with its ``digest`` entry set (computed over the content as JSON reads it back,
    so tuples and lists, or int-like keys, digest the same before and after a round trip)."""
    body = json.loads(json.dumps({k: v for k, v in record.items() if k != DIGEST_KEY}))
    return {**body, DIGEST_KEY: json_digest(body)}


def write_bytes_atomic(path: str | Path, data: bytes, *, fsync: bool = True) -> Path:
    """Write ``data`` to ``path`` atomically (temporary file, fsync, rename); the path written."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    try:
        with open(tmp, "wb") as f:
            f.write(data)
            if fsync:
                f.flush()
                os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    if fsync:
        _fsync_directory(path.parent)
    return path


def write_json_atomic(path: str | Path, value: Any, *, indent: int | None = 2, sort_keys: bool = False,
                      fsync: bool = True) -> Path:
    """Write ``value`` as UTF-8 JSON (one trailing newline) to ``path`` atomically."""
    text = json.dumps(value, indent=indent, sort_keys=sort_keys, ensure_ascii=False) + "\n"
    return write_bytes_atomic(path, text.encode("utf-8"), fsync=fsync)


def _fsync_directory(directory: Path) -> None:
    # The rename is durable only once the directory entry is; some filesystems refuse O_RDONLY
    # directory fsync (it is then a best effort, as in most databases' code).
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def read_json_object(path: Path, what: str, *, missing: str | None = None) -> dict[str, Any]:
    """The JSON object stored at ``path`` (a ``what``: "plan", "results file", ...); a one-line
    :class:`UserError` naming the file when it is missing (``missing``, default "PATH: not found"),
    unreadable, not JSON or not an object."""
    try:
        body = json.loads(path.read_text())
    except FileNotFoundError:
        raise UserError(missing or f"{path}: not found") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise UserError(f"{path}: not a {what} (invalid JSON: {exc})") from None
    if not isinstance(body, dict):
        raise UserError(f"{path}: not a {what} (a JSON object expected)")
    return body


def refuse_if_edited(record: Mapping[str, Any], path: str | Path, writer: str | None = None, *,
                     required: bool = False) -> None:
    """A one-line :class:`UserError` when ``record`` holds a digest its content no longer matches
    (``writer``: the command that wrote it, named in the message), or holds none though
    ``required`` (its format is one whose writer always records the digest: only files of older
    formats, written before digests were, may lack one)."""
    by = f"`{writer}` wrote it" if writer else "it was written"
    if DIGEST_KEY not in record:
        if required:
            raise UserError(f"{path}: has no digest, though the version that wrote it records one (deleted "
                            f"after {by}?); {'run `' + writer + '` again' if writer else 'write it again'}")
        return
    if not digest_matches(record):
        raise UserError(f"{path}: edited after {by} (its digest does not match its content)")
