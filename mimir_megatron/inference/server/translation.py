"""From a request body to engine work, for every endpoint.

The engine is the one place a request is validated against the model (vocabulary, context length,
schedule, sampling parameters); this module turns its :class:`RequestError` into a 400 naming the
body's field. Nothing here touches engine state: safe on the HTTP thread.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from mimir_megatron.inference.engine import InferenceEngine, RequestError
from mimir_megatron.inference.grammar import Grammar, Grammars
from mimir_megatron.inference.server.protocol import (
    COMPLETION_DEFAULT_MAX_TOKENS,
    ApiError,
    Body,
    ChatBody,
    ChatMessage,
    CompletionBody,
    SamplingBody,
    ScoreBody,
    bad_request,
)
from mimir_megatron.inference.tool_calls import template_supports_tools
from mimir_megatron.inference.types import GenerationRequest, SamplingParams

# Engine field names -> the body's names.
_BODY_FIELD = {"max_new_tokens": "max_tokens"}


@dataclass
class Limits:
    max_tokens_limit: int
    max_queue: int


@dataclass
class Generation:
    """What a completions or chat body asks of the engine."""

    requests: list[GenerationRequest]
    prompt_tokens: int
    parse_tool_calls: bool = False
    """Chat with tools offered: the reply's tool-call syntax becomes ``tool_calls``."""


@dataclass
class Scoring:
    """What a score body asks of the engine."""

    pairs: list[tuple[list[int], list[int]]]
    schedule: tuple[int, int]
    bidirectional_tokens: list[int | None]
    """Per pair: leading context tokens that attend bidirectionally (None: all of the context)."""


def _api_error(exc: RequestError, where: str = "", field: str | None = None) -> ApiError:
    """A 400 for an engine refusal; ``where`` prefixes the field (``items[2].``, ``prompt[1]``)."""
    name = field or _BODY_FIELD.get(exc.field or "", exc.field)
    return bad_request(str(exc), f"{where}{name}" if name else None, code=exc.code)


