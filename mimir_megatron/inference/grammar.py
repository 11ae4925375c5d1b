"""Structured output: a grammar per request masks the logits of its row at every decoding step,
and the reply always finishes, well-formed, within the row's token budget.

Built on llguidance (what vLLM and SGLang use; the ``serve`` extra), imported only when a request
asks for a grammar. :class:`Grammars` compiles JSON schemas and tool-call grammars for one
tokenizer; a compiled :class:`Grammar` is shared by a request's ``n`` choices, and each row decodes
with its own :class:`GrammarConstraint` (the per-row state the engine's decoding step consults).

The finishing guarantee. llguidance masks tokens the grammar forbids, but nothing in it bounds a
reply's length: a JSON string may run on until ``max_tokens`` cuts it. So each row keeps a
*completion*: token ids that finish the grammar from the row's current state (close the open
string, give the required keys their smallest values, close the arrays and objects, write the
tool-call end tag), found by :func:`completion` with the matcher itself. The invariant is
``len(completion) <= tokens left``. A token that would break it is refused (the engine chooses
again without it; after a few refusals it takes the completion's next token), and when the
budget left equals the completion, the row follows the completion. A request whose budget is
smaller than the completion from the start is refused before decoding.

The shortest reply from the start (the 400 for a budget below it, a row's first completion) is
searched per branch: each offered tool's call alone, and the answer where a response format
comes with tools (:meth:`Grammars.union`, OpenAI's rule: a tool call or the schema's answer); the
cheapest branch is the grammar's. A branch whose replies are few texts (:func:`finite_texts`:
enums, consts, booleans, bounded integers) is searched exactly (:func:`fewest_tokens`); others
with the greedy :func:`completion`.

Numbers. llguidance's JSON number admits any exponent; a row also refuses a token that would
make the number being written overflow a double or take its exponent past :data:`MAX_EXPONENT`
(and completions never write one), and an ``integer`` without bounds is bounded to
:data:`INTEGER_BOUNDS` in the schema.
"""

from __future__ import annotations

import collections
import copy
import json
import logging
import math
import re
import threading
from typing import Any

import numpy as np
import torch

from mimir_megatron.inference.requests import RequestError
from mimir_megatron.inference.tool_calls import TOOL_CALL_CLOSE, TOOL_CALL_OPEN

log = logging.getLogger(__name__)

# Compact, deterministic JSON (what ``json.dumps`` writes): no free whitespace a model could loop in.
_JSON_STYLE = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
# Keys of a JSON schema whose value is a schema, a list of schemas, or a {name: schema} map.
_SUBSCHEMA = ("items", "additionalProperties", "not", "if", "then", "else", "contains", "propertyNames",
              "additionalItems", "unevaluatedProperties", "unevaluatedItems")
_SUBSCHEMA_LISTS = ("anyOf", "allOf", "oneOf", "prefixItems")
_NEVER = np.iinfo(np.int64).max
COMPILED_GRAMMARS = 256
"""Compiled grammars kept per tokenizer (with their shortest replies), newest first."""
_SUBSCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")


def _llguidance():
    try:
        import llguidance
        import llguidance.hf
    except ImportError as exc:  # an optional extra
        raise RequestError("structured output needs llguidance: pip install 'mimir-megatron[serve]'",
                           "response_format") from exc
    return llguidance


def _rewrite(schema: Any, node) -> Any:
    """A deep copy of ``schema`` with ``node(copy)`` applied to every (sub)schema object, inner
    ones first (``node`` edits the dict it is given)."""
    if not isinstance(schema, dict):
        return schema
    out = {}
    for key, value in schema.items():
        if key in _SUBSCHEMA:
            out[key] = _rewrite(value, node)
        elif key in _SUBSCHEMA_LISTS and isinstance(value, list):
            out[key] = [_rewrite(v, node) for v in value]
        elif key in _SUBSCHEMA_MAPS and isinstance(value, dict):
            out[key] = {name: _rewrite(v, node) for name, v in value.items()}
        else:
            out[key] = copy.deepcopy(value)
    node(out)
    return out


def _has_type(schema: dict, name: str) -> bool:
    kind = schema.get("type")
    return kind == name or (isinstance(kind, list) and name in kind)


