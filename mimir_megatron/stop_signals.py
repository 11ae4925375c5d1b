"""Pre-emption signals (SIGTERM, SIGUSR1), caught from the first line of `mimir train` on.

Importing torch and megatron takes seconds (tens on a busy node). A Slurm pre-emption signal
that arrived then would kill the process with the default action, before the training loop has
installed its handler. :func:`catch_early` records such a signal instead; the loop's handler
takes over and honours it (the step ends, a checkpoint is saved, exit 0). Standard library only,
so that installing the handlers costs nothing.

Slurm delivers a forwarded signal to *every* process of the job step, so the helper processes a
rank starts (checkpointing's, see :mod:`mimir_megatron.checkpoint.signal_safe`) must not die
of these signals: :func:`shield_children` starts them with the signals blocked, and
:func:`helper_process_init` makes a spawned helper ignore them for good. Both live here, in a
standard-library module, because a spawned helper imports its initializer's module first.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
from typing import Any, Iterator

STOP_SIGNALS = (signal.SIGTERM, signal.SIGUSR1)
HELPER_SHIELDED = (*STOP_SIGNALS, signal.SIGINT)
"""What no helper process may die of: the job's stop signals, and Ctrl-C in a terminal (the rank
handles it; its helpers are ended by the rank)."""
_PR_SET_PDEATHSIG = 1

_early: list[int] = []


def _record(signum: int, frame: Any) -> None:
    _early.append(signum)


def catch_early() -> dict[int, Any]:
    """Record stop signals from now on; returns the handlers replaced (to restore them)."""
    return {sig: signal.signal(sig, _record) for sig in STOP_SIGNALS}


def restore(previous: dict[int, Any]) -> None:
    for sig, handler in previous.items():
        signal.signal(sig, handler)


def take_early() -> list[int]:
    """The signals :func:`catch_early` recorded since the last call (and forget them)."""
    taken = list(_early)
    _early.clear()
    return taken


@contextlib.contextmanager
def shield_children() -> Iterator[None]:
    """Processes started inside the block inherit :data:`HELPER_SHIELDED` blocked.

    The signal mask is inherited across fork and exec, so a child never receives them, from its
    first instruction on (a handler set in the child would leave a window at start-up). This
    thread's own signals stay pending meanwhile and arrive when the mask is restored, and other
    threads take process-directed ones: none is lost.
    """
    previous = signal.pthread_sigmask(signal.SIG_BLOCK, HELPER_SHIELDED)
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, previous)


def helper_process_init(parent_pid: int) -> None:
    """First thing in a spawned helper (a multiprocessing initializer): ignore the stop signals
    for good, and end with the rank that started it.

    Ignoring them, the helper would otherwise outlive a rank killed with SIGKILL (a node's OOM
    killer, Slurm after ``KillWait``); Linux's parent-death signal ends it then.
    """
    for sig in HELPER_SHIELDED:
        signal.signal(sig, signal.SIG_IGN)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, HELPER_SHIELDED)  # ignored now: nothing pending
    if sys.platform.startswith("linux"):
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
        if os.getppid() != parent_pid:  # the rank died before prctl: nobody would end us
            os._exit(0)
