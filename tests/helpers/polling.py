"""Wait for a condition by polling it (tests never sleep a fixed time and hope)."""

from __future__ import annotations

import time
from typing import Callable


def wait_for(predicate: Callable[[], object], what: str, timeout: float = 120.0, interval: float = 0.02) -> None:
    """Return once ``predicate()`` is true; fail naming ``what`` after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}")
        time.sleep(interval)