def strict_schema(schema: Any) -> Any:
    """The schema in OpenAI's strict sense: every object schema that does not say otherwise gets
    ``additionalProperties: false`` (no keys beyond its ``properties``), at every depth."""
    def strict(out: dict) -> None:
        is_object = _has_type(out, "object") or "properties" in out
        if is_object and "additionalProperties" not in out and "patternProperties" not in out:
            out["additionalProperties"] = False

    return _rewrite(schema, strict)


def bounded_integers(schema: Any) -> Any:
    """The schema with every ``integer`` that has no bound of its own on a side bounded there by
    :data:`INTEGER_BOUNDS` (exact in every JSON parser, within every typed client's int64)."""
    def bound(out: dict) -> None:
        if _has_type(out, "integer"):
            if "minimum" not in out and "exclusiveMinimum" not in out:
                out["minimum"] = INTEGER_BOUNDS[0]
            if "maximum" not in out and "exclusiveMaximum" not in out:
                out["maximum"] = INTEGER_BOUNDS[1]

    return _rewrite(schema, bound)


_NUMBER_START = frozenset(b"-0123456789")
_NUMBER_BYTES = frozenset(b"-+.eE0123456789")
MAX_EXPONENT = 308
"""A JSON number's exponent is at most this in magnitude (a double's largest decimal exponent)."""
INTEGER_BOUNDS = (-(2**53 - 1), 2**53 - 1)
"""An ``integer`` schema without a bound of its own is bounded to the integers every JSON parser
reads exactly (a double's, JavaScript's safe integers, I-JSON's; llguidance's range compiler
takes its bounds as doubles, so a 64-bit bound itself cannot be compiled exactly)."""


def finite_number_prefix(text: str) -> bool:
    """Whether a JSON number written so far (``-``, ``1.``, ``2e``, ``1e30``, ...) is still a
    finite double with an exponent of at most :data:`MAX_EXPONENT` in magnitude."""
    mantissa, _, exponent = text.lower().partition("e")
    digits = exponent.lstrip("+-")
    if digits and int(digits) > MAX_EXPONENT:
        return False
    mantissa = mantissa.rstrip(".")
    if mantissa in ("", "-"):
        return True
    sign = exponent[:1] if exponent[:1] in ("+", "-") else ""
    return math.isfinite(float(f"{mantissa}e{sign}{digits}" if digits else mantissa))


class _JsonLexState:
    """Whether the bytes so far end inside a JSON string (the completion search prefers ``"``
    there, and closers ``}`` / ``]`` outside, where inside a string they would be content), and
    the number being written, if any (a row refuses a token that would make it overflow)."""

    __slots__ = ("in_string", "escape", "number")

    def __init__(self) -> None:
        self.in_string, self.escape = False, False
        self.number: bytearray | None = None

    def copy(self) -> "_JsonLexState":
        out = _JsonLexState()
        out.in_string, out.escape = self.in_string, self.escape
        out.number = None if self.number is None else bytearray(self.number)
        return out

    def feed(self, data: bytes) -> None:
        for byte in data:
            if self.escape:
                self.escape = False
            elif self.in_string and byte == 0x5C:  # backslash
                self.escape = True
            elif byte == 0x22:  # double quote
                self.in_string = not self.in_string
                self.number = None
            elif self.in_string:
                continue
            elif self.number is not None and byte in _NUMBER_BYTES:
                self.number.append(byte)
            else:  # outside strings a number starts with - or a digit (true/false/null have none)
                self.number = bytearray([byte]) if byte in _NUMBER_START else None

    @property
    def finite(self) -> bool:
        """The number being written (if any) is still finite, its exponent bounded."""
        return self.number is None or finite_number_prefix(self.number.decode("ascii"))


