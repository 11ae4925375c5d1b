"""The wire format of ``mimir serve``: request bodies (OpenAI's field names) and the error object.

A body is read up to a size limit (413 beyond it), parsed as strict JSON (UTF-8; no ``NaN``,
``Infinity`` or numbers that overflow to them; bounded nesting: :func:`parse_json`), then
validated against these models: strict ("5" is not an integer), known roles, a message's
content present. Validation against the model (vocabulary, context length, schedule and its
bounds) is not done here but by the engine, through :mod:`.translation`.
"""

from __future__ import annotations

import json
import math
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

DEFAULT_MAX_TOKENS_LIMIT = 4096
COMPLETION_DEFAULT_MAX_TOKENS = 16  # OpenAI's default for /v1/completions
MAX_N = 128
DEFAULT_CYCLES_FACTOR = 4
"""``h_cycles`` / ``l_cycles`` of a request may be at most this many times the trained ones (the
paper's Table 5 sweep goes to 1.5x H and 1.7x L)."""
BODY_BYTES_PER_TOKEN = 64
"""The default body limit allows this many bytes per context token: text averages ~4 bytes a
token, JSON escapes (``\\uXXXX``) take 6 bytes a character, tool schemas and turns add more."""
MIN_BODY_BYTES = 1 << 20
MAX_NESTING = 64
"""JSON nesting deeper than this is refused (tool schemas nest ~10 levels)."""


def default_max_body_bytes(max_context: int) -> int:
    """The request body limit for a context of ``max_context`` tokens."""
    return max(MIN_BODY_BYTES, BODY_BYTES_PER_TOKEN * max_context)


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


def too_large(limit: int) -> ApiError:
    return ApiError(413, f"request body is larger than this server's limit of {limit:,} bytes "
                         "(mimir serve --max-body-bytes)", None, code="request_too_large")


def _invalid_json(message: str) -> ApiError:
    return bad_request(f"request body is not valid JSON: {message}", None, code="invalid_json")


def _refuse_constant(name: str) -> None:
    raise _invalid_json(f"{name} is not a JSON number (non-finite numbers are refused)")


def _finite_float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise _invalid_json(f"{text[:40]} overflows to infinity (non-finite numbers are refused)")
    return value


def parse_json(raw: bytes) -> Any:
    """A request body as JSON, strictly: UTF-8, no ``NaN``/``Infinity``/``-Infinity``, no number
    that overflows a float, nesting at most :data:`MAX_NESTING` deep. Anything else is a 400
    (code ``invalid_json``) in OpenAI's error object."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise _invalid_json(f"not UTF-8 (byte {exc.start})") from None
    try:
        value = json.loads(text, parse_constant=_refuse_constant, parse_float=_finite_float)
    except json.JSONDecodeError as exc:
        raise _invalid_json(f"{exc.msg} at line {exc.lineno} column {exc.colno}") from None
    except RecursionError:
        raise _invalid_json(f"nested deeper than {MAX_NESTING} levels") from None
    if _depth(value) > MAX_NESTING:
        raise _invalid_json(f"nested deeper than {MAX_NESTING} levels")
    return value


def _depth(value: Any) -> int:
    """Nesting depth of parsed JSON (iterative: no recursion limit to hit)."""
    deepest, stack = 0, [(value, 1)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, dict):
            item = item.values()
        elif not isinstance(item, list):
            continue
        deepest = max(deepest, depth)
        if depth <= MAX_NESTING:
            stack.extend((child, depth + 1) for child in item)
    return deepest


class Body(BaseModel):
    # Unknown fields are collected (extra="allow") and refused by the translation with a 400 that
    # names them: a field the server does not implement is never silently ignored.
    model_config = ConfigDict(strict=True, extra="allow")

    model: str | None = None
    h_cycles: int | None = Field(None, ge=1)
    l_cycles: int | None = Field(None, ge=1)


PLATFORM_FIELDS = ("store", "metadata", "service_tier", "prompt_cache_key", "safety_identifier", "verbosity",
                   "user")
"""OpenAI platform fields that cannot change the output: accepted, logged once per field (vLLM
accepts them with a warning). ``verbosity`` and ``service_tier`` are hints this server has no use for."""


class SamplingBody(Body):
    """The fields every generation endpoint shares. ``null`` is the default for every optional
    field (the openai SDK sends null for a parameter passed as None)."""

    max_tokens: int | None = None
    temperature: float | None = Field(None, ge=0, le=2)
    """Default 1 (OpenAI's); OpenAI's range, [0, 2]."""
    top_p: float | None = Field(None, ge=0, le=1)
    """OpenAI's range, [0, 1]: 0 keeps only the most likely token (the smallest nucleus)."""
    top_k: int | None = Field(None, ge=-1)
    """vLLM's: 0 or -1 = off."""
    min_p: float | None = Field(None, ge=0, le=1)
    n: int | None = Field(None, ge=1, le=MAX_N)
    stop: str | list[str] | None = None
    seed: int | None = None
    stream: bool | None = None
    stream_options: dict[str, Any] | None = None
    frequency_penalty: float | None = Field(None, ge=-2, le=2)
    presence_penalty: float | None = Field(None, ge=-2, le=2)
    repetition_penalty: float | None = Field(None, gt=0)
    logit_bias: dict[str, float] | None = None  # values checked with the engine's sampling fields
    """{token id as a string: bias in [-100, 100]} (OpenAI's form)."""
    min_tokens: int | None = Field(None, ge=0)
    skip_special_tokens: bool | None = None
    response_format: dict[str, Any] | None = None
    """``{"type": "text" | "json_object" | "json_schema", "json_schema": {"schema": ...}}``."""
    ignore_eos: bool | None = None
    """vLLM's extra field: generate past the end-of-turn / eos tokens (benchmarks)."""
    # Platform fields (PLATFORM_FIELDS): no effect on the output.
    user: str | None = None
    store: bool | None = None
    metadata: dict[str, str] | None = None
    service_tier: str | None = None
    prompt_cache_key: str | None = None
    safety_identifier: str | None = None
    verbosity: str | None = None

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.get("include_usage"))

    @property
    def choices(self) -> int:
        return 1 if self.n is None else self.n


