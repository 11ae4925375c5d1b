"""``mimir serve``: an OpenAI-compatible HTTP server (FastAPI + uvicorn) over the inference engine.

Endpoints: ``POST /v1/completions``, ``POST /v1/chat/completions``, ``POST /v1/score``,
``GET /v1/models``, ``GET /v1/stats``, ``GET /health``. Handlers validate the request (bad input:
HTTP 400 with OpenAI's error object naming the field), turn it into engine requests and hand them
to the :class:`~mimir_megatron.inference.scheduler.Scheduler` thread, the only one that touches
the engine; a full queue answers 503. Results come back through an asyncio queue per HTTP request.

Extra body fields (beyond OpenAI's): ``h_cycles`` / ``l_cycles`` (the recurrence schedule of this
request; default: the trained one) and ``top_k``. Not supported, and refused with 400 when set:
``echo``, ``suffix``, ``best_of`` > 1, ``logit_bias``, non-zero frequency/presence penalties.
``top_logprobs`` are not computed: completions return ``top_logprobs: null``, chat returns ``[]``.
"""

from __future__ import annotations

import asyncio
import json
import logging
import threading
import time
import uuid
from contextlib import asynccontextmanager, contextmanager
from dataclasses import dataclass
from typing import Any, Iterator

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field

from mimir_megatron.inference.engine import InferenceEngine, RequestError
from mimir_megatron.inference.scheduler import GenerationWork, QueueFull, Scheduler, ScoreWork
from mimir_megatron.inference.types import GenerationRequest, GenerationResult, SamplingParams, TokenEvent

log = logging.getLogger(__name__)

DEFAULT_MAX_TOKENS_LIMIT = 4096
COMPLETION_DEFAULT_MAX_TOKENS = 16  # OpenAI's default for /v1/completions
MAX_N = 128


class ApiError(Exception):
    """An error answered as OpenAI's ``{"error": {message, type, param, code}}``."""

    def __init__(self, status: int, message: str, param: str | None = None,
                 type: str = "invalid_request_error", code: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.type, self.code = status, message, param, type, code

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def bad_request(message: str, param: str | None, code: str | None = None) -> ApiError:
    return ApiError(400, message, param, code=code)


# -- request bodies (OpenAI's field names) ------------------------------------------------------------


class _Body(BaseModel):
    # Strict: "5" is not an integer. Unknown fields are kept and ignored (clients send many).
    model_config = ConfigDict(strict=True, extra="allow")

    model: str | None = None
    h_cycles: int | None = Field(None, ge=1)
    l_cycles: int | None = Field(None, ge=1)


class _Sampling(_Body):
    max_tokens: int | None = None
    temperature: float = Field(1.0, ge=0)
    top_p: float = Field(1.0, gt=0, le=1)
    top_k: int = Field(0, ge=0)
    n: int = Field(1, ge=1, le=MAX_N)
    stop: str | list[str] | None = None
    seed: int | None = None
    stream: bool = False
    stream_options: dict[str, Any] | None = None
    frequency_penalty: float | None = None
    presence_penalty: float | None = None
    logit_bias: dict[str, Any] | None = None


class CompletionBody(_Sampling):
    prompt: Any
    """str, list of str, list of token ids, or list of lists of token ids (checked by hand)."""
    logprobs: int | None = Field(None, ge=0, le=20)
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = None


class ChatMessage(BaseModel):
    model_config = ConfigDict(strict=True, extra="allow")  # name, tool_calls, tool_call_id, ...

    role: str
    content: str | list[dict[str, Any]] | None = None


class ChatBody(_Sampling):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=20)
    tools: list[dict[str, Any]] | None = None
    tool_choice: Any = None