class Vocabulary:
    """One tokenizer's tokens as the completion search ranks them (built once per tokenizer)."""

    def __init__(self, lltokenizer, vocab_size: int, stop_ids: tuple[int, ...]) -> None:
        self.size = vocab_size
        self.stop_ids = tuple(stop_ids)
        self.bytes = [b"" if lltokenizer.is_special_token(i) else lltokenizer.decode_bytes([i])
                      for i in range(vocab_size)]
        lengths = np.array([len(b) if b else 1 << 20 for b in self.bytes])
        ids = np.arange(vocab_size)

        def ranks(first: list[int]) -> np.ndarray:
            """rank[token]: the preferred tokens in ``first`` order, then every other token,
            shortest text first (lowest rank is chosen)."""
            rank = lengths.astype(np.int64) * vocab_size + ids + len(first) + 1
            for r, token in enumerate(first):
                rank[token] = r
            return rank

        def matching(predicate) -> list[int]:
            found = [i for i, b in enumerate(self.bytes) if b and predicate(b)]
            return sorted(found, key=lambda i: (-len(self.bytes[i]), i))  # longest first

        closes_string = matching(lambda b: b[:1] == b'"' and all(c in b'}]' for c in b[1:]))
        closers = matching(lambda b: all(c in b'}]' for c in b))
        small_values = [b for b in (b"0", b"1", b'""', b"[]", b"{}", b"2", b"3", b"4", b"5", b"6", b"7",
                                    b"8", b"9", b'"', b"[", b"{", b"null", b"true", b"false", b"n", b"t",
                                    b"f", b"-")]
        by_bytes: dict[bytes, int] = {}
        for i, b in enumerate(self.bytes):
            if b:
                by_bytes.setdefault(b, i)
        self.ids_by_bytes = by_bytes
        """A token id for each token text (special tokens, which have none, left out)."""
        self.longest = max(map(len, by_bytes), default=1)
        values = [by_bytes[b] for b in small_values if b in by_bytes]
        separators = [by_bytes[b] for b in (b",", b", ") if b in by_bytes]
        self.rank_in_string = ranks(closes_string)
        self.rank_outside = ranks(closers + separators + values)


def _finite_after(lex: _JsonLexState, data: bytes) -> bool:
    """Whether the number being written stays finite (:attr:`_JsonLexState.finite`) after ``data``."""
    if lex.in_string or (lex.number is None and not any(b in _NUMBER_START for b in data)):
        return True
    after = lex.copy()
    after.feed(data)
    return after.finite


def _allowed_bits(matcher, size: int) -> np.ndarray:
    """``[size]`` uint8: 1 where the grammar allows the token next."""
    return np.unpackbits(np.frombuffer(matcher.compute_bitmask(), dtype=np.uint8), bitorder="little")[:size]


def completion(matcher, lex: _JsonLexState, vocab: Vocabulary, limit: int) -> list[int] | None:
    """Token ids that finish the grammar from ``matcher``'s state (the last one a stop id when
    the grammar ends by one), at most ``limit`` of them; None when none is found within it.

    Greedy with the grammar's own mask: forced tokens as llguidance computes them; a stop token
    as soon as the grammar accepts; else the allowed token ranked first: inside a string, one that
    closes it (``"``, ``"}``, ...); outside, closers (``}}``, ``]``), then a separator, then the
    smallest values (``0``, ``""``, ``[]``, ``{}``, ...). This is the shortest completion for
    strings, numbers, booleans, null, arrays and objects (optional keys are left out, required
    ones get the smallest value); where an enum or ``anyOf`` offers several branches it takes the
    first by the same ranking, so the length is an upper bound there."""
    m, lex, path = matcher.deep_copy(), lex.copy(), []
    while len(path) <= limit:
        if m.is_error():
            return None
        if m.is_stopped():
            return path
        forced = m.compute_ff_tokens()
        if forced:
            if not m.consume_tokens(forced):
                return None
            for t in forced:
                lex.feed(vocab.bytes[t])
            path += forced
            continue
        bits = _allowed_bits(m, vocab.size)
        stops = [s for s in vocab.stop_ids if s < len(bits) and bits[s]]
        if stops:
            return path + [stops[0]] if len(path) < limit else None
        if not bits.any():
            return None
        rank = vocab.rank_in_string if lex.in_string else vocab.rank_outside
        token = int(np.where(bits, rank, _NEVER).argmin())
        while not _finite_after(lex, vocab.bytes[token]):  # a number must not overflow on the way
            bits[token] = 0
            if not bits.any():
                return None
            token = int(np.where(bits, rank, _NEVER).argmin())
        if not m.consume_token(token):
            return None
        lex.feed(vocab.bytes[token])
        path.append(token)
    return None


