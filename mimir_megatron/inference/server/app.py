"""The FastAPI app (routes only) and the ways to run it.

The event loop only moves bytes: a request's body is read up to the size limit, and everything
that costs CPU in proportion to the request (JSON parsing and validation, chat-template
rendering, tokenisation) runs in worker threads, so no request can hold up the others or
``/health``. Every error, FastAPI's and Starlette's own included, is OpenAI's error object.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
import time
import uuid
from contextlib import asynccontextmanager, contextmanager
from typing import Iterator, Literal, TypeVar

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import BaseModel, ValidationError
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException as StarletteHTTPException

from mimir_megatron import backend
from mimir_megatron.inference.api_keys import ApiKeys
from mimir_megatron.inference.engine import InferenceEngine
from mimir_megatron.inference.server.auth import RequireApiKey
from mimir_megatron.inference.server.dispatch import Server
from mimir_megatron.inference.server.protocol import (
    ApiError,
    ChatBody,
    CompletionBody,
    ResponsesBody,
    ScoreBody,
    bad_request,
    parse_json,
    too_large,
)
from mimir_megatron.inference.server.completions_api import stream
from mimir_megatron.inference.server.responses_api import (
    ResponseBuilder,
    conversation,
    list_input_items,
    sse_events,
)
from mimir_megatron.process import freeze_startup_objects

log = logging.getLogger(__name__)
B = TypeVar("B", bound=BaseModel)


def _head(prefix: str, kind: str, engine: InferenceEngine) -> dict:
    return {"id": f"{prefix}-{uuid.uuid4().hex}", "object": kind, "created": int(time.time()),
            "model": engine.model_name}


async def _read_body(request: Request, limit: int) -> bytes:
    """The body, or a 413 as soon as it (or its announced length) passes ``limit`` bytes."""
    announced = request.headers.get("content-length")
    if announced is not None and announced.isdigit() and int(announced) > limit:
        raise too_large(limit)
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise too_large(limit)
        chunks.append(chunk)
    return b"".join(chunks)


def _validated(raw: bytes, model: type[B]) -> B:
    """Strict JSON into the body model (in a worker thread: parsing costs in proportion)."""
    try:
        return model.model_validate(parse_json(raw))
    except ValidationError as exc:
        raise RequestValidationError(exc.errors(include_url=False)) from None


def build_app(engine: InferenceEngine, *, api_keys: ApiKeys | None = None, **limits) -> FastAPI:
    """The FastAPI app; its lifespan starts and stops the scheduler thread. ``api_keys``: every
    request but ``/health`` needs one of them (:mod:`.auth`; None: no key is asked). ``limits``:
    ``max_tokens_limit``, ``max_queue``, ``max_batch_size``, ``max_stored_responses``,
    ``max_body_bytes``, ``max_cycles_factor``."""
    server = Server(engine, **limits)

    async def body_of(request: Request, model: type[B]) -> B:
        raw = await _read_body(request, server.limits.max_body_bytes)
        return await run_in_threadpool(_validated, raw, model)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        server.scheduler.start()
        log.info("serving %s (context %d, max_tokens <= %d, queue %d, batch %d, body <= %d bytes, "
                 "schedule <= %dx%d)", engine.model_name, engine.max_context, server.limits.max_tokens_limit,
                 server.limits.max_queue, engine.max_batch_size, server.limits.max_body_bytes,
                 *engine.limits.cycle_limits)
        try:
            yield
        finally:
            server.scheduler.stop()

    app = FastAPI(title="mimir serve", lifespan=lifespan)
    app.state.server = server
    if api_keys is not None:
        app.add_middleware(RequireApiKey, keys=api_keys)

    @app.exception_handler(ApiError)
    async def api_error(request: Request, exc: ApiError):
        return JSONResponse(exc.body(), status_code=exc.status)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException):
        # 404, 405, ... in OpenAI's error object (FastAPI's own is {"detail": ...}).
        if exc.status_code == 404:
            message, code = f"{request.method} {request.url.path} is not served here", "not_found"
        elif exc.status_code == 405:
            message, code = f"{request.method} is not allowed on {request.url.path}", "method_not_allowed"
        else:
            message, code = str(exc.detail), None
        error = ApiError(exc.status_code, message, None, code=code)
        return JSONResponse(error.body(), status_code=exc.status_code, headers=getattr(exc, "headers", None))

    @app.exception_handler(Exception)
    async def internal_error(request: Request, exc: Exception):
        log.exception("internal error on %s %s", request.method, request.url.path)
        error = ApiError(500, f"internal error: {type(exc).__name__}", None, type="server_error")
        return JSONResponse(error.body(), status_code=500)

    @app.exception_handler(RequestValidationError)
    async def validation_error(request: Request, exc: RequestValidationError):
        parts, param = [], None
        for err in exc.errors()[:3]:
            loc = [str(x) for x in err.get("loc", ()) if x not in ("body", "query", "path")]
            if param is None and loc:
                param = loc[0]
            parts.append(f"{'.'.join(loc) or 'body'}: {err.get('msg')}")
        return JSONResponse(bad_request("; ".join(parts), param).body(), status_code=400)

    @app.get("/health")
    async def health():
        return {"status": "ok"}

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{
            "id": engine.model_name, "object": "model", "created": server.created, "owned_by": "mimir",
            "max_model_len": engine.max_context, "trained_schedule": list(engine.limits.trained_schedule)}]}

    @app.get("/v1/models/{model}")
    async def model(model: str):
        if model != engine.model_name:
            raise ApiError(404, f"model {model!r} is not served here", "model", code="model_not_found")
        return (await models())["data"][0]

    @app.get("/v1/stats")
    async def stats():
        return {"scheduler": server.scheduler.stats.as_dict(), "queue_depth": server.scheduler.queue_depth,
                "engine": dict(engine.stats.__dict__)}

    @app.post("/v1/completions")
    async def completions(request: Request):
        body = await body_of(request, CompletionBody)
        generation = await run_in_threadpool(server.translate.completion, body)
        queue, works = server.generation_works(generation.requests)
        head = _head("cmpl", "text_completion", engine)
        if body.stream:
            return stream(server.events(queue, works),
                          server.respond.completion_chunks(head, body, generation))
        results = await server.results(queue, works, request.receive)
        return server.respond.completion(head, body, results, generation)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        body = await body_of(request, ChatBody)
        generation = await run_in_threadpool(server.translate.chat, body)
        queue, works = server.generation_works(generation.requests)
        head = _head("chatcmpl", "chat.completion", engine)
        if body.stream:
            return stream(server.events(queue, works),
                          server.respond.chat_chunks(head, body, generation))
        results = await server.results(queue, works, request.receive)
        return server.respond.chat(head, body, results, generation)

    @app.post("/v1/responses")
    async def responses(request: Request):
        body = await body_of(request, ResponsesBody)
        messages, remembered = conversation(body, server.stored_responses)
        generation = await run_in_threadpool(server.translate.responses, body, messages)
        logprobs = None
        if body.wants_logprobs:
            def logprobs(ids, values, tops):
                return server.respond.chat_logprobs(ids, values, tops)["content"]
        builder = ResponseBuilder(body, engine.model_name, generation.prompt_tokens,
                                  generation.parse_tool_calls,
                                  server.stored_responses, remembered, logprobs, generation.stream_calls)
        queue, works = server.generation_works(generation.requests)
        if body.stream:
            return StreamingResponse(sse_events(builder.events(server.events(queue, works))),
                                     media_type="text/event-stream")
        (result,) = await server.results(queue, works, request.receive)
        return builder.whole(result)

    @app.get("/v1/responses/{response_id}")
    async def stored_response(response_id: str, request: Request):
        _refuse_stored_stream(request)
        return server.stored_responses.stored(response_id).response

    @app.get("/v1/responses/{response_id}/input_items")
    async def stored_input_items(response_id: str, request: Request, limit: int = 20,
                                 order: Literal["asc", "desc"] = "desc", after: str | None = None):
        _refuse_include(request)
        return list_input_items(server.stored_responses.stored(response_id), limit, order, after)

    @app.delete("/v1/responses/{response_id}")
    async def delete_response(response_id: str):
        server.stored_responses.delete(response_id)
        return {"id": response_id, "object": "response.deleted", "deleted": True}

    @app.post("/v1/score")
    async def score(request: Request):
        body = await body_of(request, ScoreBody)
        scoring = await run_in_threadpool(server.translate.score, body)
        return server.respond.score(await server.scored(scoring, request.receive), scoring.pairs)

    return app


def _refuse_include(request: Request) -> None:
    """``include`` asks for fields this server never produces (log-probs, reasoning, ...)."""
    if request.query_params.getlist("include") or request.query_params.getlist("include[]"):
        raise bad_request("include is not supported: this server stores no extra fields", "include")


def _refuse_stored_stream(request: Request) -> None:
    """A stored response is answered whole; its events are not kept to replay."""
    _refuse_include(request)
    if request.query_params.get("stream", "false").lower() not in ("false", "0"):
        raise bad_request("stream is not supported when retrieving a response (its events are not kept)",
                          "stream")
    if "starting_after" in request.query_params:
        raise bad_request("starting_after applies to streamed retrieval, which is not supported",
                          "starting_after")


def app_server(app: FastAPI) -> Server:
    """The :class:`Server` behind an app from :func:`build_app` (its scheduler, limits)."""
    return app.state.server


def serve(engine: InferenceEngine, host: str = "127.0.0.1", port: int = 8000, *,
          api_keys: ApiKeys | None = None, **limits) -> None:
    """Serve until interrupted (``mimir serve``): SIGTERM or Ctrl-C finishes the requests and
    streams in flight, then exits (SIGTERM: exit 0); a second Ctrl-C exits at once."""
    import uvicorn

    class Server(uvicorn.Server):
        def handle_exit(self, sig: int, frame) -> None:
            if sig == signal.SIGINT and self.should_exit:
                # uvicorn's own second Ctrl-C only stops waiting for connections: a decoding
                # step, a tokenisation or the scheduler's shutdown could still hold the process.
                log.warning("second Ctrl-C: exiting now (requests in flight are dropped)")
                logging.shutdown()
                os._exit(130)
            if sig == signal.SIGINT:
                log.warning("Ctrl-C: finishing the requests in flight, then exiting (Ctrl-C again: "
                            "exit now)")
            super().handle_exit(sig, frame)

    def drained(sig: int, frame) -> None:
        log.info("SIGTERM: the requests in flight are finished; exiting")

    config = uvicorn.Config(build_app(engine, api_keys=api_keys, **limits), host=host, port=port,
                            log_level="info")
    freeze_startup_objects()
    # uvicorn sends the SIGTERM it handled again once its shutdown is complete, to the handler in
    # place before it started: Python's default would end the process by the signal (exit 143,
    # logs unflushed) after a clean drain. This one lets `mimir serve` return and exit 0.
    previous = signal.signal(signal.SIGTERM, drained)
    try:
        Server(config).run()
    finally:
        signal.signal(signal.SIGTERM, previous)


@contextmanager
def serve_in_thread(engine: InferenceEngine, host: str = "127.0.0.1", port: int = 0, *,
                    api_keys: ApiKeys | None = None, **limits) -> Iterator[str]:
    """Serve from a background thread; yields the base URL ``http://HOST:PORT/v1`` (``port=0``: a
    free port) once the server accepts connections, and shuts it down cleanly on exit.
    ``api_keys`` and ``limits`` as for :func:`build_app`."""
    with serve_app_in_thread(build_app(engine, api_keys=api_keys, **limits), host, port) as url:
        yield url


@contextmanager
def serve_app_in_thread(app: FastAPI, host: str = "127.0.0.1", port: int = 0) -> Iterator[str]:
    """:func:`serve_in_thread` for an app from :func:`build_app` (whose scheduler the caller may
    want to inspect: ``app_server(app).scheduler``). The caller's thread, whose requests the
    server's scheduler thread then computes, first gives up its OpenMP workers
    (:func:`~mimir_megatron.backend.release_cpu_thread_pool`: a trainer's thread beside the
    scheduler made its decoding 1.45x slower); its next parallel work makes a new pool."""
    import uvicorn

    backend.release_cpu_thread_pool()

    config = uvicorn.Config(app, host=host, port=port, log_level="warning", lifespan="on")
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, name="mimir-serve", daemon=True)
    thread.start()
    deadline = time.monotonic() + 60
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            server.should_exit = True
            thread.join(10)
            raise RuntimeError(f"the server did not start on {host}:{port}")
        time.sleep(0.02)
    bound = server.servers[0].sockets[0].getsockname()[1]
    try:
        yield f"http://{host}:{bound}/v1"
    finally:
        server.should_exit = True
        thread.join(30)
