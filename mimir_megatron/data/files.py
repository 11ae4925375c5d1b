"""Open files of the training data: a bounded pool, the process's open-file limit, random reads.

A mixture at the paper's scale has thousands of shard files (5,648 shards, two files each, at
v1.5). Opening all of them at once runs into ``ulimit -n``; the loader instead reads through one
process-wide pool of at most :func:`pool_capacity` open files, closing the least recently used
one when it needs another. Reads are explicit (``os.pread``) on descriptors advised
``POSIX_FADV_RANDOM``: a document read from a cold file then fetches its own pages, not a whole
read-ahead window (8 MB on a typical disk), which is what a shuffled sample order needs.
"""

from __future__ import annotations

import errno
import logging
import os
import resource
import threading
from collections import OrderedDict

from mimir_megatron.errors import UserError

log = logging.getLogger(__name__)

MIN_OPEN_FILES = 64
"""Below this limit (after raising the soft limit to the hard one) training refuses to start:
torch, the process group, checkpoints and the data pool all need descriptors."""

_MAX_POOL = 1024


def raise_open_file_limit() -> int:
    """Raise the soft ``RLIMIT_NOFILE`` to the hard limit; return the soft limit now in force.
    A :class:`UserError` (one line naming both limits and the fix) when even that is below
    :data:`MIN_OPEN_FILES`."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and soft != resource.RLIM_INFINITY and soft < hard:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
            log.debug("open-file limit raised from %d to %d", soft, hard)
            soft = hard
        except (ValueError, OSError) as exc:  # a container may refuse; then the soft limit it is
            log.warning("could not raise the open-file limit from %d to %d (%s)", soft, hard, exc)
    if soft != resource.RLIM_INFINITY and soft < MIN_OPEN_FILES:
        raise UserError(too_many_files_line(f"the open-file limit is {soft} (hard limit {hard}); "
                                            f"mimir needs at least {MIN_OPEN_FILES}"))
    return soft


def too_many_files_line(what: str) -> str:
    """The one line for a process out of file descriptors: what happened, then the fix."""
    return (f"{what}: raise the open-file limit (`ulimit -n 65536` before the launch, "
            "`LimitNOFILE=` in a systemd unit, `nofile` in /etc/security/limits.conf; Slurm passes "
            "the submitting shell's limit on with --propagate=NOFILE)")


def pool_capacity(soft_limit: int) -> int:
    """Open files the data pool may hold: a quarter of the limit (the rest stays for torch, the
    process group, checkpoint writers and verification threads), at most 1,024."""
    if soft_limit == resource.RLIM_INFINITY:
        return _MAX_POOL
    return max(8, min(_MAX_POOL, soft_limit // 4))


class FilePool:
    """Read-only descriptors of many files, at most ``capacity`` open at once (LRU). Thread-safe:
    a read holds the pool's lock, so no descriptor is closed while another thread reads it."""

    def __init__(self, capacity: int) -> None:
        if capacity < 1:
            raise ValueError(f"capacity must be >= 1, got {capacity}")
        self.capacity = capacity
        self._open: OrderedDict[str, int] = OrderedDict()
        self._lock = threading.Lock()
        self.opened = 0  # files opened in all (reopens included): what the benchmark reports

    def __len__(self) -> int:
        return len(self._open)

    def pread(self, path: str, size: int, offset: int) -> bytes:
        """``size`` bytes of ``path`` from ``offset`` (fewer at the end of the file)."""
        with self._lock:
            fd = self._fd(path)
            return os.pread(fd, size, offset)

    def _fd(self, path: str) -> int:
        fd = self._open.get(path)
        if fd is not None:
            self._open.move_to_end(path)
            return fd
        while len(self._open) >= self.capacity:
            _, old = self._open.popitem(last=False)
            os.close(old)
        try:
            fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        except OSError as exc:
            if exc.errno in (errno.EMFILE, errno.ENFILE):
                raise UserError(too_many_files_line(
                    f"{path}: cannot open ({exc.strerror}; {len(self._open)} data files open)")) from None
            raise
        if hasattr(os, "posix_fadvise"):
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_RANDOM)
        self._open[path] = fd
        self.opened += 1
        return fd

    def close(self) -> None:
        with self._lock:
            while self._open:
                os.close(self._open.popitem()[1])


_pool: FilePool | None = None
_pool_lock = threading.Lock()


def data_files() -> FilePool:
    """The process's pool (made on first use, after raising the open-file limit)."""
    global _pool
    with _pool_lock:
        if _pool is None:
            _pool = FilePool(pool_capacity(raise_open_file_limit()))
        return _pool