class ScoreItem(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")

    context: str | list[int]
    continuation: str | list[int]


class ScoreBody(_Body):
    context: str | list[int] | None = None
    continuation: str | list[int] | None = None
    items: list[ScoreItem] | None = None


# -- from a body to engine requests ---------------------------------------------------------------------


@dataclass
class Limits:
    max_tokens_limit: int
    max_queue: int


class Translator:
    """Checks bodies against the engine and turns them into engine requests (no engine state is
    touched: safe on the HTTP thread)."""

    def __init__(self, engine: InferenceEngine, limits: Limits) -> None:
        self.engine = engine
        self.limits = limits

    def check_model(self, body: _Body) -> None:
        if body.model is not None and body.model != self.engine.model_name:
            raise ApiError(400, f"model {body.model!r} is not served here; this server serves "
                                f"{self.engine.model_name!r}", "model", code="model_not_found")

    def schedule(self, body: _Body) -> tuple[int, int]:
        try:
            return self.engine.schedule(body.h_cycles, body.l_cycles)
        except RequestError as exc:
            raise bad_request(str(exc), "h_cycles" if "h_cycles" in str(exc) else "l_cycles") from exc

    def ids(self, value: str | list[int], param: str) -> list[int]:
        """Token ids of a text or a list of ids (checked against the vocabulary)."""
        try:
            ids = self.engine.encode(value) if isinstance(value, str) else value
            self.engine.check_ids(ids, param)
        except RequestError as exc:
            raise bad_request(str(exc), param) from exc
        return list(ids)

    def prompts(self, prompt: Any) -> list[list[int]]:
        """OpenAI's four prompt forms, as token-id lists."""
        if isinstance(prompt, str):
            return [self.ids(prompt, "prompt")]
        if isinstance(prompt, list) and prompt:
            if all(isinstance(p, str) for p in prompt):
                return [self.ids(p, f"prompt[{i}]") for i, p in enumerate(prompt)]
            if all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
                return [self.ids(prompt, "prompt")]
            if all(isinstance(p, list) for p in prompt):
                return [self.ids(p, f"prompt[{i}]") for i, p in enumerate(prompt)]
        raise bad_request("prompt must be a non-empty string, list of strings, list of token ids "
                          "or list of lists of token ids", "prompt")

    def chat_prompt(self, body: ChatBody) -> list[int]:
        messages = [self._message(m) for m in body.messages]
        try:
            ids = self.engine.render_chat(messages, body.tools)
        except RequestError as exc:
            raise bad_request(str(exc), "messages") from exc
        except Exception as exc:  # noqa: BLE001 - the template refuses the conversation (jinja raise)
            raise bad_request(f"the chat template cannot render these messages: {exc}", "messages") from exc
        return ids

    @staticmethod
    def _message(message: ChatMessage) -> dict:
        out = message.model_dump(exclude_none=True)
        if isinstance(message.content, list):  # content parts: only text can be rendered
            texts = []
            for part in message.content:
                if part.get("type") != "text" or not isinstance(part.get("text"), str):
                    raise bad_request("only text content parts are supported", "messages")
                texts.append(part["text"])
            out["content"] = "".join(texts)
        return out

    def unsupported(self, body: _Sampling) -> None:
        for name in ("frequency_penalty", "presence_penalty"):
            if getattr(body, name):
                raise bad_request(f"{name} is not supported", name)
        if body.logit_bias:
            raise bad_request("logit_bias is not supported", "logit_bias")
        if isinstance(body, CompletionBody):
            if body.echo:
                raise bad_request("echo is not supported: a PrefixLM scores a continuation only with its "
                                  "context split off; use POST /v1/score, or `mimir lm-eval` for "
                                  "lm-evaluation-harness", "echo")
            if body.suffix:
                raise bad_request("suffix is not supported", "suffix")
            if body.best_of not in (None, 1):
                raise bad_request("best_of is not supported", "best_of")
        if body.model_extra:
            log.debug("ignoring unknown request fields %s", sorted(body.model_extra))

    def max_tokens(self, value: int | None, default: int, param: str) -> int:
        if value is None:
            return min(default, self.limits.max_tokens_limit)
        if value < 1:
            raise bad_request(f"{param} must be >= 1, got {value}", param)
        if value > self.limits.max_tokens_limit:
            limit = self.limits.max_tokens_limit
            raise bad_request(f"{param} is {value}; this server allows at most {limit}", param)
        return value

    def requests(self, body: _Sampling, prompts: list[list[int]], max_tokens: int,
                 prompt_param: str) -> list[GenerationRequest]:
        """``n`` requests per prompt (seeds seed, seed + 1, ... in choice order)."""
        h, low = self.schedule(body)
        if len(prompts) * body.n > self.limits.max_queue:
            raise bad_request(f"{len(prompts)} prompts x n={body.n} requests cannot fit the queue of "
                              f"{self.limits.max_queue}", "n")
        stops = (body.stop,) if isinstance(body.stop, str) else tuple(body.stop or ())
        if any(not s for s in stops):
            raise bad_request("stop strings must not be empty", "stop")
        out = []
        for p, prompt in enumerate(prompts):
            if len(prompt) >= self.engine.max_context:
                raise bad_request(f"the prompt has {len(prompt)} tokens; the context holds "
                                  f"{self.engine.max_context} (prompt + generated)",
                                  prompt_param if len(prompts) == 1 else f"{prompt_param}[{p}]",
                                  code="context_length_exceeded")
            for j in range(body.n):
                seed = None if body.seed is None else body.seed + p * body.n + j
                params = SamplingParams(max_new_tokens=max_tokens, temperature=body.temperature,
                                        top_k=body.top_k, top_p=body.top_p, seed=seed, stop_strings=stops)
                request = GenerationRequest(prompt, params, h, low)
                try:
                    self.engine.check_request(request)
                except RequestError as exc:  # a backstop: the checks above name the field
                    raise bad_request(str(exc), _field_of(str(exc), prompt_param)) from exc
                out.append(request)
        return out


def _field_of(message: str, prompt_param: str) -> str | None:
    first = message.split(" ", 1)[0]
    return {"max_new_tokens": "max_tokens", "prompt": prompt_param, "stop": "stop"}.get(first, first)


# -- results coming back from the scheduler thread ---------------------------------------------------


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


def _as_api_error(error: BaseException) -> ApiError:
    if isinstance(error, ApiError):
        return error
    if isinstance(error, RequestError):
        return bad_request(str(error), None)
    return ApiError(500, f"internal error: {error}", None, type="server_error")


class Server:
    """The FastAPI app's state: engine, scheduler, limits."""

    def __init__(self, engine: InferenceEngine, *, max_tokens_limit: int | None = None, max_queue: int = 256,
                 max_batch_size: int | None = None) -> None:
        if max_batch_size is not None:
            engine.max_batch_size = max_batch_size
        limit = max_tokens_limit or min(DEFAULT_MAX_TOKENS_LIMIT, engine.max_context)
        self.engine = engine
        self.limits = Limits(max_tokens_limit=limit, max_queue=max_queue)
        self.translate = Translator(engine, self.limits)
        self.scheduler = Scheduler(engine, max_queue=max_queue)
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
        works = [GenerationWork(r, _QueueSink(loop, queue, i), self.engine.schedule(r.h_cycles, r.l_cycles))
                 for i, r in enumerate(requests)]
        self.submit(works)
        return queue, works

    async def results(self, queue: asyncio.Queue, works: list[GenerationWork]) -> list[GenerationResult]:
        results: list[GenerationResult | None] = [None] * len(works)
        try:
            while any(r is None for r in results):
                kind, index, value = await queue.get()
                if kind == "error":
                    raise _as_api_error(value)
                if value.finished:
                    results[index] = value.result
        finally:
            for work in works:  # the client left, or one choice failed: stop delivering the others
                work.cancelled = True
        return results  # type: ignore[return-value]

    async def events(self, queue: asyncio.Queue, works: list[GenerationWork]):
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

    # -- response pieces ----------------------------------------------------------------------------

    def token_text(self, token_id: int) -> str:
        tok = self.engine.tokenizer
        if tok is None:
            return f"token_id:{token_id}"
        return tok.decode([token_id], skip_special_tokens=False)

    def legacy_logprobs(self, token_ids: list[int], logprobs: list[float], offset: int = 0) -> dict:
        tokens = [self.token_text(t) for t in token_ids]
        offsets, at = [], offset
        for t in tokens:
            offsets.append(at)
            at += len(t)
        return {"tokens": tokens, "token_logprobs": logprobs, "top_logprobs": None, "text_offset": offsets}

    def chat_logprobs(self, token_ids: list[int], logprobs: list[float]) -> dict:
        content = []
        for t, lp in zip(token_ids, logprobs):
            text = self.token_text(t)
            content.append({"token": text, "logprob": lp, "bytes": list(text.encode()), "top_logprobs": []})
        return {"content": content}

    @staticmethod
    def usage(prompt_tokens: int, completion_tokens: int) -> dict:
        return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                "total_tokens": prompt_tokens + completion_tokens}