_ANNOTATIONS = frozenset({"description", "title", "default", "examples", "$comment", "deprecated", "readOnly",
                          "writeOnly", "x-guidance"})
_JSON_TYPES = {"null": (type(None),), "boolean": (bool,), "integer": (int,), "number": (int, float),
               "string": (str,), "array": (list,), "object": (dict,)}
FINITE_TEXTS = 64
"""A grammar whose replies are at most this many texts is searched exactly (every text's fewest
tokens); above it, or where a schema admits unboundedly many, the greedy :func:`completion`."""


def _written(value: Any) -> str:
    """A JSON value as the grammar writes it (compact: ``", "`` and ``": "``)."""
    return json.dumps(value, ensure_ascii=False, separators=(_JSON_STYLE["item_separator"],
                                                              _JSON_STYLE["key_separator"]))


def _of_type(value: Any, kinds: list[str]) -> bool:
    if isinstance(value, bool) and "boolean" not in kinds:
        return False
    return any(isinstance(value, _JSON_TYPES.get(kind, ())) for kind in kinds)


def finite_texts(schema: Any, limit: int = FINITE_TEXTS) -> list[str] | None:
    """Every JSON text valid under ``schema`` as the grammar writes it (compact, an object's
    properties in their order, optional ones present or not), when there are at most ``limit``
    and the schema says only what this reads (``const``, ``enum``, ``anyOf`` / ``oneOf``, null,
    booleans, bounded integers, objects without other keys); else None (strings, numbers and
    arrays admit unboundedly many)."""
    if not isinstance(schema, dict):
        return None
    keys = set(schema) - _ANNOTATIONS
    kinds = schema.get("type")
    kinds = [kinds] if isinstance(kinds, str) else kinds
    if "const" in schema or "enum" in schema:
        if keys - {"const", "enum", "type"} or (kinds is not None and not isinstance(kinds, list)):
            return None
        values = [schema["const"]] if "const" in schema else schema["enum"]
        if not isinstance(values, list):
            return None
        texts = list(dict.fromkeys(_written(v) for v in values if kinds is None or _of_type(v, kinds)))
        return texts if len(texts) <= limit else None
    for union in ("anyOf", "oneOf"):
        if union in schema:
            if keys != {union} or not isinstance(schema[union], list):
                return None
            texts = []
            for branch in schema[union]:
                found = finite_texts(branch, limit)
                if found is None:
                    return None
                texts = list(dict.fromkeys(texts + found))
                if len(texts) > limit:
                    return None
            return texts
    if not isinstance(kinds, list):
        return None
    texts = []
    for kind in kinds:
        found = _finite_of_type(schema, kind, keys - {"type"}, limit)
        if found is None:
            return None
        texts = list(dict.fromkeys(texts + found))
    return texts if len(texts) <= limit else None


def _finite_of_type(schema: dict, kind: str, keys: set[str], limit: int) -> list[str] | None:
    if kind in ("null", "boolean") and not keys:
        return ["null"] if kind == "null" else ["true", "false"]
    if kind == "integer" and keys <= {"minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum"}:
        lows = [math.ceil(schema["minimum"])] if "minimum" in schema else []
        lows += [math.floor(schema["exclusiveMinimum"]) + 1] if "exclusiveMinimum" in schema else []
        highs = [math.floor(schema["maximum"])] if "maximum" in schema else []
        highs += [math.ceil(schema["exclusiveMaximum"]) - 1] if "exclusiveMaximum" in schema else []
        if not lows or not highs or max(highs) - max(lows) + 1 > limit:
            return None
        return [str(i) for i in range(max(lows), min(highs) + 1)]
    if kind == "object" and keys <= {"properties", "required", "additionalProperties"}:
        properties = schema.get("properties", {})
        required = schema.get("required", [])
        if schema.get("additionalProperties", True) is not False or not isinstance(properties, dict) \
                or not set(required) <= set(properties):
            return None
        members: list[list[str]] = [[]]  # each: the members written so far
        for name, sub in properties.items():
            values = finite_texts(sub, limit)
            if values is None:
                return None
            written = [f"{_written(name)}{_JSON_STYLE['key_separator']}{v}" for v in values]
            members = [m + [w] for m in members for w in written] + ([] if name in required else members)
            if len(members) > limit:
                return None
        return ["{" + _JSON_STYLE["item_separator"].join(m) + "}" for m in members]
    return None


