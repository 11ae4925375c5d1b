"""``mimir serve``: an OpenAI-compatible HTTP server (FastAPI + uvicorn) over the inference engine.

Endpoints: ``POST /v1/completions``, ``POST /v1/chat/completions``, ``POST /v1/responses`` (with
``GET``/``DELETE /v1/responses/{id}`` and ``GET /v1/responses/{id}/input_items``), ``POST /v1/score``,
``GET /v1/models``, ``GET /v1/stats``, ``GET /health``. A request travels
through one module per job:

- :mod:`.protocol`: the request bodies (OpenAI's field names) and the error object;
- :mod:`.translation`: body -> engine requests for every endpoint; the engine validates them
  against the model (bad input: HTTP 400 with OpenAI's error object naming the field);
- :mod:`.dispatch`: hands the work to the :class:`~mimir_megatron.inference.scheduler.Scheduler`
  thread (the only one that touches the engine; a full queue answers 503) and collects the
  results through an asyncio queue per HTTP request;
- :mod:`.completions_api`: the Completions and Chat Completions APIs' (and score's) reply bodies,
  whole or streamed as server-sent events; :mod:`.responses_api`: the Responses API;
- :mod:`.app`: the routes and the ways to run the app;
- :mod:`.auth`: the API-key check, one middleware around the whole app (``/health`` stays open).

Extra body fields (beyond OpenAI's): ``h_cycles`` / ``l_cycles`` (the recurrence schedule of this
request; default: the trained one), vLLM's ``top_k``, ``min_p``, ``repetition_penalty``,
``min_tokens``, ``skip_special_tokens``, ``chat_template_kwargs`` and ``ignore_eos``.
``response_format`` and forced tool calls (``tool_choice`` ``required`` or named) are grammars
(:mod:`..grammar`) that mask their own row's logits and always finish within ``max_tokens``.
Refused with 400 when set: ``echo``, ``suffix``, ``best_of`` > 1, and any field the server does
not know; platform fields that cannot change the output (``store``, ``metadata``, ...) are
accepted and logged once. :mod:`.responses_api` serves the Responses API. Reference:
``docs/serving.md``.
"""

from mimir_megatron.inference.server.app import (
    app_server,
    build_app,
    serve,
    serve_app_in_thread,
    serve_in_thread,
)

__all__ = ["app_server", "build_app", "serve", "serve_app_in_thread", "serve_in_thread"]
