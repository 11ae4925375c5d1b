"""Wait for a condition by polling it (tests never sleep a fixed time and hope).

Every time limit in the suite is a hang detector, not a speed test: a loaded machine (other jobs
on the two cores) may take several times as long as an idle one. ``MIMIR_TEST_TIMEOUT_SCALE``
(default 1) multiplies the limits of :func:`wait_for`, :func:`hang_limit` and the helpers that use
them, for a machine slower still.
"""

from __future__ import annotations

import os
import time
from typing import Callable


def hang_limit(seconds: float) -> float:
    """``seconds`` scaled by ``MIMIR_TEST_TIMEOUT_SCALE``: the limit past which a wait is a hang."""
    return seconds * float(os.environ.get("MIMIR_TEST_TIMEOUT_SCALE", "1"))


def wait_for(predicate: Callable[[], object], what: str, timeout: float = 120.0, interval: float = 0.02) -> None:
    """Return once ``predicate()`` is true; fail naming ``what`` after ``timeout`` seconds (scaled)."""
    timeout = hang_limit(timeout)
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}")
        time.sleep(interval)