class CompletionBody(SamplingBody):
    prompt: Any
    """str, list of str, list of token ids, or list of lists of token ids (checked by hand)."""
    logprobs: int | None = Field(None, ge=0, le=20)
    echo: bool | None = None
    suffix: str | None = None
    best_of: int | None = None


class ChatMessage(BaseModel):
    model_config = ConfigDict(strict=True, extra="allow")  # name, tool_calls, tool_call_id, ...

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[dict[str, Any]] | None = None

    @model_validator(mode="after")
    def _content_present(self) -> "ChatMessage":
        # Only an assistant turn that calls tools may come without content (OpenAI's rule).
        calls = (self.model_extra or {}).get("tool_calls")
        if self.content is None and not (self.role == "assistant" and calls):
            raise ValueError(f"a {self.role} message needs content")
        return self


class ChatBody(SamplingBody):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = Field(None, ge=0, le=20)
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    """``none`` (tools not offered), ``auto`` (default with tools), ``required``, or
    ``{"type": "function", "function": {"name": ...}}``."""
    parallel_tool_calls: bool | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    """vLLM's: further variables for the chat template (``enable_thinking``, ...)."""
    reasoning_effort: str | None = None
    """Passed to the chat template as the variable ``reasoning_effort`` (as vLLM does)."""


class ResponsesBody(SamplingBody):
    """``POST /v1/responses``: OpenAI's Responses API (the fields this server implements)."""

    input: str | list[dict[str, Any]]
    instructions: str | None = None
    max_output_tokens: int | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    previous_response_id: str | None = None
    text: dict[str, Any] | None = None
    """``{"format": {"type": "text" | "json_object" | "json_schema", ...}}``."""
    reasoning: dict[str, Any] | None = None
    """``{"effort": ...}``: passed to the chat template as ``reasoning_effort``."""
    include: list[str] | None = None
    """:data:`RESPONSES_INCLUDE`; anything else is refused."""
    truncation: str | None = None
    top_logprobs: int | None = Field(None, ge=0, le=20)
    chat_template_kwargs: dict[str, Any] | None = None

    @property
    def wants_logprobs(self) -> bool:
        """The output text's log-probs are served: asked for with ``include`` or ``top_logprobs``."""
        return LOGPROBS_INCLUDE in (self.include or ()) or bool(self.top_logprobs)


LOGPROBS_INCLUDE = "message.output_text.logprobs"
RESPONSES_INCLUDE = (LOGPROBS_INCLUDE, "reasoning.encrypted_content")
"""``include`` values served: the output text's log-probs, and encrypted reasoning (this server
produces no reasoning items, so there is never any to include)."""


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
