"""Faults injected into writes (tests of checkpoint and data reliability).

:func:`patch_data_writes`: megatron's writer calls torch's ``_write_item`` once per tensor with
the open data file; the wrapper runs ``action(stream)`` first when the file lies in a directory
named ``directory`` (any checkpoint's when None; an action may raise, as a full disk does, or
block). A forked asynchronous writer inherits it. :func:`small_tmpfs`: a real file system that
fills up, or turns read-only.
"""

from __future__ import annotations

import contextlib
import functools
import io
import os
import shutil
import subprocess
from pathlib import Path
from typing import Callable, Iterator


def patch_data_writes(directory: str | None, action: Callable[[io.IOBase], None], monkeypatch=None) -> None:
    from megatron.core.dist_checkpointing.strategies import filesystem_async

    original = filesystem_async._write_item

    @functools.wraps(original)  # megatron inspects its signature
    def write_item(*args, **kwargs):
        stream = next(a for a in args if isinstance(a, io.IOBase))
        if directory is None or Path(stream.name).parent.name == directory:
            action(stream)
        return original(*args, **kwargs)

    if monkeypatch is not None:
        monkeypatch.setattr(filesystem_async, "_write_item", write_item)
    else:
        filesystem_async._write_item = write_item


@contextlib.contextmanager
def small_tmpfs(path: Path, size: str) -> Iterator[Path]:
    """A tmpfs of ``size`` (mount's ``size=``, e.g. ``5600k``) mounted at ``path``: a disk that fills
    up, or (``remount_read_only``) a read-only place. Needs root; skips the test otherwise."""
    import pytest

    if os.geteuid() != 0 or shutil.which("mount") is None:
        pytest.skip("mounting a tmpfs needs root (a full disk, a read-only place)")
    path.mkdir(parents=True, exist_ok=True)
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)], capture_output=True)
    if done.returncode:
        pytest.skip(f"mounting a tmpfs needs root (a full disk, a read-only place): {done.stderr.decode().strip()}")
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], check=True)


def remount_read_only(path: Path) -> None:
    subprocess.run(["mount", "-o", "remount,ro", str(path)], check=True)



def wait_for_the_run_lock(run_dir: Path) -> None:
    """Return once no process holds ``run_dir``'s trainer lock (a killed trainer's children too).

    ``proc.wait()`` reaps the killed process only: a process it started or forked (a rank under
    torchrun, megatron's asynchronous checkpoint writer, which inherits the locked file) holds the
    lock until the kernel has finished it, a moment later on a loaded machine, and a resume started
    at once is refused as "in use by another trainer"."""
    from polling import wait_for

    from mimir_megatron.train.run_lock import RunDirectoryBusy, RunLock

    def free() -> bool:
        lock = RunLock(run_dir)
        try:
            lock.acquire()
        except RunDirectoryBusy:
            return False
        lock.release()
        return True

    wait_for(free, f"the killed trainer's processes to release {run_dir}'s lock", timeout=60)


def kill_group_and_wait_for_the_lock(proc: subprocess.Popen, run_dir: Path) -> None:
    """SIGKILL a trainer's process group, reap it, and wait for its run directory's lock."""
    import signal

    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    wait_for_the_run_lock(run_dir)
