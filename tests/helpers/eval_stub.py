"""A scripted OpenAI-compatible stand-in server for the evaluation tests (FastAPI on 127.0.0.1).

Replies to ``/v1/chat/completions`` come from ``replies`` (last user message -> text; unknown
prompts get ``default``); ``/v1/score`` returns ``logprobs[(context, continuation)]`` (else -10).
Requests with an ``h_cycles`` in ``collapsed_h_cycles`` get ``default``. Every request body is
recorded in ``requests``.
"""

from __future__ import annotations

import contextlib
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import uvicorn
from fastapi import FastAPI, Request


@dataclass
class Script:
    replies: dict[str, str] = field(default_factory=dict)
    default: str = "?"
    logprobs: dict[tuple[str, str], float] = field(default_factory=dict)
    collapsed_h_cycles: set[int] = field(default_factory=set)
    """Requests with these h_cycles get ``default`` (a schedule the model cannot run)."""
    requests: list[dict[str, Any]] = field(default_factory=list)


def make_app(script: Script, model: str = "stub-model") -> FastAPI:
    app = FastAPI()

    @app.get("/health")
    async def health() -> dict:
        return {"status": "ok"}

    @app.get("/v1/models")
    async def models() -> dict:
        return {"object": "list", "data": [{"id": model, "object": "model", "owned_by": "test"}]}

    @app.post("/v1/chat/completions")
    async def chat(request: Request) -> dict:
        body = await request.json()
        script.requests.append(body)
        text = script.replies.get(body["messages"][-1]["content"], script.default)
        if body.get("h_cycles") in script.collapsed_h_cycles:
            text = script.default
        return {"id": "stub", "object": "chat.completion", "created": 0, "model": body["model"],
                "choices": [{"index": 0, "finish_reason": "stop",
                             "message": {"role": "assistant", "content": text}}],
                "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2}}

    @app.post("/v1/score")
    async def score(request: Request) -> dict:
        body = await request.json()
        script.requests.append(body)
        results = []
        for item in body["items"]:
            key = (str(item["context"]), str(item["continuation"]))
            results.append({"logprob": script.logprobs.get(key, -10.0), "token_logprobs": [],
                            "is_greedy": False, "num_tokens": 1})
        return {"results": results}

    return app


@contextlib.contextmanager
def serve_stub(script: Script, model: str = "stub-model"):
    """Yields the base URL (".../v1") of a stub server on a free 127.0.0.1 port."""
    config = uvicorn.Config(make_app(script, model), host="127.0.0.1", port=0, log_level="warning")
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    while not server.started:
        time.sleep(0.02)
    port = server.servers[0].sockets[0].getsockname()[1]
    try:
        yield f"http://127.0.0.1:{port}/v1"
    finally:
        server.should_exit = True
        thread.join(timeout=10)