def fewest_tokens(texts: list[str], vocab: Vocabulary) -> list[int] | None:
    """The token ids that write one of ``texts`` in the fewest tokens (a shortest path over the
    text's positions, a token an edge), or None when no text can be written with the vocabulary.
    Texts are taken in sorted order, each reusing the positions it shares with the previous one."""
    best_path: list[int] | None = None
    previous, cost, back = b"", [0], [None]
    for data in sorted(t.encode() for t in texts):
        shared = next((i for i, (a, b) in enumerate(zip(previous, data)) if a != b),
                      min(len(previous), len(data)))
        # positions up to ``shared`` are the previous text's; later ones are reached anew, from
        # positions up to a token's length before them
        fresh = [None] * (len(data) - shared)
        cost, back = cost[:shared + 1] + fresh, back[:shared + 1] + fresh
        for i in range(max(0, shared - vocab.longest + 1), len(data)):
            if cost[i] is None:
                continue
            for j in range(max(i + 1, shared + 1), min(len(data), i + vocab.longest) + 1):
                token = vocab.ids_by_bytes.get(data[i:j])
                if token is not None and (cost[j] is None or cost[i] + 1 < cost[j]):
                    cost[j], back[j] = cost[i] + 1, (i, token)
        previous = data
        if cost[-1] is not None and (best_path is None or cost[-1] < len(best_path)):
            path, at = [], len(data)
            while at:
                at, token = back[at]
                path.append(token)
            best_path = path[::-1]
    return best_path


def _finished(matcher, path: list[int], vocab: Vocabulary) -> list[int] | None:
    """``path`` (and a stop token where the grammar ends by one) when it is a whole reply of the
    grammar from ``matcher``'s state (which it consumes); None when it is not."""
    if matcher.validate_tokens(path) < len(path) or not matcher.consume_tokens(path) or matcher.is_error():
        return None
    if matcher.is_stopped():
        return path
    bits = _allowed_bits(matcher, vocab.size)
    stops = [t for t in vocab.stop_ids if t < len(bits) and bits[t]]
    return path + [stops[0]] if stops else None


class GrammarConstraint:
    """One row's grammar state: which tokens may come next, the tokens taken so far, and a
    completion that fits the tokens left (see the module docstring)."""

    def __init__(self, matcher, vocab: Vocabulary, budget: int, finish: list[int]) -> None:
        self._matcher = matcher
        self._vocab = vocab
        self._lex = _JsonLexState()
        self.budget = budget
        """Tokens this row may still generate."""
        self.finish = list(finish)
        """Token ids that finish the grammar from here; ``len(finish) <= budget`` always."""

    def allowed(self, out: torch.Tensor) -> None:
        """Fill a ``[vocab]`` bool row with the tokens the grammar allows next (only the
        completion's next token when the budget left is the completion's length)."""
        if self.finish and len(self.finish) >= self.budget:
            out.zero_()
            out[self.finish[0]] = True
            return
        bias = torch.frombuffer(bytearray(self._matcher.compute_logit_bias()), dtype=torch.uint8)
        n = min(len(bias), self._vocab.size, len(out))
        out.zero_()
        out[:n] = bias[:n] > 0
        if not out.any():  # the matcher failed (never expected): let the row end instead of the batch
            log.warning("grammar admits no token (%s); ending the row", self._matcher.get_error())
            out.fill_(True)

    @property
    def fallback(self) -> int | None:
        """A token that is always accepted: the completion's next one."""
        return self.finish[0] if self.finish else None

    def accept(self, token: int) -> bool:
        """Take ``token``; or refuse it (False, the state unchanged) when the reply could no
        longer finish within the budget left after it."""
        vocab, left = self._vocab, self.budget - 1
        if self.finish and token == self.finish[0]:
            self._take(token)
            self.finish = self.finish[1:]
            return True
        if not _finite_after(self._lex, vocab.bytes[token]):  # a number would overflow (or its exponent)
            return False
        lex = self._lex.copy()
        if not self._matcher.consume_token(token):
            self.budget = left  # the mask allowed it, so never expected: the row ends as done
            return True
        self._lex.feed(vocab.bytes[token])
        if self._matcher.is_stopped():
            self.budget, self.finish = left, []
            return True
        finish = self.finish if self.finish and self._still_finishes(self.finish) else None
        if finish is not None and not self._finite_along(finish):
            finish = None
        if finish is None or len(finish) > left:
            finish = completion(self._matcher, self._lex, vocab, left)
        if finish is None or len(finish) > left:
            self._matcher.rollback(1)
            self._lex = lex
            return False
        self.budget, self.finish = left, finish
        return True

    def _take(self, token: int) -> None:
        self._matcher.consume_token(token)
        self._lex.feed(self._vocab.bytes[token])
        self.budget -= 1

    def _finite_along(self, tokens: list[int]) -> bool:
        """Whether the number being written (if any) stays finite while ``tokens`` are written
        from here (the numbers they start were checked when they were found)."""
        lex = self._lex.copy()
        for token in tokens:
            if lex.number is None:
                return True
            if not _finite_after(lex, self._vocab.bytes[token]):
                return False
            lex.feed(self._vocab.bytes[token])
        return True

    def _still_finishes(self, tokens: list[int]) -> bool:
        """Whether ``tokens`` (the completion before the last token) still finish the grammar."""
        if self._matcher.validate_tokens(tokens) < len(tokens):  # checked first: no error state, no log
            return False
        m = self._matcher.deep_copy()
        return m.consume_tokens(tokens) and m.is_stopped() and not m.is_error()

    @property
    def done(self) -> bool:
        """The grammar is complete and admits nothing more (or has failed)."""
        return self._matcher.is_stopped() or self._matcher.is_error()