class Translator:
    """Turns bodies into engine requests; the engine validates them."""

    def __init__(self, engine: InferenceEngine, limits: Limits) -> None:
        self.engine = engine
        self.limits = limits
        self.grammars = Grammars(engine.tokenizer, engine.vocab_size, engine.default_stop_ids)

    # -- the endpoints ---------------------------------------------------------------------------

    def completion(self, body: CompletionBody) -> Generation:
        self._check_model(body)
        self._unsupported(body)
        prompts = self._prompts(body.prompt)
        max_tokens = self._max_tokens(body.max_tokens, COMPLETION_DEFAULT_MAX_TOKENS, "max_tokens")
        grammar = self._response_format(body)
        requests = self._requests(body, prompts, max_tokens, "prompt", body.logprobs or 0, grammar)
        return Generation(requests, sum(len(p) for p in prompts))

    def chat(self, body: ChatBody) -> Generation:
        self._check_model(body)
        self._unsupported(body)
        if body.top_logprobs and not body.logprobs:
            raise bad_request("top_logprobs needs logprobs: true", "top_logprobs")
        tools, tool_grammar = self._tools(body)
        grammar = self._response_format(body)
        if grammar is not None and tool_grammar is not None:
            raise bad_request("response_format cannot be combined with a required tool call",
                              "response_format")
        prompt = self._chat_prompt(body, tools)
        asked = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
        param = "max_completion_tokens" if body.max_completion_tokens is not None else "max_tokens"
        max_tokens = self._max_tokens(asked, max(1, self.engine.max_context - len(prompt)), param)
        top = (body.top_logprobs or 0) if body.logprobs else 0
        requests = self._requests(body, [prompt], max_tokens, "messages", top, grammar or tool_grammar)
        return Generation(requests, len(prompt) * body.n, parse_tool_calls=tools is not None)

    def score(self, body: ScoreBody) -> Scoring:
        self._check_model(body)
        self._refuse_unknown(body)
        schedule = self._schedule(body)
        if body.items is not None:
            if body.context is not None or body.continuation is not None:
                raise bad_request("give either items or context + continuation, not both", "items")
            if not body.items:
                raise bad_request("items must not be empty", "items")
            raw = [(f"items[{i}].", it.context, it.continuation, it.bidirectional_tokens)
                   for i, it in enumerate(body.items)]
        else:
            for name in ("context", "continuation"):
                if getattr(body, name) is None:
                    raise bad_request(f"{name} is required (or items)", name)
            raw = [("", body.context, body.continuation, body.bidirectional_tokens)]
        pairs = []
        for where, context, continuation, _ in raw:
            pair = (self._ids(context, f"{where}context"), self._ids(continuation, f"{where}continuation"))
            try:
                self.engine.check_pair(*pair)
            except RequestError as exc:
                raise _api_error(exc, where) from exc
            pairs.append(pair)
        return Scoring(pairs, schedule, [b for *_, b in raw])

    # -- pieces ----------------------------------------------------------------------------------

    def _check_model(self, body: Body) -> None:
        if body.model is not None and body.model != self.engine.model_name:
            raise ApiError(400, f"model {body.model!r} is not served here; this server serves "
                                f"{self.engine.model_name!r}", "model", code="model_not_found")

    def _schedule(self, body: Body) -> tuple[int, int]:
        try:
            return self.engine.schedule(body.h_cycles, body.l_cycles)
        except RequestError as exc:
            raise _api_error(exc) from exc

    def _ids(self, value: str | list[int], param: str) -> list[int]:
        """Token ids of a text or a list of ids (checked against the vocabulary)."""
        try:
            ids = self.engine.encode(value) if isinstance(value, str) else value
            self.engine.check_ids(ids, param)
        except RequestError as exc:
            raise bad_request(str(exc), param) from exc
        return list(ids)

    def _prompts(self, prompt: Any) -> list[list[int]]:
        """OpenAI's four prompt forms, as token-id lists."""
        if isinstance(prompt, str):
            return [self._ids(prompt, "prompt")]
        if isinstance(prompt, list) and prompt:
            if all(isinstance(p, str) for p in prompt):
                return [self._ids(p, f"prompt[{i}]") for i, p in enumerate(prompt)]
            if all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
                return [self._ids(prompt, "prompt")]
            if all(isinstance(p, list) for p in prompt):
                return [self._ids(p, f"prompt[{i}]") for i, p in enumerate(prompt)]
        raise bad_request("prompt must be a non-empty string, list of strings, list of token ids "
                          "or list of lists of token ids", "prompt")

    def _chat_prompt(self, body: ChatBody, tools: list[dict[str, Any]] | None) -> list[int]:
        messages = [self._message(m) for m in body.messages]
        try:
            return self.engine.render_chat(messages, tools)
        except RequestError as exc:
            raise bad_request(str(exc), "messages") from exc
        except Exception as exc:  # noqa: BLE001 - the template refuses the conversation (jinja raise)
            raise bad_request(f"the chat template cannot render these messages: {exc}", "messages") from exc

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

    def _unsupported(self, body: SamplingBody) -> None:
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
        self._refuse_unknown(body)

    @staticmethod
    def _refuse_unknown(body: Body) -> None:
        if body.model_extra:
            name = sorted(body.model_extra)[0]
            raise bad_request(f"{name} is not supported by this server", name)

    def _grammar(self, compile_, *args) -> Grammar:
        try:
            return compile_(*args)
        except RequestError as exc:
            raise _api_error(exc) from exc

    def _response_format(self, body: SamplingBody) -> Grammar | None:
        """The grammar ``response_format`` asks for (None: free text)."""
        spec = body.response_format
        if spec is None or spec.get("type") == "text":
            return None
        if spec.get("type") == "json_object":
            return self._grammar(self.grammars.json, None)
        if spec.get("type") == "json_schema":
            inner = spec.get("json_schema")
            schema = inner.get("schema") if isinstance(inner, dict) else None
            if not isinstance(schema, dict):
                raise bad_request("response_format.json_schema.schema must be a JSON schema object",
                                  "response_format")
            return self._grammar(self.grammars.json, schema)
        raise bad_request(f"response_format type {spec.get('type')!r} is not one of text, json_object, "
                          "json_schema", "response_format")

    def _tools(self, body: ChatBody) -> tuple[list[dict[str, Any]] | None, Grammar | None]:
        """(the tools the prompt offers, the grammar that enforces a call) for ``tool_choice``."""
        choice = body.tool_choice
        if not body.tools:
            if choice not in (None, "none"):
                raise bad_request("tool_choice needs tools", "tool_choice")
            return None, None
        if not template_supports_tools(self.engine.tokenizer):
            raise bad_request("this model's chat template does not render tools", "tools")
        names = []
        for i, tool in enumerate(body.tools):
            fn = tool.get("function") if tool.get("type") == "function" else None
            if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or not fn["name"]:
                raise bad_request('each tool must be {"type": "function", "function": {"name": ..., '
                                  '"parameters": ...}}', f"tools[{i}]")
            names.append(fn["name"])
        if choice == "none":
            return None, None
        if choice in (None, "auto"):
            return body.tools, None
        if choice == "required":
            return body.tools, self._grammar(self.grammars.tool_calls, body.tools, body.parallel_tool_calls)
        is_named = isinstance(choice, dict) and choice.get("type") == "function"
        named = choice.get("function") if is_named else None
        if isinstance(named, dict):
            name = named.get("name")
            if name not in names:
                raise bad_request(f"tool_choice names {name!r}, which is not among the tools", "tool_choice")
            return body.tools, self._grammar(self.grammars.tool_calls, [body.tools[names.index(name)]], False)
        raise bad_request('tool_choice must be "none", "auto", "required" or {"type": "function", '
                          '"function": {"name": ...}}', "tool_choice")

    def _max_tokens(self, value: int | None, default: int, param: str) -> int:
        if value is None:
            return min(default, self.limits.max_tokens_limit)
        if value < 1:
            raise bad_request(f"{param} must be >= 1, got {value}", param)
        if value > self.limits.max_tokens_limit:
            limit = self.limits.max_tokens_limit
            raise bad_request(f"{param} is {value}; this server allows at most {limit}", param)
        return value

    def _requests(self, body: SamplingBody, prompts: list[list[int]], max_tokens: int, prompt_param: str,
                  top_logprobs: int, grammar: Grammar | None) -> list[GenerationRequest]:
        """``n`` requests per prompt (seeds seed, seed + 1, ... in choice order), each checked by
        the engine."""
        h, low = self._schedule(body)
        if len(prompts) * body.n > self.limits.max_queue:
            raise bad_request(f"{len(prompts)} prompts x n={body.n} requests cannot fit the queue of "
                              f"{self.limits.max_queue}", "n")
        stops = (body.stop,) if isinstance(body.stop, str) else tuple(body.stop or ())
        out = []
        for p, prompt in enumerate(prompts):
            where = prompt_param if len(prompts) == 1 else f"{prompt_param}[{p}]"
            for j in range(body.n):
                seed = None if body.seed is None else body.seed + p * body.n + j
                params = SamplingParams(max_new_tokens=max_tokens, temperature=body.temperature,
                                        top_k=body.top_k, top_p=body.top_p, seed=seed, stop_strings=stops,
                                        use_default_stops=not body.ignore_eos, top_logprobs=top_logprobs)
                request = GenerationRequest(prompt, params, h, low, grammar)
                try:
                    self.engine.check_request(request)
                except RequestError as exc:
                    raise _api_error(exc, field=where if exc.field == "prompt" else None) from exc
                out.append(request)
        return out
