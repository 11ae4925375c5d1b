"""From a request body to engine work, for every endpoint.

The engine is the one place a request is validated against the model (vocabulary, context length,
schedule, sampling parameters); this module turns its :class:`RequestError` into a 400 naming the
body's field. Nothing here touches engine state: safe on the HTTP thread.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

from mimir_megatron.inference.engine import InferenceEngine
from mimir_megatron.inference.requests import RequestError
from mimir_megatron.inference.grammar import Grammar, Grammars
from mimir_megatron.inference.server.protocol import (
    COMPLETION_DEFAULT_MAX_TOKENS,
    PLATFORM_FIELDS,
    RESPONSES_INCLUDE,
    ApiError,
    Body,
    ChatBody,
    ChatMessage,
    CompletionBody,
    ResponsesBody,
    SamplingBody,
    ScoreBody,
    bad_request,
)
from mimir_megatron.inference.tool_calls import template_supports_tools
from mimir_megatron.inference.types import GenerationRequest, SamplingParams

log = logging.getLogger(__name__)

# Engine field names -> the body's names.
_BODY_FIELD = {"max_new_tokens": "max_tokens"}
# Variables the chat template gets from the server itself, never from chat_template_kwargs.
_RESERVED_TEMPLATE_VARIABLES = ("messages", "tools", "tokenize", "add_generation_prompt", "conversation")
_logged_platform_fields: set[str] = set()


def note_platform_fields(body: SamplingBody) -> None:
    """Log, once per field and process, that a platform field has no effect here."""
    for name in PLATFORM_FIELDS:
        if getattr(body, name, None) is not None and name not in _logged_platform_fields:
            _logged_platform_fields.add(name)
            log.warning("request field %r is accepted and has no effect on this server "
                        "(logged once)", name)


@dataclass
class Limits:
    max_tokens_limit: int
    max_queue: int
    max_body_bytes: int


@dataclass
class Generation:
    """What a completions or chat body asks of the engine."""

    requests: list[GenerationRequest]
    prompt_tokens: int
    parse_tool_calls: bool = False
    """Chat with tools offered: the reply's tool-call syntax becomes ``tool_calls``."""
    stream_calls: bool = False
    """A grammar makes every call of the reply well-formed: streamed as it is generated."""


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
        self.grammars = Grammars(engine.tokenizer, engine.limits.vocab_size, engine.default_stop_ids)

    # -- the endpoints ---------------------------------------------------------------------------

    def completion(self, body: CompletionBody) -> Generation:
        self._check_model(body)
        self._unsupported(body)
        prompts = self._prompts(body.prompt)
        max_tokens = self._max_tokens(body.max_tokens, COMPLETION_DEFAULT_MAX_TOKENS, "max_tokens")
        grammar = self._response_format(body.response_format)
        requests = self._requests(body, prompts, max_tokens, "prompt", body.logprobs or 0, grammar,
                                  budget_sent=body.max_tokens is not None)
        return Generation(requests, sum(len(p) for p in prompts))

    def chat(self, body: ChatBody) -> Generation:
        self._check_model(body)
        self._unsupported(body)
        if body.top_logprobs and not body.logprobs:
            raise bad_request("top_logprobs needs logprobs: true", "top_logprobs")
        asked = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
        param = "max_completion_tokens" if body.max_completion_tokens is not None else "max_tokens"
        messages = [self._message(m) for m in body.messages]
        kwargs = self._template_kwargs(body.chat_template_kwargs, body.reasoning_effort,
                                       "chat_template_kwargs")
        top = (body.top_logprobs or 0) if body.logprobs else 0
        return self.conversation(body, messages, body.tools, body.tool_choice, body.parallel_tool_calls,
                                 body.response_format, kwargs, asked, param, top)

    def responses(self, body: ResponsesBody, messages: list[dict]) -> Generation:
        """A Responses API body whose input is already ``messages`` (chat form, see
        :mod:`.responses_api`)."""
        self._check_model(body)
        self._unsupported(body)
        if body.choices != 1:
            raise bad_request("n must be 1 for /v1/responses", "n")
        for value in body.include or ():
            if value not in RESPONSES_INCLUDE:
                raise bad_request(f"include {value!r} is not served here (only "
                                  f"{', '.join(RESPONSES_INCLUDE)})", "include")
        effort = (body.reasoning or {}).get("effort") if isinstance(body.reasoning, dict) else None
        kwargs = self._template_kwargs(body.chat_template_kwargs, effort, "chat_template_kwargs")
        tools = None
        if body.tools:
            tools = []
            for i, tool in enumerate(body.tools):
                if tool.get("type") != "function" or not isinstance(tool.get("name"), str):
                    raise bad_request('each tool must be {"type": "function", "name": ..., '
                                      '"parameters": ...} '
                                      "(only function tools are served here)", f"tools[{i}]")
                fn = {k: v for k, v in tool.items() if k != "type"}
                tools.append({"type": "function", "function": fn})
        choice = body.tool_choice
        if isinstance(choice, dict) and choice.get("type") == "function" and "name" in choice:
            choice = {"type": "function", "function": {"name": choice["name"]}}
        response_format = None
        text_format = (body.text or {}).get("format") if isinstance(body.text, dict) else None
        if text_format is not None:
            if not isinstance(text_format, dict):
                raise bad_request("text.format must be an object", "text.format")
            if text_format.get("type") == "json_schema":
                inner = {k: v for k, v in text_format.items() if k != "type"}
                response_format = {"type": "json_schema", "json_schema": inner}
            else:
                response_format = text_format
        top = body.top_logprobs or 0
        return self.conversation(body, messages, tools, choice, body.parallel_tool_calls, response_format,
                                 kwargs, body.max_output_tokens, "max_output_tokens", top,
                                 format_param="text.format", prompt_param="input",
                                 parameters_param="tools[{i}].parameters")

    def conversation(self, body: SamplingBody, messages: list[dict], tools: list[dict] | None, choice,
                     parallel: bool | None, response_format: dict | None, template_kwargs: dict,
                     asked: int | None, param: str, top_logprobs: int, *, tools_param: str = "tools",
                     format_param: str = "response_format", prompt_param: str = "messages",
                     parameters_param: str = "tools[{i}].function.parameters") -> Generation:
        """What chat completions and responses share: tools, grammar, prompt, requests."""
        offered, tool_grammar, calls = self._tools(tools, choice, parallel, tools_param, parameters_param)
        answer = self._format_schema(response_format, format_param)
        grammar = tool_grammar
        if answer is not None and offered is not None and tool_grammar is None:
            # Tools offered (auto) and a format, OpenAI's rule: a call, or the final answer.
            grammar = self._grammar(self.grammars.union, offered, parallel is not False, *answer, tools_param,
                                    format_param, calls)
        elif answer is not None:
            # The answer alone; with a forced call (a call now, the format for a later turn) it is
            # still compiled, so that a format that cannot be is refused now.
            answer_grammar = self._grammar(self.grammars.json, answer[0], format_param, answer[1])
            grammar = answer_grammar if tool_grammar is None else tool_grammar
        prompt = self._chat_prompt(messages, offered, template_kwargs)
        max_tokens = self._max_tokens(asked, max(1, self.engine.max_context - len(prompt)), param)
        requests = self._requests(body, [prompt], max_tokens, prompt_param, top_logprobs, grammar,
                                  budget_param=param, budget_sent=asked is not None)
        return Generation(requests, len(prompt) * body.choices, parse_tool_calls=offered is not None,
                          stream_calls=offered is not None and grammar is not None)

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
                self.engine.limits.check_pair(*pair)
            except RequestError as exc:
                raise _api_error(exc, where) from exc
            pairs.append(pair)
        return Scoring(pairs, schedule, [b for *_, b in raw])

    # -- pieces ----------------------------------------------------------------------------------

    def _check_model(self, body: Body) -> None:
        if body.model is not None and body.model != self.engine.model_name:
            raise ApiError(404, f"model {body.model!r} is not served here; this server serves "
                                f"{self.engine.model_name!r}", "model", code="model_not_found")

    def _schedule(self, body: Body) -> tuple[int, int]:
        try:
            return self.engine.limits.schedule(body.h_cycles, body.l_cycles)
        except RequestError as exc:
            raise _api_error(exc) from exc

    def _ids(self, value: str | list[int], param: str) -> list[int]:
        """Token ids of a text or a list of ids (checked against the vocabulary)."""
        try:
            ids = self.engine.encode(value) if isinstance(value, str) else value
            self.engine.limits.check_ids(ids, param)
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

    @staticmethod
    def _template_kwargs(kwargs: dict | None, reasoning_effort: str | None, param: str) -> dict:
        out = dict(kwargs or {})
        reserved = sorted(set(out) & set(_RESERVED_TEMPLATE_VARIABLES))
        if reserved:
            raise bad_request(f"{param} must not set {reserved[0]!r} (the server renders it)", param)
        if reasoning_effort is not None:
            out.setdefault("reasoning_effort", reasoning_effort)
        return out

    def _chat_prompt(self, messages: list[dict], tools: list[dict[str, Any]] | None,
                     template_kwargs: dict | None = None) -> list[int]:
        try:
            return self.engine.render_chat(messages, tools, template_kwargs)
        except RequestError as exc:
            raise bad_request(str(exc), "messages") from exc
        except Exception as exc:  # noqa: BLE001 - the template refuses the conversation (jinja raise)
            raise bad_request(f"the chat template cannot render these messages: {exc}", "messages") from exc

    @staticmethod
    def _message(message: ChatMessage) -> dict:
        out = message.model_dump(exclude_none=True)
        if out["role"] == "developer":  # OpenAI's newer name for the system turn
            out["role"] = "system"
        if isinstance(message.content, list):  # content parts: only text can be rendered
            texts = []
            for part in message.content:
                if part.get("type") != "text" or not isinstance(part.get("text"), str):
                    raise bad_request("only text content parts are supported", "messages")
                texts.append(part["text"])
            out["content"] = "".join(texts)
        return out

    def _unsupported(self, body: SamplingBody) -> None:
        note_platform_fields(body)
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

    def _response_format(self, spec: dict | None, param: str = "response_format") -> Grammar | None:
        """The grammar ``response_format`` asks for (None: free text)."""
        answer = self._format_schema(spec, param)
        return None if answer is None else self._grammar(self.grammars.json, answer[0], param, answer[1])

    @staticmethod
    def _format_schema(spec: dict | None, param: str) -> tuple[dict | None, bool] | None:
        """(the schema, None for any JSON object; whether strict) that ``response_format`` asks
        for, or None for free text. A ``json_schema`` is compiled in OpenAI's strict sense unless
        it says ``strict: false`` (then as written)."""
        if spec is None or spec.get("type") == "text":
            return None
        if spec.get("type") == "json_object":
            return None, True
        if spec.get("type") == "json_schema":
            inner = spec.get("json_schema")
            name = inner.get("name") if isinstance(inner, dict) else None
            if not isinstance(name, str) or not name:
                where = f"{param}.json_schema.name" if param == "response_format" else f"{param}.name"
                raise bad_request(f"{where} is required (the schema's name)", where,
                                  code="missing_required_parameter")
            schema = inner.get("schema") if isinstance(inner, dict) else None
            if not isinstance(schema, dict):
                raise bad_request(f"{param}.json_schema.schema must be a JSON schema object"
                                  if param == "response_format"
                                  else f"{param}.schema must be a JSON schema object",
                                  param)
            return schema, inner.get("strict") is not False
        raise bad_request(f"{param} type {spec.get('type')!r} is not one of text, json_object, "
                          "json_schema", param)

    def _tools(self, tools: list[dict] | None, choice, parallel: bool | None, param: str = "tools",
               parameters_param: str = "tools[{i}].function.parameters"
               ) -> tuple[list[dict[str, Any]] | None, Grammar | None, list[Grammar]]:
        """(the tools the prompt offers, the grammar that enforces a call for ``tool_choice``, each
        tool's call grammar). Every tool's parameters must compile, whatever the ``tool_choice``
        (a 400 naming that tool's ``parameters``), as OpenAI checks them."""
        parallel = True if parallel is None else parallel
        if not tools:
            if choice not in (None, "none"):
                raise bad_request("tool_choice needs tools", "tool_choice")
            return None, None, []
        if not template_supports_tools(self.engine.tokenizer):
            raise bad_request("this model's chat template does not render tools", param)
        names = []
        for i, tool in enumerate(tools):
            fn = tool.get("function") if tool.get("type") == "function" else None
            if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or not fn["name"]:
                raise bad_request('each tool must be {"type": "function", "function": {"name": ..., '
                                  '"parameters": ...}}', f"{param}[{i}]")
            if fn["name"] in names:
                raise bad_request(f"tool name {fn['name']!r} appears twice (tools[{names.index(fn['name'])}] "
                                  "too): a call could not say which one it means", f"{param}[{i}]")
            if fn.get("parameters") is not None and not isinstance(fn["parameters"], dict):
                raise bad_request(f"tool {fn['name']!r}: parameters must be a JSON schema object",
                                  parameters_param.format(i=i))
            names.append(fn["name"])
        calls = [self._grammar(self.grammars.tool_call, tool, parameters_param.format(i=i))
                 for i, tool in enumerate(tools)]
        if choice == "none":
            return None, None, calls
        if choice in (None, "auto"):
            return tools, None, calls
        if choice == "required":
            forced = self._grammar(self.grammars.tool_calls, tools, parallel, "tool_choice", calls)
            return tools, forced, calls
        is_named = isinstance(choice, dict) and choice.get("type") == "function"
        named = choice.get("function") if is_named else None
        if isinstance(named, dict):
            name = named.get("name")
            if name not in names:
                raise bad_request(f"tool_choice names {name!r}, which is not among the tools", "tool_choice")
            return tools, calls[names.index(name)], calls
        raise bad_request('tool_choice must be "none", "auto", "required" or {"type": "function", '
                          '"function": {"name": ...}}', "tool_choice")

    def _max_tokens(self, value: int | None, default: int, param: str) -> int:
        if value is None:
            return min(default, self.limits.max_tokens_limit)
        if value < 1:
            raise bad_request(f"{param} must be >= 1, got {value}", param, code="integer_below_min_value")
        if value > self.limits.max_tokens_limit:
            limit = self.limits.max_tokens_limit
            raise bad_request(f"{param} is {value}; this server allows at most {limit} (mimir serve "
                              "--max-tokens-limit)", param, code="integer_above_max_value")
        return value

    def _budget_error(self, exc: RequestError, prompt_tokens: int, max_tokens: int, param: str, sent: bool,
                      prompt_param: str) -> ApiError:
        """A grammar's shortest reply does not fit the budget: a 400 naming what set the budget —
        the field the client sent, else the model's context (what the prompt leaves of it), the
        server's --max-tokens-limit or the field's default."""
        if sent:
            return bad_request(str(exc).replace("max_new_tokens", param, 1), param,
                               code="integer_below_min_value")
        need = f"{exc.minimum} tokens" if exc.minimum is not None else "more tokens than the context holds"
        shortest = f"fewer than the shortest reply the grammar (response format or tool call) allows: {need}"
        left, limit = self.engine.max_context - prompt_tokens, self.limits.max_tokens_limit
        if left <= max_tokens:
            return bad_request(f"the prompt ({prompt_tokens} tokens) leaves {left} of the model's context of "
                               f"{self.engine.max_context} tokens, {shortest}", prompt_param,
                               code="context_length_exceeded")
        if max_tokens == limit:
            return bad_request(f"this server generates at most {limit} tokens a reply (mimir serve "
                               f"--max-tokens-limit), {shortest}", None, code="max_tokens_limit")
        return bad_request(f"{param} (not sent) defaults to {max_tokens} here, {shortest}", param,
                           code="integer_below_min_value")

    @staticmethod
    def _logit_bias(body: SamplingBody) -> tuple[tuple[int, float], ...]:
        out = []
        for key, bias in (body.logit_bias or {}).items():
            try:
                token = int(key)
            except ValueError:
                raise bad_request(f"logit_bias keys must be token ids, got {key!r}", "logit_bias") from None
            out.append((token, float(bias)))
        return tuple(out)

    def _requests(self, body: SamplingBody, prompts: list[list[int]], max_tokens: int, prompt_param: str,
                  top_logprobs: int, grammar: Grammar | None, budget_param: str = "max_tokens",
                  budget_sent: bool = True) -> list[GenerationRequest]:
        """``n`` requests per prompt (seeds seed, seed + 1, ... in choice order), each checked by
        the engine. A field left out or sent as null takes its default. A budget the client sent
        must fit the context with the prompt (OpenAI's ``context_length_exceeded``)."""
        h, low = self._schedule(body)
        n = body.choices
        if len(prompts) * n > self.limits.max_queue:
            raise bad_request(f"{len(prompts)} prompts x n={n} requests cannot fit the queue of "
                              f"{self.limits.max_queue}", "n")
        stops = (body.stop,) if isinstance(body.stop, str) else tuple(body.stop or ())
        shared = dict(
            max_new_tokens=max_tokens, temperature=_or(body.temperature, 1.0),
            top_k=1 if body.top_p == 0 else max(0, _or(body.top_k, 0)),  # top_p 0: the top token alone
            top_p=_or(body.top_p or None, 1.0), min_p=_or(body.min_p, 0.0), stop_strings=stops,
            use_default_stops=not body.ignore_eos, top_logprobs=top_logprobs,
            frequency_penalty=_or(body.frequency_penalty, 0.0),
            presence_penalty=_or(body.presence_penalty, 0.0),
            repetition_penalty=_or(body.repetition_penalty, 1.0), logit_bias=self._logit_bias(body),
            min_tokens=_or(body.min_tokens, 0), skip_special_tokens=_or(body.skip_special_tokens, True))
        out = []
        for p, prompt in enumerate(prompts):
            where = prompt_param if len(prompts) == 1 else f"{prompt_param}[{p}]"
            for j in range(n):
                seed = None if body.seed is None else body.seed + p * n + j
                request = GenerationRequest(prompt, SamplingParams(seed=seed, **shared), h, low, grammar)
                try:
                    if budget_sent:
                        self.engine.limits.check_fits(len(prompt), max_tokens)
                    self.engine.limits.check_request(request)
                except RequestError as exc:
                    if exc.field == "max_new_tokens":  # the grammar's shortest reply does not fit
                        raise self._budget_error(exc, len(prompt), max_tokens, budget_param, budget_sent,
                                                 where) from exc
                    if exc.field == "prompt":
                        message = str(exc).replace("max_new_tokens", budget_param, 1)
                        raise bad_request(message, where, code=exc.code) from exc
                    raise _api_error(exc) from exc
                out.append(request)
        return out


def _or(value, default):
    """``value``, or ``default`` where the body left it out or sent null."""
    return default if value is None else value
