"""The append-only state file: one JSON line of row-level evidence per finished row.

A row is appended only once it is decided, in one ``write`` on an ``O_APPEND`` descriptor. A
run killed mid-row therefore leaves either nothing for that row (it is redone) or a partial last
line, which is cut off when the file is next opened. A killed process loses nothing it wrote (the
kernel has it); ``fsync`` runs at most once a second (and on close), so that an operating-system
crash costs at most the last second's rows, which are redone, without an 8 ms disk flush per
row stalling every request in flight. The file is the
only truth: the output files are derived from it, so a kill can neither lose nor duplicate a row.
One run at a time holds the directory's lock. Its lines are :class:`~.run_records.EvidenceRow`
records (read and written there); ``pipeline.json`` is the :class:`~.run_records.PipelineStamp`.
"""

from __future__ import annotations

import fcntl
import logging
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from mimir_megatron.errors import UserError
from mimir_megatron.integrity import Fingerprint

from .run_records import EvidenceRow, PipelineStamp

log = logging.getLogger(__name__)

STATE_NAME = "evidence.jsonl"
LOCK_NAME = "state.lock"
SYNC_INTERVAL_S = 1.0


@dataclass(frozen=True)
class Entry:
    """Where a row's latest record sits in the state file, and what it decided."""

    offset: int
    line: int
    sha256: str
    status: str


class StateFile:
    def __init__(self, directory: Path):
        self.directory = directory
        self.path = directory / STATE_NAME
        self.index: dict[str, Entry] = {}
        self._lines = 0
        self._fd: int | None = None
        self._lock_fd: int | None = None
        self._reader: Any = None
        self._synced_at = 0.0

    def __enter__(self) -> "StateFile":
        self.open()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def open(self) -> None:
        self.directory.mkdir(parents=True, exist_ok=True)
        self._lock_fd = os.open(self.directory / LOCK_NAME, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(self._lock_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(self._lock_fd)
            self._lock_fd = None
            raise UserError(f"{self.directory} is in use by another `synth run`") from None
        try:
            self._cut_partial_line()
            self._load_index()
            self._fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        except BaseException:  # a damaged file: the lock is released with the refusal
            self.close()
            raise

    def close(self) -> None:
        if self._reader is not None:
            self._reader.close()
            self._reader = None
        if self._fd is not None:
            os.fsync(self._fd)
            os.close(self._fd)
            self._fd = None
        if self._lock_fd is not None:
            os.close(self._lock_fd)  # releases the flock
            self._lock_fd = None

    def _cut_partial_line(self) -> None:
        if not self.path.exists() or self.path.stat().st_size == 0:
            return
        with self.path.open("rb+") as f:
            f.seek(-1, os.SEEK_END)
            if f.read(1) == b"\n":
                return
            data_end = f.seek(0, os.SEEK_END)
            pos = data_end
            while pos > 0:  # find the last newline, reading backwards in blocks
                step = min(1 << 16, pos)
                f.seek(pos - step)
                block = f.read(step)
                nl = block.rfind(b"\n")
                if nl >= 0:
                    pos = pos - step + nl + 1
                    break
                pos -= step
            log.warning("%s: cutting off a partial last record (%d bytes) left by an interrupted run",
                        self.path, data_end - pos)
            f.truncate(pos)

    def _load_index(self) -> None:
        if not self.path.exists():
            return
        with self.path.open("rb") as f:
            offset = 0
            for number, line in enumerate(f, start=1):
                try:
                    row = EvidenceRow.from_line(line, self.path, number)
                except UserError as exc:
                    raise UserError(f"{exc}; the file is damaged: move it away to start over") from None
                # a later record of the same row supersedes
                self.index[row.row_id] = Entry(offset, number, row.input_sha256, row.status)
                offset += len(line)
                self._lines = number

    def append(self, row: EvidenceRow) -> None:
        assert self._fd is not None, "state file not open"
        data = row.line()
        offset = os.lseek(self._fd, 0, os.SEEK_END)
        written = os.write(self._fd, data)
        if written != len(data):  # a short write leaves a partial line, cut off on the next open
            raise OSError(f"short write to {self.path}: {written} of {len(data)} bytes")
        now = time.monotonic()
        if now - self._synced_at >= SYNC_INTERVAL_S:
            os.fsync(self._fd)
            self._synced_at = now
        self._lines += 1
        self.index[row.row_id] = Entry(offset, self._lines, row.input_sha256, row.status)

    def read(self, entry: Entry) -> EvidenceRow:
        if self._reader is None:
            self._reader = self.path.open("rb")
        self._reader.seek(entry.offset)
        return EvidenceRow.from_line(self._reader.readline(), self.path, entry.line)

    def check_pipeline(self, fingerprint: Fingerprint, name: str, allow_change: bool) -> None:
        """Refuse to mix rows produced by different prompts/models unless told to (a stamp written
        by an earlier version's encoding of the same pipeline matches)."""
        known = PipelineStamp.read(self.directory)
        if known is not None and not fingerprint.matches(known.fingerprint):
            if not allow_change:
                raise UserError(
                    f"{self.directory}: the pipeline changed since these rows were produced "
                    f"(prompts, models, checks, verdict or output shape; was {known.name!r} "
                    f"{known.fingerprint[:12]}, now {fingerprint[:12]}). Use another "
                    "output directory, or --allow-pipeline-change to keep the finished rows")
            log.warning("pipeline changed; finished rows are kept, new rows use the new pipeline")
        PipelineStamp(name, str(fingerprint)).write(self.directory)
