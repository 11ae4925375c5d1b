"""One trainer per run directory: an advisory lock on ``<run.dir>/train.lock``.

Rank 0 takes an exclusive ``flock`` on the file and writes its holder into it (host, PID, start
time). A second trainer on the same directory finds the lock taken and exits with one line naming
the holder. The lock belongs to the open file, not to the file's content: the kernel drops it when
the holder's last descriptor closes, whatever ends the process (an exception, SIGKILL, OOM), so a
lock is never "stale" by guesswork: a held lock means a live holder. A forked checkpoint writer
(``checkpoint.async_save``) shares the descriptor, so the lock lasts until it has finished too.

Shared file systems: on NFS, Linux turns ``flock`` into a POSIX lock held by the NFS server, which
drops the locks of a client that stops renewing its lease (NFSv4: 90 s by default) when its node
dies; on Lustre the client must be mounted with ``-o flock``. Where the file system refuses locks
altogether, training goes on with a warning: a second trainer would then not be detected.
"""

from __future__ import annotations

import errno
import fcntl
import json
import logging
import os
import socket
import time
from pathlib import Path

from mimir_megatron.checkpoint.run_directory import RunDirectory
from mimir_megatron.errors import UserError, write_error

log = logging.getLogger(__name__)

_UNSUPPORTED = {errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL}


class RunDirectoryBusy(UserError):
    """Another trainer holds the run directory."""


class RunLock:
    """The lock of one run directory; :meth:`acquire` once, :meth:`release` on any exit."""

    def __init__(self, run_dir: Path, private: bool = False) -> None:
        self.path = RunDirectory(Path(run_dir)).lock_file
        self.private = private
        """Make the run directory 0700 when the lock is taken (``run.private``)."""
        self._fd: int | None = None

    def acquire(self) -> None:
        """Take the lock (creating the run directory), or raise :class:`RunDirectoryBusy` naming
        the holder; a run directory that cannot be written is a one-line :class:`UserError`."""
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            if self.private:  # before anything is written in it: no window in which others may look
                self.path.parent.chmod(0o700)
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        except OSError as exc:
            raise write_error(exc, f"run directory {self.path.parent}", "set run.dir to a writable "
                              "directory") from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as exc:
            if exc.errno in (errno.EWOULDBLOCK, errno.EACCES):
                holder = _read_holder(fd)
                os.close(fd)
                raise RunDirectoryBusy(
                    f"run directory {self.path.parent} is in use by another trainer ({holder}); "
                    "wait for it to end or stop it, or train into another run.dir") from None
            os.close(fd)
            if exc.errno in _UNSUPPORTED:
                log.warning("cannot lock %s (%s): the file system does not support locks, so a second "
                            "trainer on this run directory would not be detected", self.path, exc.strerror)
                return
            raise UserError(f"cannot lock {self.path} ({exc.strerror or exc})") from None
        holder = {"host": socket.gethostname(), "pid": os.getpid(),
                  "since": time.strftime("%Y-%m-%dT%H:%M:%S%z")}
        os.ftruncate(fd, 0)
        os.pwrite(fd, (json.dumps(holder) + "\n").encode(), 0)
        self._fd = fd

    def release(self) -> None:
        if self._fd is not None:
            os.close(self._fd)  # drops the lock; the file stays (unlinking it would race a newcomer)
            self._fd = None


def _read_holder(fd: int) -> str:
    try:
        holder = json.loads(os.pread(fd, 4096, 0).decode() or "{}")
        return f"host {holder['host']}, pid {holder['pid']}, since {holder['since']}"
    except (OSError, ValueError, KeyError, TypeError):
        return "holder not recorded yet"
