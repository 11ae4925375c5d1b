"""POST with retries on transport errors, for the evaluation clients of `mimir serve`.

A dropped connection, a read time-out or a full queue (503) says nothing about the request, so it
is sent again (with a growing pause); any other HTTP error is the request's fault and is raised at
once. One policy for the synchronous (lm-eval) and asynchronous (InspectAI scoring) clients.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass
from typing import Any

import httpx

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class RetryPolicy:
    attempts: int = 4
    """Tries in all, the first included."""
    backoff_s: float = 1.0
    """Pause before the second try; doubled before each further one."""

    def pause(self, attempt: int) -> float:
        return self.backoff_s * 2 ** (attempt - 1)


def _retryable(outcome: httpx.Response | Exception) -> bool:
    if isinstance(outcome, httpx.Response):
        return outcome.status_code == 503
    return isinstance(outcome, httpx.TransportError)


def _note(url: str, outcome: httpx.Response | Exception, attempt: int, policy: RetryPolicy) -> None:
    what = f"HTTP {outcome.status_code}" if isinstance(outcome, httpx.Response) else repr(outcome)
    log.warning("POST %s: %s (try %d of %d); retrying in %.1f s", url, what, attempt, policy.attempts,
                policy.pause(attempt))


def _finish(outcome: httpx.Response | Exception) -> httpx.Response:
    if isinstance(outcome, Exception):
        raise outcome
    outcome.raise_for_status()
    return outcome


def post_json(client: httpx.Client, url: str, body: dict[str, Any],
              policy: RetryPolicy = RetryPolicy()) -> httpx.Response:
    """``client.post(url, json=body)``, retried per ``policy``; raises on a final failure."""
    for attempt in range(1, policy.attempts + 1):
        try:
            outcome: httpx.Response | Exception = client.post(url, json=body)
        except httpx.TransportError as exc:
            outcome = exc
        if attempt == policy.attempts or not _retryable(outcome):
            return _finish(outcome)
        _note(url, outcome, attempt, policy)
        time.sleep(policy.pause(attempt))
    raise AssertionError("unreachable")


async def post_json_async(client: httpx.AsyncClient, url: str, body: dict[str, Any],
                          policy: RetryPolicy = RetryPolicy()) -> httpx.Response:
    """The asynchronous twin of :func:`post_json`."""
    for attempt in range(1, policy.attempts + 1):
        try:
            outcome: httpx.Response | Exception = await client.post(url, json=body)
        except httpx.TransportError as exc:
            outcome = exc
        if attempt == policy.attempts or not _retryable(outcome):
            return _finish(outcome)
        _note(url, outcome, attempt, policy)
        await asyncio.sleep(policy.pause(attempt))
    raise AssertionError("unreachable")
