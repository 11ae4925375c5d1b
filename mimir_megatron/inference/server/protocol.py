"""The wire format of ``mimir serve``: request bodies (OpenAI's field names) and the error object.

Bodies are strict ("5" is not an integer). Validation against the model (vocabulary, context
length, schedule) is not done here but by the engine, through :mod:`.translation`.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field

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


class Body(BaseModel):
    # Unknown fields are collected (extra="allow") and refused by the translation with a 400 that
    # names them: a field the server does not implement is never silently ignored.
    model_config = ConfigDict(strict=True, extra="allow")

    model: str | None = None
    h_cycles: int | None = Field(None, ge=1)
    l_cycles: int | None = Field(None, ge=1)


class SamplingBody(Body):
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
    response_format: dict[str, Any] | None = None
    """``{"type": "text" | "json_object" | "json_schema", "json_schema": {"schema": ...}}``."""
    ignore_eos: bool = False
    """vLLM's extra field: generate past the end-of-turn / eos tokens (benchmarks)."""
    user: str | None = None
    """An end-user id for the client's records; it has no effect on the output."""

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.get("include_usage"))


class CompletionBody(SamplingBody):
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


class ChatBody(SamplingBody):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=20)
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    """``none`` (tools not offered), ``auto`` (default with tools), ``required``, or
    ``{"type": "function", "function": {"name": ...}}``."""
    parallel_tool_calls: bool = True


class ScoreItem(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")

    context: str | list[int]
    continuation: str | list[int]
    bidirectional_tokens: int | None = Field(None, ge=0)
    """How many leading context tokens attend bidirectionally (the rest of the context is
    causal, as response text was in training); None: all of the context."""


class ScoreBody(Body):
    context: str | list[int] | None = None
    continuation: str | list[int] | None = None
    bidirectional_tokens: int | None = Field(None, ge=0)
    items: list[ScoreItem] | None = None
