"""The one thread that drives the inference engine for the server.

The engine is not thread-safe, so HTTP handlers never call it: they put work into a bounded queue
and this thread runs it. Generation requests decode in a :class:`DecodeSession` per (H, L)
schedule; requests of the running session's schedule that wait when a step starts join that step
(step-level batching). Policy for other schedules: first come, first served. A session admits
waiting requests of its schedule only up to the oldest waiting request of another schedule; then
it drains, and the next session opens for that request's schedule. Scoring work runs between two
decoding steps.

Results travel back through a :class:`Sink` (the server's feeds an asyncio queue with
``loop.call_soon_threadsafe``). An exception in one piece of work fails that work only; the thread
keeps serving.
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Protocol

from mimir_megatron.inference.engine import InferenceEngine
from mimir_megatron.inference.requests import RequestError
from mimir_megatron.inference.types import GenerationRequest, ScoreResult, TokenEvent

log = logging.getLogger(__name__)


class QueueFull(Exception):
    """The queue of waiting work is full: try again later (HTTP 503)."""


class Sink(Protocol):
    """Where the scheduler thread delivers one piece of work's outcome (must not block)."""

    def event(self, event: TokenEvent) -> None: ...
    def scored(self, results: list[ScoreResult]) -> None: ...
    def fail(self, error: BaseException) -> None: ...


@dataclass
class GenerationWork:
    request: GenerationRequest
    sink: Sink
    schedule: tuple[int, int]
    cancelled: bool = False
    """Set by the server when the client has gone (a stream closed, a connection dropped while
    waiting for a whole reply): the request leaves the queue or its batch at the next step."""


@dataclass
class ScoreWork:
    pairs: list[tuple[list[int], list[int]]]
    sink: Sink
    schedule: tuple[int, int]
    cancelled: bool = False
    bidirectional_tokens: list[int | None] | None = None
    """Per pair: leading context tokens that attend bidirectionally; None: all of the context."""


@dataclass
class SchedulerStats:
    """Counters that show how work was batched (``GET /v1/stats``)."""

    sessions: int = 0
    steps: int = 0
    rows_stepped: int = 0
    """Sum over steps of the rows that produced a token in that step."""
    max_rows_per_step: int = 0
    requests_finished: int = 0
    requests_failed: int = 0
    requests_cancelled: int = 0
    """Dropped, waiting or from their batch, because the client went away."""
    score_requests: int = 0
    rejected_queue_full: int = 0
    started: float = field(default_factory=time.time)

    def as_dict(self) -> dict:
        out = dict(self.__dict__)
        out["mean_rows_per_step"] = self.rows_stepped / self.steps if self.steps else 0.0
        return out