def _sse(payload: dict | str) -> str:
    return f"data: {payload if isinstance(payload, str) else json.dumps(payload)}\n\n"


# -- the app -------------------------------------------------------------------------------------------


def build_app(engine: InferenceEngine, **limits) -> FastAPI:
    """The FastAPI app; its lifespan starts and stops the scheduler thread.
    ``limits``: ``max_tokens_limit``, ``max_queue``, ``max_batch_size``."""
    server = Server(engine, **limits)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        server.scheduler.start()
        log.info("serving %s (context %d, max_tokens <= %d, queue %d, batch %d)", engine.model_name,
                 engine.max_context, server.limits.max_tokens_limit, server.limits.max_queue,
                 engine.max_batch_size)
        try:
            yield
        finally:
            server.scheduler.stop()

    app = FastAPI(title="mimir serve", lifespan=lifespan)
    app.state.server = server

    @app.exception_handler(ApiError)
    async def api_error(request: Request, exc: ApiError):
        return JSONResponse(exc.body(), status_code=exc.status)

    @app.exception_handler(RequestValidationError)
    async def validation_error(request: Request, exc: RequestValidationError):
        errors = exc.errors()
        parts, param = [], None
        for err in errors[:3]:
            loc = [str(x) for x in err.get("loc", ()) if x != "body"]
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
            "max_model_len": engine.max_context, "trained_schedule": list(engine.trained_schedule)}]}

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
    async def completions(body: CompletionBody):
        tr = server.translate
        tr.check_model(body)
        tr.unsupported(body)
        prompts = tr.prompts(body.prompt)
        max_tokens = tr.max_tokens(body.max_tokens, COMPLETION_DEFAULT_MAX_TOKENS, "max_tokens")
        requests = tr.requests(body, prompts, max_tokens, "prompt")
        queue, works = server.generation_works(requests)
        head = {"id": f"cmpl-{uuid.uuid4().hex}", "object": "text_completion", "created": int(time.time()),
                "model": engine.model_name}
        prompt_tokens = sum(len(p) for p in prompts)
        want_logprobs = body.logprobs is not None
        if body.stream:
            return _stream(server.events(queue, works), _completion_chunks(server, head, want_logprobs,
                                                                           prompt_tokens, body))
        results = await server.results(queue, works)
        choices = [{"index": i, "text": r.text if r.text is not None else "",
                    "logprobs": server.legacy_logprobs(r.token_ids, r.logprobs) if want_logprobs else None,
                    "finish_reason": r.finish_reason} for i, r in enumerate(results)]
        return {**head, "choices": choices,
                "usage": server.usage(prompt_tokens, sum(len(r.token_ids) for r in results))}

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatBody):
        tr = server.translate
        tr.check_model(body)
        tr.unsupported(body)
        prompt = tr.chat_prompt(body)
        asked = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
        param = "max_completion_tokens" if body.max_completion_tokens is not None else "max_tokens"
        max_tokens = tr.max_tokens(asked, max(1, engine.max_context - len(prompt)), param)
        requests = tr.requests(body, [prompt], max_tokens, "messages")
        queue, works = server.generation_works(requests)
        head = {"id": f"chatcmpl-{uuid.uuid4().hex}", "object": "chat.completion",
                "created": int(time.time()), "model": engine.model_name}
        prompt_tokens = len(prompt) * body.n
        if body.stream:
            return _stream(server.events(queue, works), _chat_chunks(server, head, body, prompt_tokens))
        results = await server.results(queue, works)
        choices = [{"index": i,
                    "message": {"role": "assistant", "content": r.text if r.text is not None else ""},
                    "logprobs": server.chat_logprobs(r.token_ids, r.logprobs) if body.logprobs else None,
                    "finish_reason": r.finish_reason} for i, r in enumerate(results)]
        return {**head, "choices": choices,
                "usage": server.usage(prompt_tokens, sum(len(r.token_ids) for r in results))}

    @app.post("/v1/score")
    async def score(body: ScoreBody):
        tr = server.translate
        tr.check_model(body)
        schedule = tr.schedule(body)
        if body.items is not None:
            if body.context is not None or body.continuation is not None:
                raise bad_request("give either items or context + continuation, not both", "items")
            if not body.items:
                raise bad_request("items must not be empty", "items")
            raw = [(f"items[{i}].", it.context, it.continuation) for i, it in enumerate(body.items)]
        else:
            for name in ("context", "continuation"):
                if getattr(body, name) is None:
                    raise bad_request(f"{name} is required (or items)", name)
            raw = [("", body.context, body.continuation)]
        pairs = []
        for where, context, continuation in raw:
            pair = (tr.ids(context, f"{where}context"), tr.ids(continuation, f"{where}continuation"))
            if len(pair[0]) + len(pair[1]) - 1 > engine.max_context:
                raise bad_request(f"context + continuation have {len(pair[0]) + len(pair[1])} tokens; "
                                  f"the context holds {engine.max_context}", f"{where}continuation",
                                  code="context_length_exceeded")
            pairs.append(pair)
        loop, queue = asyncio.get_running_loop(), asyncio.Queue()
        work = ScoreWork(pairs, _QueueSink(loop, queue, 0), schedule)
        server.submit([work])
        try:
            kind, _, value = await queue.get()
        finally:
            work.cancelled = True
        if kind == "error":
            raise _as_api_error(value)
        results = [{"logprob": r.logprob, "token_logprobs": r.token_logprobs, "is_greedy": r.is_greedy,
                    "num_tokens": len(r.token_logprobs)} for r in value]
        return {"object": "score", "model": engine.model_name, "results": results,
                "usage": {"prompt_tokens": sum(len(c) + len(x) for c, x in pairs)}}

    return app


