"""Structured output: a grammar per request masks the logits of its row at every decoding step.

Built on llguidance (what vLLM and SGLang use; the ``serve`` extra), imported only when a request
asks for a grammar. :class:`Grammars` compiles JSON schemas and tool-call grammars for one
tokenizer; a compiled :class:`Grammar` is shared by a request's ``n`` choices, and each row decodes
with its own :class:`GrammarConstraint` (the per-row state the engine's decoding step consults).
"""

from __future__ import annotations

import json
import logging
from typing import Any

import torch

from mimir_megatron.inference.engine import RequestError
from mimir_megatron.inference.tool_calls import TOOL_CALL_CLOSE, TOOL_CALL_OPEN
log = logging.getLogger(__name__)

# Compact, deterministic JSON (what ``json.dumps`` writes): no free whitespace a model could loop in.
_JSON_STYLE = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


def _llguidance():
    try:
        import llguidance
        import llguidance.hf
    except ImportError as exc:  # an optional extra
        raise RequestError("structured output needs llguidance: pip install 'mimir-megatron[serve]'",
                           "response_format") from exc
    return llguidance


class GrammarConstraint:
    """One row's grammar state: which tokens may come next, and the tokens taken so far."""

    def __init__(self, matcher, vocab_size: int) -> None:
        self._matcher = matcher
        self._vocab_size = vocab_size

    def allowed(self, out: torch.Tensor) -> None:
        """Fill a ``[vocab]`` bool row with the tokens the grammar allows next."""
        bias = torch.frombuffer(bytearray(self._matcher.compute_logit_bias()), dtype=torch.uint8)
        n = min(len(bias), self._vocab_size)
        out.zero_()
        out[:n] = bias[:n] > 0
        if not out.any():  # the matcher failed (never expected): let the row end instead of the batch
            log.warning("grammar admits no token (%s); ending the row", self._matcher.get_error())
            out.fill_(True)

    def accept(self, token: int) -> None:
        self._matcher.consume_token(token)

    @property
    def done(self) -> bool:
        """The grammar is complete and admits nothing more (or has failed)."""
        return self._matcher.is_stopped() or self._matcher.is_error()


class Grammar:
    """A compiled grammar; :meth:`start` gives a fresh per-row state."""

    def __init__(self, lib, tokenizer, text: str, vocab_size: int) -> None:
        self._lib, self._tokenizer, self.text, self._vocab_size = lib, tokenizer, text, vocab_size

    def start(self) -> GrammarConstraint:
        return GrammarConstraint(self._lib.LLMatcher(self._tokenizer, self.text), self._vocab_size)


class Grammars:
    """Compiles grammars for one tokenizer (built on first use: about a second)."""

    def __init__(self, tokenizer, vocab_size: int, stop_ids: tuple[int, ...]) -> None:
        self._hf_tokenizer, self.vocab_size, self.stop_ids = tokenizer, vocab_size, stop_ids
        self._tokenizer = None

    def _compile(self, text: str, field: str) -> Grammar:
        lib = _llguidance()
        if self._hf_tokenizer is None:
            raise RequestError("structured output needs the model's tokenizer", field)
        if self._tokenizer is None:
            self._tokenizer = lib.hf.from_tokenizer(self._hf_tokenizer, n_vocab=self.vocab_size,
                                                    eos_token=list(self.stop_ids) or None)
        failed, messages = lib.LLMatcher.validate_grammar_with_warnings(text, self._tokenizer)
        if failed:
            raise RequestError(f"{field} cannot be compiled: {messages[0]}", field)
        return Grammar(lib, self._tokenizer, text, self.vocab_size)

    def json(self, schema: dict[str, Any] | None, field: str = "response_format") -> Grammar:
        """Any JSON object (``schema`` None), or JSON valid under ``schema``."""
        lib = _llguidance()
        try:
            text = lib.LLMatcher.grammar_from_json_schema(
                {"type": "object"} if schema is None else schema, defaults=_JSON_STYLE)
        except Exception as exc:  # noqa: BLE001 - the library's own message names the problem
            raise RequestError(f"{field} cannot be compiled: {exc}", field) from exc
        return self._compile(text, field)

    def tool_calls(self, tools: list[dict[str, Any]], parallel: bool, field: str = "tool_choice") -> Grammar:
        """One call (or, ``parallel``, one or more) of the given tools, in the chat template's
        syntax: ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``."""
        calls = []
        for tool in tools:
            fn = tool.get("function", tool)
            calls.append({"type": "object", "additionalProperties": False, "required": ["name", "arguments"],
                          "properties": {"name": {"const": fn["name"]},
                                         "arguments": fn.get("parameters") or {"type": "object"}}})
        schema = {**(calls[0] if len(calls) == 1 else {"anyOf": calls}), "x-guidance": _JSON_STYLE}
        repeat = "+" if parallel else ""
        call = f"{json.dumps(TOOL_CALL_OPEN)} %json {json.dumps(schema)} {json.dumps(TOOL_CALL_CLOSE)}"
        lark = f"start: call{repeat}\ncall: {call}\n"
        return self._compile(_llguidance().LLMatcher.grammar_from_lark(lark), field)
