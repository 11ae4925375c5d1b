"""The server's one API-key check: every request but ``GET /health`` carries ``Authorization:
Bearer <key>`` (the header every OpenAI client sends), else 401 in OpenAI's error object with code
``invalid_api_key`` (the OpenAI SDK raises ``AuthenticationError``).

It is ASGI middleware around the whole app, so it runs before routing, body reading and
validation: an unknown path, FastAPI's own pages and a streamed request are refused alike, and a
refused request costs no parsing and no engine time. The comparison is
:meth:`~mimir_megatron.inference.api_keys.ApiKeys.accepts` (constant time); the key is in no
message and no log line.
"""

from __future__ import annotations

from starlette.responses import JSONResponse
from starlette.types import ASGIApp, Receive, Scope, Send

from mimir_megatron.inference.api_keys import ApiKeys
from mimir_megatron.inference.server.protocol import ApiError

OPEN_PATHS = frozenset({"/health"})
"""Answered without a key: the liveness probe (the image's HEALTHCHECK, load balancers)."""


def bearer_token(headers: list[tuple[bytes, bytes]]) -> str | None:
    """The token of the request's ``Authorization: Bearer`` header (None without one)."""
    for name, value in headers:
        if name.lower() == b"authorization":
            scheme, _, token = value.decode("latin-1").strip().partition(" ")
            return token.strip() if scheme.lower() == "bearer" and token.strip() else None
    return None


def _refusal(token: str | None) -> JSONResponse:
    message = ("Incorrect API key provided." if token is not None else
               "You didn't provide an API key: send it as 'Authorization: Bearer <key>' (the openai client's "
               "api_key).")
    error = ApiError(401, message, None, code="invalid_api_key")
    return JSONResponse(error.body(), status_code=401, headers={"WWW-Authenticate": "Bearer"})


class RequireApiKey:
    """ASGI middleware: requests outside :data:`OPEN_PATHS` need one of ``keys``."""

    def __init__(self, app: ASGIApp, keys: ApiKeys) -> None:
        self.app, self.keys = app, keys

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan" or (scope["type"] == "http" and scope["path"] in OPEN_PATHS
                                           and scope["method"] in ("GET", "HEAD")):
            await self.app(scope, receive, send)
            return
        token = bearer_token(scope.get("headers", []))
        if self.keys.accepts(token):
            await self.app(scope, receive, send)
            return
        if scope["type"] != "http":  # a websocket: closed before it is accepted
            await send({"type": "websocket.close", "code": 1008})
            return
        await _refusal(token)(scope, receive, send)
