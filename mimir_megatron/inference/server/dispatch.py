"""Between the HTTP handlers and the scheduler thread: submitting work and collecting what comes
back through an asyncio queue per HTTP request."""

from __future__ import annotations

import asyncio
import time
from typing import AsyncIterator, Awaitable, Callable

from mimir_megatron.inference.engine import InferenceEngine
from mimir_megatron.inference.requests import RequestError
from mimir_megatron.inference.scheduler import GenerationWork, QueueFull, Scheduler, ScoreWork
from mimir_megatron.inference.server.protocol import (
    DEFAULT_CYCLES_FACTOR,
    DEFAULT_MAX_TOKENS_LIMIT,
    ApiError,
    bad_request,
    default_max_body_bytes,
)
from mimir_megatron.inference.server.completions_api import CompletionBodies
from mimir_megatron.inference.server.responses_api import DEFAULT_STORED_RESPONSES, ResponseStore
from mimir_megatron.inference.server.translation import Limits, Scoring, Translator
from mimir_megatron.inference.types import GenerationRequest, GenerationResult, ScoreResult, TokenEvent


class _QueueSink:
    """Feeds one HTTP request's asyncio queue from the scheduler thread."""

    def __init__(self, loop: asyncio.AbstractEventLoop, queue: asyncio.Queue, index: int) -> None:
        self.loop, self.queue, self.index = loop, queue, index

    def _put(self, item) -> None:
        try:
            self.loop.call_soon_threadsafe(self.queue.put_nowait, item)
        except RuntimeError:  # the loop has closed: nobody waits any more
            pass

    def event(self, event: TokenEvent) -> None:
        self._put(("event", self.index, event))

    def scored(self, results) -> None:
        self._put(("scored", self.index, results))

    def fail(self, error: BaseException) -> None:
        self._put(("error", self.index, error))


Receive = Callable[[], Awaitable[dict]]
"""An HTTP request's ASGI ``receive``: once the body is read, it answers ``http.disconnect`` when
the client goes (or the response is complete)."""


def _watch_disconnect(receive: Receive, queue: asyncio.Queue) -> asyncio.Task:
    """A task that puts ``("gone", ...)`` into the request's queue when its client disconnects."""
    async def watch() -> None:
        while (await receive())["type"] != "http.disconnect":
            await asyncio.sleep(0.05)  # a body message after the body: never from uvicorn; do not spin
        queue.put_nowait(("gone", -1, None))

    return asyncio.create_task(watch())


def _client_gone() -> ApiError:
    # 499: nginx's "client closed request"; nobody reads it, the access log shows it
    return ApiError(499, "the client closed the connection", None, code="client_closed_request")


def _as_api_error(error: BaseException) -> ApiError:
    if isinstance(error, ApiError):
        return error
    if isinstance(error, RequestError):
        return bad_request(str(error), None, code=error.code)
    return ApiError(500, f"internal error: {error}", None, type="server_error")


class Server:
    """The app's state: engine, scheduler, limits, and the pieces that translate and respond."""

    def __init__(self, engine: InferenceEngine, *, max_tokens_limit: int | None = None, max_queue: int = 256,
                 max_batch_size: int | None = None,
                 max_stored_responses: int = DEFAULT_STORED_RESPONSES, max_body_bytes: int | None = None,
                 max_cycles_factor: int = DEFAULT_CYCLES_FACTOR) -> None:
        if max_batch_size is not None:
            engine.max_batch_size = max_batch_size
        # What one request may cost: its schedule at most this factor of the trained one.
        h, low = engine.limits.trained_schedule
        engine.limits.cycle_limits = (max_cycles_factor * h, max_cycles_factor * low)
        limit = max_tokens_limit or min(DEFAULT_MAX_TOKENS_LIMIT, engine.max_context)
        self.engine = engine
        self.limits = Limits(max_tokens_limit=limit, max_queue=max_queue,
                             max_body_bytes=max_body_bytes or default_max_body_bytes(engine.max_context))
        self.translate = Translator(engine, self.limits)
        self.respond = CompletionBodies(engine)
        self.scheduler = Scheduler(engine, max_queue=max_queue)
        self.stored_responses = ResponseStore(max_stored_responses)
        """Conversations of earlier responses, for ``previous_response_id`` (in memory, bounded)."""
        self.created = int(time.time())

    def submit(self, works: list) -> None:
        try:
            self.scheduler.submit(works)
        except QueueFull as exc:
            raise ApiError(503, f"server busy: {exc}", None, type="server_overloaded",
                           code="queue_full") from exc

    def generation_works(self, requests: list[GenerationRequest]
                         ) -> tuple[asyncio.Queue, list[GenerationWork]]:
        loop, queue = asyncio.get_running_loop(), asyncio.Queue()
        schedule = self.engine.limits.schedule
        works = [GenerationWork(r, _QueueSink(loop, queue, i), schedule(r.h_cycles, r.l_cycles))
                 for i, r in enumerate(requests)]
        self.submit(works)
        return queue, works

    async def results(self, queue: asyncio.Queue, works: list[GenerationWork], receive: Receive | None = None
                      ) -> list[GenerationResult]:
        """Every choice's result. ``receive`` (the request's): a client that disconnects while it
        waits (its timeout, a retry) cancels the request, whose rows leave their batch at the
        next step, as a stream's do."""
        results: list[GenerationResult | None] = [None] * len(works)
        watcher = _watch_disconnect(receive, queue) if receive is not None else None
        try:
            while any(r is None for r in results):
                kind, index, value = await queue.get()
                if kind == "gone":
                    raise _client_gone()
                if kind == "error":
                    raise _as_api_error(value)
                if value.finished:
                    results[index] = value.result
        finally:
            if watcher is not None:
                watcher.cancel()
            for work in works:  # the client left, or one choice failed: stop delivering the others
                work.cancelled = True
        return results  # type: ignore[return-value]

    async def events(self, queue: asyncio.Queue, works: list[GenerationWork]
                     ) -> AsyncIterator[tuple[int, TokenEvent]]:
        """(choice index, event) until every choice has finished."""
        remaining = len(works)
        try:
            while remaining:
                kind, index, value = await queue.get()
                if kind == "error":
                    raise _as_api_error(value)
                remaining -= value.finished
                yield index, value
        finally:
            for work in works:
                work.cancelled = True

    async def scored(self, scoring: Scoring, receive: Receive | None = None) -> list[ScoreResult]:
        loop, queue = asyncio.get_running_loop(), asyncio.Queue()
        work = ScoreWork(scoring.pairs, _QueueSink(loop, queue, 0), scoring.schedule,
                         bidirectional_tokens=scoring.bidirectional_tokens)
        self.submit([work])
        watcher = _watch_disconnect(receive, queue) if receive is not None else None
        try:
            kind, _, value = await queue.get()
        finally:
            if watcher is not None:
                watcher.cancel()
            work.cancelled = True
        if kind == "gone":
            raise _client_gone()
        if kind == "error":
            raise _as_api_error(value)
        return value