class Scheduler:
    """Owns the engine; call :meth:`start`, then :meth:`submit` from any thread, :meth:`stop` at the end."""

    def __init__(self, engine: InferenceEngine, max_queue: int = 256) -> None:
        self.engine = engine
        self.max_queue = max_queue
        self.stats = SchedulerStats()
        self._waiting: collections.deque[GenerationWork | ScoreWork] = collections.deque()
        self._cond = threading.Condition()
        self._stop = False
        self._paused = False
        self._thread: threading.Thread | None = None
        self._session = None
        self._session_work: dict[int, GenerationWork] = {}

    # -- called from other threads ----------------------------------------------------------------

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="mimir-scheduler", daemon=True)
        self._thread.start()

    def stop(self, timeout: float = 30.0) -> None:
        """Stop after the current step; work still waiting or decoding is failed."""
        with self._cond:
            self._stop = True
            self._cond.notify_all()
        if self._thread is not None:
            self._thread.join(timeout)

    def submit(self, works: list[GenerationWork | ScoreWork]) -> None:
        """Queue all of ``works`` or none of them (:class:`QueueFull`)."""
        with self._cond:
            if self._stop:
                raise QueueFull("the server is shutting down")
            if len(self._waiting) + len(works) > self.max_queue:
                self.stats.rejected_queue_full += 1
                raise QueueFull(f"{len(self._waiting)} requests are waiting "
                                f"(the queue holds {self.max_queue})")
            self._waiting.extend(works)
            self._cond.notify_all()

    @property
    def queue_depth(self) -> int:
        return len(self._waiting)

    @property
    def busy(self) -> bool:
        """Whether work is waiting or a batch is decoding."""
        return bool(self._waiting) or self._session is not None

    @contextmanager
    def paused(self):
        """Admit no work and take no step while inside (the step in progress finishes)."""
        with self._cond:
            self._paused = True
        try:
            yield self
        finally:
            with self._cond:
                self._paused = False
                self._cond.notify_all()

    # -- the scheduler thread ----------------------------------------------------------------------

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._stop and (self._paused or (not self._waiting and self._session is None)):
                    self._cond.wait()
                if self._stop:
                    break
                scoring, admitted = self._take()
            try:
                for work in scoring:
                    self._score(work)
                for work in admitted:
                    self._admit(work)
                if self._session is not None:
                    self._step()
            except Exception as exc:  # noqa: BLE001 - a bug here must not stop the server
                log.exception("scheduler error; failing the running batch")
                self._fail_session(exc)
        self._shutdown()

    def _take(self) -> tuple[list[ScoreWork], list[GenerationWork]]:
        """Under the lock: the scoring work waiting, and the generation work that joins the
        running session (or opens the next one)."""
        gone = [w for w in self._waiting if w.cancelled]  # their clients left while they waited
        if gone:
            self.stats.requests_cancelled += len(gone)
            self._waiting = collections.deque(w for w in self._waiting if not w.cancelled)
        scoring = [w for w in self._waiting if isinstance(w, ScoreWork)]
        generation = [w for w in self._waiting if isinstance(w, GenerationWork)]
        if self._session is None and generation:
            self._open(generation[0].schedule)
        admitted: list[GenerationWork] = []
        if self._session is not None:
            room = self._session.capacity_left
            for work in generation:
                if work.schedule != self._session.schedule or len(admitted) >= room:
                    break  # first come, first served: nothing overtakes an older request
                admitted.append(work)
        taken = {id(w) for w in scoring} | {id(w) for w in admitted}
        self._waiting = collections.deque(w for w in self._waiting if id(w) not in taken)
        return scoring, admitted

    def _open(self, schedule: tuple[int, int]) -> None:
        self._session = self.engine.open_session(*schedule)
        self._session_work = {}
        self.stats.sessions += 1

    def _admit(self, work: GenerationWork) -> None:
        if work.cancelled:
            self.stats.requests_cancelled += 1
            return
        try:
            handle = self._session.add(work.request)
        except Exception as exc:  # noqa: BLE001 - one bad request must not stop the server
            self._fail(work, exc)
            return
        self._session_work[handle] = work

    def _step(self) -> None:
        session = self._session
        for handle in [h for h, w in self._session_work.items() if w.cancelled]:
            session.cancel(handle)  # the client has gone: free its row
            del self._session_work[handle]
            self.stats.requests_cancelled += 1
        if not session.active:
            self._session = None
            return
        try:
            events = session.step()
        except Exception as exc:  # noqa: BLE001 - fail this session's requests, keep serving
            log.exception("decoding step failed; failing the %d requests of this batch",
                          len(self._session_work))
            self._fail_session(exc)
            return
        self.stats.steps += 1
        self.stats.rows_stepped += len(events)
        self.stats.max_rows_per_step = max(self.stats.max_rows_per_step, len(events))
        for event in events:
            if event.finished:
                work = self._session_work.pop(event.handle, None)
                self.stats.requests_finished += 1
            else:
                work = self._session_work.get(event.handle)
            if work is not None and not work.cancelled:
                self._deliver(work.sink.event, event)
        if not session.active:
            self._session = None

    def _fail_session(self, exc: BaseException) -> None:
        for work in self._session_work.values():
            self._fail(work, exc)
        self._session, self._session_work = None, {}

    def _score(self, work: ScoreWork) -> None:
        if work.cancelled:
            return
        try:
            extra = {}
            partial = work.bidirectional_tokens
            if partial is not None and any(b is not None for b in partial):
                extra["bidirectional_tokens"] = partial  # only then: an engine without it still scores
            results = self.engine.score(work.pairs, *work.schedule, **extra)
        except Exception as exc:  # noqa: BLE001
            self._fail(work, exc)
            return
        self.stats.score_requests += 1
        self._deliver(work.sink.scored, results)

    def _fail(self, work: GenerationWork | ScoreWork, exc: BaseException) -> None:
        self.stats.requests_failed += 1
        if not isinstance(exc, RequestError):
            log.error("request failed: %r", exc)
        self._deliver(work.sink.fail, exc)

    @staticmethod
    def _deliver(method, value) -> None:
        try:
            method(value)
        except Exception:  # noqa: BLE001 - a broken sink (closed loop) is that client's problem
            log.exception("could not deliver a result")

    def _shutdown(self) -> None:
        stopped = RuntimeError("the server stopped")
        with self._cond:
            waiting, self._waiting = list(self._waiting), collections.deque()
        for work in [*waiting, *self._session_work.values()]:
            self._deliver(work.sink.fail, stopped)
        self._session, self._session_work = None, {}