def _stream(events, chunks) -> StreamingResponse:
    async def body():
        try:
            async for piece in chunks(events):
                yield piece
        except ApiError as exc:  # after the 200 header: the error travels as an SSE event
            yield _sse(exc.body())
            return
        yield _sse("[DONE]")

    return StreamingResponse(body(), media_type="text/event-stream")


def _include_usage(body: _Sampling) -> bool:
    return bool(body.stream_options and body.stream_options.get("include_usage"))


def _completion_chunks(server: Server, head: dict, want_logprobs: bool, prompt_tokens: int,
                       body: CompletionBody):
    async def chunks(events):
        completion_tokens = 0
        offsets: dict[int, int] = {}
        async for index, event in events:
            completion_tokens += 1
            if not (event.text or event.finished or want_logprobs):
                continue
            choice = {"index": index, "text": event.text or "", "logprobs": None,
                      "finish_reason": event.finish_reason}
            if want_logprobs:
                choice["logprobs"] = server.legacy_logprobs([event.token_id], [event.logprob],
                                                            offsets.get(index, 0))
            offsets[index] = offsets.get(index, 0) + len(event.text or "")
            yield _sse({**head, "choices": [choice]})
        if _include_usage(body):
            yield _sse({**head, "choices": [], "usage": server.usage(prompt_tokens, completion_tokens)})

    return chunks