class Grammar:
    """A compiled grammar; :meth:`start` gives a fresh per-row state."""

    def __init__(self, lib, tokenizer, text: str, vocab: Vocabulary,
                 branches: tuple["Grammar", ...] = (), texts: list[str] | None = None) -> None:
        self._lib, self._tokenizer, self.text, self._vocab = lib, tokenizer, text, vocab
        self.branches = branches
        """For a union: its alternatives compiled alone (the shortest reply is the shortest of theirs)."""
        self.texts = texts
        """Every reply's text, where they are few (:func:`finite_texts`): searched exactly."""
        self._shortest: list[int] | None = None
        self._searched_to = -1
        self._searching = threading.Lock()
        """The requests that send this grammar share it (worker threads): one search at a time."""

    def shortest(self, budget: int) -> list[int] | None:
        """The shortest reply from the grammar's start as far as it is known (None: none within
        ``budget`` tokens): the shortest of the branches' for a union, exact where the replies
        are few texts, else the greedy :func:`completion` (an upper bound where an enum or
        ``anyOf`` inside an unbounded value offers branches)."""
        with self._searching:
            return self._search(budget)

    def _search(self, budget: int) -> list[int] | None:
        if self.branches and self._shortest is None and budget > self._searched_to:
            # each alternative searched alone (the greedy search would follow one only), its reply
            # then ended as this grammar ends one
            found = [self._as_whole(b.shortest(budget + 1)) for b in self.branches]
            self._shortest = min((f for f in found if f is not None), key=len, default=None)
            self._searched_to = budget
        elif self._shortest is None and self.texts is not None and self._searched_to < 0:
            path = fewest_tokens(self.texts, self._vocab)
            matcher = self._lib.LLMatcher(self._tokenizer, self.text)
            self._shortest = None if path is None else _finished(matcher, path, self._vocab)
            if self._shortest is None:
                log.warning("the exact search found no reply the grammar accepts; searching greedily")
            self._searched_to = 0
        if self._shortest is None and budget > self._searched_to and not self.branches:
            matcher = self._lib.LLMatcher(self._tokenizer, self.text)
            self._shortest = completion(matcher, _JsonLexState(), self._vocab, budget)
            self._searched_to = budget
        if self._shortest is not None and len(self._shortest) <= budget:
            return self._shortest
        return None

    def _as_whole(self, path: list[int] | None) -> list[int] | None:
        """A branch's reply as a reply of this grammar: where the branch ends by itself (``call``)
        and this one may go on (``call+``), a stop token ends it."""
        if path is None:
            return None
        if path and path[-1] in self._vocab.stop_ids:
            path = path[:-1]
        return _finished(self._lib.LLMatcher(self._tokenizer, self.text), path, self._vocab)

    def min_tokens(self, budget: int) -> int | None:
        """Tokens the shortest reply takes (None: more than ``budget``)."""
        found = self.shortest(budget)
        return None if found is None else len(found)

    def start(self, budget: int) -> GrammarConstraint:
        """A fresh row state for a row that may generate ``budget`` tokens."""
        finish = self.shortest(budget) or []
        return GrammarConstraint(self._lib.LLMatcher(self._tokenizer, self.text), self._vocab, budget, finish)


