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
- :func:`atomic_files`: the same for files written as streams (shards, JSONL outputs, indexes),
  one or several that appear together: the caller writes the temporary paths it is handed; when
  its block ends they are fsynced and renamed over their targets, and on an error removed.
- :func:`directory_sha256`: the digest of a directory's files (names and bytes), the one rule for
  tokenizer directories and benchmark data.
- :func:`fingerprint`: the sha256 of a JSON value's canonical encoding, for what a file records to
  recognise its inputs again (a shard's key, a mixture, a synthetic pipeline, a source row); a
  :class:`Fingerprint` also matches the value recorded by versions that encoded it ASCII-escaped.
- :func:`read_json_object` / :func:`refuse_if_edited` / :class:`RecordFields`: the reading side
  of a self-digesting JSON record: the stored object (a one-line error naming the file when it is
  missing, not JSON or not an object), the refusal of one whose content no longer matches its
  digest, or that lacks the digest its format always carries, and its fields by type (one line
  naming the file and the field when one is missing or of another type).
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
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


def canonical_json(value: Any, default: Callable[[Any], Any] | None = None) -> bytes:
    """The one encoding digests are computed over (sorted keys, UTF-8, default separators);
    ``default``: json's, for values JSON has no type for (a fingerprint takes their ``str``)."""
    return json.dumps(value, sort_keys=True, ensure_ascii=False, default=default).encode("utf-8")


class Fingerprint(str):
    """The hex sha256 of a value's canonical encoding (a plain string where it is stored or shown)
    that also knows the one of the ASCII-escaped encoding versions before this module recorded:
    :meth:`matches` a fingerprint written by either, so a file fingerprinted before (a shard's
    stats, a checkpoint's data fingerprint, a pipeline stamp) is still recognised. The two agree
    on ASCII content. Made by :func:`fingerprint`."""

    earlier: str

    def __new__(cls, digest: str, earlier: str = "") -> Fingerprint:
        made = super().__new__(cls, digest)
        made.earlier = earlier or digest
        return made

    def __getnewargs__(self) -> tuple[str, str]:  # type: ignore[override]  # pickles and copies keep both
        return str(self), self.earlier

    def matches(self, recorded: object) -> bool:
        """Whether ``recorded`` (a stored fingerprint) is this one, in either encoding."""
        return recorded == str(self) or recorded == self.earlier


def fingerprint(value: Any) -> Fingerprint:
    """sha256 of ``value``'s canonical JSON encoding (a value JSON has no type for as its ``str``),
    knowing the ASCII-escaped one of earlier versions too."""
    return Fingerprint(sha256_bytes(canonical_json(value, default=str)),
                       sha256_bytes(json.dumps(value, sort_keys=True, default=str).encode("ascii")))


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


def directory_sha256(directory: str | Path, *, recursive: bool = True, end_each_file: bool = False) -> str:
    """sha256 over the files of ``directory`` in path order: each file's path relative to it, a
    NUL byte, its bytes (and a NUL after them with ``end_each_file``). ``recursive=False`` takes
    the files directly in it. The tokenizer's digest (top level, each file ended) and a
    benchmark's data digest (every file, not ended) are both recorded by files written before
    (manifests, audit indexes, denylists, contamination reports), so each keeps its variant."""
    directory = Path(directory)
    files = sorted(p for p in (directory.rglob("*") if recursive else directory.iterdir()) if p.is_file())
    digest = hashlib.sha256()
    for path in files:
        digest.update(str(path.relative_to(directory)).encode() + b"\0")
        with open(path, "rb") as f:
            while block := f.read(1 << 22):
                digest.update(block)
        if end_each_file:
            digest.update(b"\0")
    return digest.hexdigest()


def temporary_path(path: Path, suffix: str = "") -> Path:
    """Where :func:`atomic_files` stages ``path``: beside it, hidden, named per process."""
    return path.with_name(f".{path.name}.tmp{os.getpid()}{suffix}")


def remove_temporaries(*paths: str | Path) -> None:
    """Delete what writers of ``paths`` killed mid-write left staged (every process's): only for a
    writer that holds its output alone (a resumed build overwriting its own leftovers)."""
    for path in map(Path, paths):
        for stale in path.parent.glob(f".{path.name}.tmp*"):
            stale.unlink(missing_ok=True)


@contextmanager
def atomic_files(*paths: str | Path, suffix: str = "", fsync: bool = True) -> Iterator[tuple[Path, ...]]:
    """Write the files ``paths`` so that each appears whole or not at all: the block gets a
    temporary path for each (:func:`temporary_path`; ``suffix`` kept last, for writers that
    append their own extension) and writes them; when it ends they are fsynced (unless
    ``fsync=False``: caches), renamed over their targets in order and their directories fsynced.
    When the block raises, the temporaries are removed and the targets left as they were.

        with atomic_files(out, rejects) as (out_tmp, rejects_tmp):
            ...
    """
    targets = [Path(p) for p in paths]
    staged = tuple(temporary_path(p, suffix) for p in targets)
    try:
        yield staged
        for tmp in staged:
            if fsync:
                _fsync_file(tmp)
        for tmp, target in zip(staged, targets):
            os.replace(tmp, target)
    except BaseException:
        for tmp in staged:
            tmp.unlink(missing_ok=True)
        raise
    if fsync:
        for directory in dict.fromkeys(p.parent for p in targets):
            _fsync_directory(directory)


def write_bytes_atomic(path: str | Path, data: bytes, *, fsync: bool = True) -> Path:
    """Write ``data`` to ``path`` atomically (temporary file, fsync, rename); the path written."""
    path = Path(path)
    with atomic_files(path, fsync=fsync) as (tmp,):
        tmp.write_bytes(data)
    return path


def write_json_atomic(path: str | Path, value: Any, *, indent: int | None = 2, sort_keys: bool = False,
                      fsync: bool = True) -> Path:
    """Write ``value`` as UTF-8 JSON (one trailing newline) to ``path`` atomically."""
    text = json.dumps(value, indent=indent, sort_keys=sort_keys, ensure_ascii=False) + "\n"
    return write_bytes_atomic(path, text.encode("utf-8"), fsync=fsync)


def _fsync_file(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


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


def is_number(value: Any) -> bool:
    """A JSON number: an int or a float, not a bool."""
    return isinstance(value, (int, float)) and not isinstance(value, bool)


class RecordFields:
    """Typed access to one JSON object of a stored record at ``path`` (``prefix``: where the object
    sits in the record, e.g. ``tasks.arith.``): a missing or mistyped field is a one-line
    :class:`UserError` naming the file and the field. ``missing_hint``: said after ``missing``."""

    missing_hint: str = ""

    def __init__(self, values: Mapping[str, Any], path: str | Path, prefix: str = "") -> None:
        self.values, self.path, self.prefix = values, path, prefix

    def get(self, name: str, check: Callable[[Any], bool], what: str, *, required: bool = True) -> Any:
        """``values[name]`` when ``check`` accepts it (``what`` it should be); None when it is
        absent or null and not ``required``."""
        if self.values.get(name) is None:
            if required:
                raise UserError(f"{self.path}: {self.prefix}{name}: missing{self.missing_hint}")
            return None
        value = self.values[name]
        if not check(value):
            raise UserError(f"{self.path}: {self.prefix}{name}: {what} expected, got {value!r}")
        return value

    def int(self, name: str, *, required: bool = True) -> Any:
        return self.get(name, lambda v: type(v) is int, "an integer", required=required)

    def number(self, name: str, *, required: bool = True) -> Any:
        return self.get(name, is_number, "a number", required=required)

    def str(self, name: str, *, required: bool = True) -> Any:
        return self.get(name, lambda v: isinstance(v, str), "a string", required=required)

    def bool(self, name: str, *, required: bool = True) -> Any:
        return self.get(name, lambda v: isinstance(v, bool), "true or false", required=required)

    def list(self, name: str, *, required: bool = True) -> Any:
        return self.get(name, lambda v: isinstance(v, list), "a list", required=required)

    def mapping(self, name: str, *, required: bool = True) -> Any:
        return self.get(name, lambda v: isinstance(v, dict), "a JSON object", required=required)

    def nested(self, name: str, *, required: bool = True) -> RecordFields | None:
        """The fields of the object ``name`` (prefixed ``name.``); None when absent and not required."""
        values = self.mapping(name, required=required)
        return None if values is None else type(self)(values, self.path, f"{self.prefix}{name}.")