def _chat_chunks(server: Server, head: dict, body: ChatBody, prompt_tokens: int):
    head = {**head, "object": "chat.completion.chunk"}

    async def chunks(events):
        for i in range(body.n):
            yield _sse({**head, "choices": [{"index": i, "delta": {"role": "assistant", "content": ""},
                                             "logprobs": None, "finish_reason": None}]})
        completion_tokens = 0
        async for index, event in events:
            completion_tokens += 1
            if not (event.text or event.finished or body.logprobs):
                continue
            logprobs = server.chat_logprobs([event.token_id], [event.logprob]) if body.logprobs else None
            choice = {"index": index, "delta": {"content": event.text} if event.text else {},
                      "logprobs": logprobs, "finish_reason": event.finish_reason}
            yield _sse({**head, "choices": [choice]})
        if _include_usage(body):
            yield _sse({**head, "choices": [], "usage": server.usage(prompt_tokens, completion_tokens)})

    return chunks


# -- running it -----------------------------------------------------------------------------------------


def serve(engine: InferenceEngine, host: str = "127.0.0.1", port: int = 8000, **limits) -> None:
    """Serve until interrupted (``mimir serve``)."""
    import uvicorn

    uvicorn.run(build_app(engine, **limits), host=host, port=port, log_level="info")


@contextmanager
def serve_in_thread(engine: InferenceEngine, host: str = "127.0.0.1", port: int = 0,
                    **limits) -> Iterator[str]:
    """Serve from a background thread; yields the base URL ``http://HOST:PORT/v1`` (``port=0``: a
    free port) once the server accepts connections, and shuts it down cleanly on exit.
    ``limits``: ``max_tokens_limit``, ``max_queue``, ``max_batch_size``."""
    with serve_app_in_thread(build_app(engine, **limits), host, port) as url:
        yield url


@contextmanager
def serve_app_in_thread(app: FastAPI, host: str = "127.0.0.1", port: int = 0) -> Iterator[str]:
    """:func:`serve_in_thread` for an app from :func:`build_app` (whose scheduler the caller may
    want to inspect: ``app_server(app).scheduler``)."""
    import uvicorn

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


def app_server(app: FastAPI) -> Server:
    """The :class:`Server` behind an app from :func:`build_app` (its scheduler, limits)."""
    return app.state.server