class Grammars:
    """Compiles grammars for one tokenizer (built on first use: about a second)."""

    def __init__(self, tokenizer, vocab_size: int, stop_ids: tuple[int, ...]) -> None:
        self._hf_tokenizer, self.vocab_size, self.stop_ids = tokenizer, vocab_size, stop_ids
        self._built: tuple[Any, Vocabulary] | None = None
        """(llguidance's tokenizer, its :class:`Vocabulary`), published together once both exist."""
        self._building = threading.Lock()
        self._compiled: collections.OrderedDict[str, Grammar] = collections.OrderedDict()
        """The newest :data:`COMPILED_GRAMMARS` grammars, by their text."""

    def _tokenizer_and_vocab(self, lib) -> tuple[Any, Vocabulary]:
        """Built once, on the first grammar: the server's worker threads compile concurrently, and
        a thread must never see the tokenizer without its vocabulary (one lock, one assignment)."""
        built = self._built
        if built is None:
            with self._building:
                built = self._built
                if built is None:
                    tokenizer = lib.hf.from_tokenizer(self._hf_tokenizer, n_vocab=self.vocab_size,
                                                      eos_token=list(self.stop_ids) or None)
                    built = self._built = (tokenizer, Vocabulary(tokenizer, self.vocab_size, self.stop_ids))
        return built

    def _compile(self, text: str, field: str, branches: tuple[Grammar, ...] = (),
                 texts: list[str] | None = None) -> Grammar:
        """The grammar of ``text`` (compiled once: agents send the same tools every turn, and a
        compiled grammar keeps its shortest reply)."""
        with self._building:
            cached = self._compiled.get(text)
            if cached is not None:
                self._compiled.move_to_end(text)
                return cached
        lib = _llguidance()
        if self._hf_tokenizer is None:
            raise RequestError("structured output needs the model's tokenizer", field)
        tokenizer, vocab = self._tokenizer_and_vocab(lib)
        failed, messages = lib.LLMatcher.validate_grammar_with_warnings(text, tokenizer)
        if failed:
            raise RequestError(f"{field} cannot be compiled: {_first_line(messages[0])}", field)
        grammar = Grammar(lib, tokenizer, text, vocab, branches, texts)
        with self._building:
            self._compiled[text] = grammar
            while len(self._compiled) > COMPILED_GRAMMARS:
                self._compiled.popitem(last=False)
        return grammar

    def json(self, schema: dict[str, Any] | None, field: str = "response_format",
             strict: bool = True) -> Grammar:
        """Any JSON object (``schema`` None), or JSON valid under ``schema`` (``strict``: in
        OpenAI's strict sense, :func:`strict_schema`; else as written, JSON Schema's defaults)."""
        lib = _llguidance()
        answer = self._answer_schema(schema, strict)
        try:
            text = lib.LLMatcher.grammar_from_json_schema(answer, defaults=_JSON_STYLE)
        except Exception as exc:  # noqa: BLE001 - the library's own message names the problem
            raise RequestError(f"{field} cannot be compiled: {_first_line(str(exc))}", field) from exc
        return self._compile(text, field, texts=finite_texts(answer))

    def tool_call(self, tool: dict[str, Any], field: str = "tools") -> Grammar:
        """One call of ``tool``, in the chat template's syntax: ``<tool_call>{"name": ...,
        "arguments": {...}}</tool_call>``, its parameters in OpenAI's strict sense unless the tool
        says ``strict: false``. Every tool offered must compile (a 400 naming ``field``, whatever
        the ``tool_choice``); a grammar that offers several tools has their calls as branches."""
        call = self._call_schema(tool)
        texts = finite_texts(call)
        if texts is not None:
            texts = [f"{TOOL_CALL_OPEN}{t}{TOOL_CALL_CLOSE}" for t in texts]
        lark = f"start: call\ncall: {self._call_rule([call])}\n"
        try:
            return self._compile(self._lark(lark, field), field, texts=texts)
        except RequestError as exc:
            raise RequestError(f"tool {call['properties']['name']['const']!r}: {exc}", field) from exc

    def tool_calls(self, tools: list[dict[str, Any]], parallel: bool, field: str = "tool_choice",
                   calls: list[Grammar] | None = None) -> Grammar:
        """One call (or, ``parallel``, one or more) of the given tools. Its shortest reply is the
        cheapest tool's call (``calls``: the tools' :meth:`tool_call` grammars, when compiled already)."""
        calls = calls if calls is not None else [self.tool_call(t, field) for t in tools]
        if len(calls) == 1 and not parallel:
            return calls[0]
        schemas = [self._call_schema(t) for t in tools]
        lark = f"start: call{'+' if parallel else ''}\ncall: {self._call_rule(schemas)}\n"
        return self._compile(self._lark(lark, field), field, branches=tuple(calls))

    def union(self, tools: list[dict[str, Any]], parallel: bool, schema: dict[str, Any] | None,
              strict: bool = True, tools_field: str = "tools", field: str = "response_format",
              calls: list[Grammar] | None = None) -> Grammar:
        """Tools and a response format together, as OpenAI defines them: one call (or, ``parallel``,
        one or more) of the tools as :meth:`tool_calls` writes them, or a final answer as
        :meth:`json` writes it. Its shortest reply is the shortest of the tools' calls and the answer."""
        calls = calls if calls is not None else [self.tool_call(t, tools_field) for t in tools]
        branches = (*calls, self.json(schema, field, strict))
        answer = {**self._answer_schema(schema, strict), "x-guidance": _JSON_STYLE}
        schemas = [self._call_schema(t) for t in tools]
        lark = (f"start: call{'+' if parallel else ''} | answer\ncall: {self._call_rule(schemas)}\n"
                f"answer: %json {json.dumps(answer)}\n")
        return self._compile(self._lark(lark, field), field, branches=branches)

    @staticmethod
    def _lark(lark: str, field: str) -> str:
        try:
            return _llguidance().LLMatcher.grammar_from_lark(lark)
        except Exception as exc:  # noqa: BLE001 - the library's own message names the problem
            raise RequestError(f"{field} cannot be compiled: {_first_line(str(exc))}", field) from exc

    @staticmethod
    def _answer_schema(schema: dict[str, Any] | None, strict: bool) -> dict[str, Any]:
        if schema is None:
            return {"type": "object"}
        return bounded_integers(strict_schema(schema) if strict else schema)

    @staticmethod
    def _call_schema(tool: dict[str, Any]) -> dict[str, Any]:
        """The JSON schema of one call of ``tool``: its name, and its parameters as compiled."""
        fn = tool.get("function", tool)
        parameters = fn.get("parameters") or {"type": "object", "properties": {}}
        if fn.get("strict") is not False:
            parameters = strict_schema(parameters)
        parameters = bounded_integers(parameters)
        return {"type": "object", "additionalProperties": False, "required": ["name", "arguments"],
                "properties": {"name": {"const": fn["name"]}, "arguments": parameters}}

    @staticmethod
    def _call_rule(calls: list[dict[str, Any]]) -> str:
        """The lark rule of one call matching any of the call schemas ``calls``."""
        schema = {**(calls[0] if len(calls) == 1 else {"anyOf": calls}), "x-guidance": _JSON_STYLE}
        return f"{json.dumps(TOOL_CALL_OPEN)} %json {json.dumps(schema)} {json.dumps(TOOL_CALL_CLOSE)}"


def _first_line(message: str) -> str:
    """A library's error message as one line (llguidance's add the grammar's source, numbered)."""
    line = message.strip().splitlines()[0] if message.strip() else message
    return re.sub(r"^at \d+\(\d+\): ", "", line)
