"""Pre-emption signals (SIGTERM, SIGUSR1), caught from the first line of `mimir train` on.

Importing torch and megatron takes seconds (tens on a busy node). A Slurm pre-emption signal
that arrived then would kill the process with the default action, before the training loop has
installed its handler. :func:`catch_early` records such a signal instead; the loop's handler
takes over and honours it (the step ends, a checkpoint is saved, exit 0). Standard library only,
so that installing the handlers costs nothing.
"""

from __future__ import annotations

import signal
from typing import Any

STOP_SIGNALS = (signal.SIGTERM, signal.SIGUSR1)

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
