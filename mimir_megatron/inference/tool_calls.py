"""The chat template's tool-call syntax, read back from generated text into OpenAI ``tool_calls``.

The project's templates (the demo tokenizer under ``data_prep/``, what ``mimir prepare`` trains on)
write each call of an assistant turn as ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``
after the turn's text. A call whose JSON does not parse stays in the content as text (the client
sees what the model wrote), as vLLM's parsers do. A call's ``arguments`` are the text the model
wrote (OpenAI's), so that a stream's argument deltas (:class:`ToolCallStream`) add up to them.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass

TOOL_CALL_OPEN, TOOL_CALL_CLOSE = "<tool_call>", "</tool_call>"
_CALL = re.compile(re.escape(TOOL_CALL_OPEN) + r"(.*?)" + re.escape(TOOL_CALL_CLOSE), re.S)


@dataclass
class ToolCall:
    name: str
    arguments: str
    """A JSON string, as OpenAI sends it."""
    id: str = ""

    def __post_init__(self) -> None:
        self.id = self.id or f"call_{uuid.uuid4().hex[:24]}"

    def as_dict(self) -> dict:
        function = {"name": self.name, "arguments": self.arguments}
        return {"id": self.id, "type": "function", "function": function}


def _members(payload: str) -> dict[str, tuple[object, str]] | None:
    """The members of the JSON object ``payload`` as {key: (value, the value's text as written)};
    None when it is not one object."""
    decoder, space = json.JSONDecoder(), re.compile(r"\s*")
    at = space.match(payload, 0).end()
    if payload[at:at + 1] != "{":
        return None
    members: dict[str, tuple[object, str]] = {}
    at = space.match(payload, at + 1).end()
    try:
        while payload[at:at + 1] != "}":
            if members:
                if payload[at:at + 1] != ",":
                    return None
                at = space.match(payload, at + 1).end()
            key, at = decoder.raw_decode(payload, at)
            at = space.match(payload, at).end()
            if not isinstance(key, str) or payload[at:at + 1] != ":":
                return None
            start = space.match(payload, at + 1).end()
            value, at = decoder.raw_decode(payload, start)
            members[key] = (value, payload[start:at])
            at = space.match(payload, at).end()
    except (json.JSONDecodeError, IndexError):
        return None
    return members if not payload[at + 1:].strip() else None


def _call(payload: str) -> ToolCall | None:
    """A call from its JSON; ``arguments`` as the model wrote them (what a stream sent, delta by
    delta), or the content of a JSON string that holds them."""
    members = _members(payload)
    if members is None or not isinstance(members.get("name", (None,))[0], str) or not members["name"][0]:
        return None
    arguments, written = members.get("arguments", ({}, "{}"))
    if isinstance(arguments, str):  # already a JSON string: keep it if it parses
        try:
            json.loads(arguments)
        except json.JSONDecodeError:
            return None
        return ToolCall(members["name"][0], arguments)
    if not isinstance(arguments, dict):
        return None
    return ToolCall(members["name"][0], written)


def parse_tool_calls(text: str) -> tuple[str | None, list[ToolCall]]:
    """(content without the well-formed calls, or None when nothing else is left; the calls)."""
    calls: list[ToolCall] = []
    kept: list[str] = []
    at = 0
    for match in _CALL.finditer(text):
        call = _call(match.group(1).strip())
        if call is None:
            continue  # malformed: stays in the content
        kept.append(text[at:match.start()])
        at = match.end()
        calls.append(call)
    kept.append(text[at:])
    content = "".join(kept)
    if calls:
        content = content.strip()
    return (content or None) if calls else text, calls


@dataclass
class CallDelta:
    """A piece of a streamed call: its first delta carries the id and the name (``first``), the
    others more of the arguments; ``done`` when the call is complete (``call.arguments`` whole)."""

    index: int
    """The call's position among the reply's calls."""
    call: ToolCall
    arguments: str = ""
    """The text of the arguments this delta adds (the deltas of a call concatenate to its arguments)."""
    first: bool = False
    done: bool = False


# The start of a call as a grammar writes it, up to where its arguments (an object) begin.
_CALL_HEAD = re.compile(r'\s*\{\s*"name"\s*:\s*("(?:[^"\\]|\\.)*")\s*,\s*"arguments"\s*:\s*(?=\{)')
_CALL_TAIL = re.compile(r"\s*\}\s*" + re.escape(TOOL_CALL_CLOSE))


class _Arguments:
    """Where a JSON object being written ends (strings, escapes and nesting followed)."""

    def __init__(self) -> None:
        self.depth, self.in_string, self.escape, self.closed = 0, False, False, False

    def take(self, text: str) -> int:
        """How many characters of ``text`` still belong to the object (all of them while it is open)."""
        for i, char in enumerate(text):
            if self.escape:
                self.escape = False
            elif self.in_string:
                self.escape, self.in_string = char == "\\", char != '"'
            elif char == '"':
                self.in_string = True
            elif char in "{[":
                self.depth += 1
            elif char in "}]":
                self.depth -= 1
                if self.depth == 0:
                    self.closed = True
                    return i + 1
        return len(text)


class ToolCallStream:
    """Streaming a reply that may call tools: :meth:`feed` the text as it comes, get back the
    content that can be released and the calls' deltas.

    Content passes through until a call may be starting (``<tool_call>``). ``incremental`` (a
    grammar guarantees every call is well-formed: a forced call, or tools with a response format):
    a call is announced (id, name) as soon as its name is written and its arguments follow as
    they are generated, each delta a prefix of the final arguments. Otherwise (a free reply,
    where the model may write a call that does not parse, which then stays content) everything
    from the first ``<tool_call>`` on is held and parsed when the choice finishes."""

    def __init__(self, incremental: bool = False) -> None:
        self.incremental = incremental
        self._held = ""
        self._in_call = False
        self.text = ""
        self.calls: list[ToolCall] = []
        """The calls streamed so far (after :meth:`finish`: every call of the reply)."""
        self._current: tuple[ToolCall, _Arguments] | None = None
        self._scanned = 0
        """Characters of ``_held`` (the text of the current call, after its tag) already handled."""

    def feed(self, delta: str) -> tuple[str, list[CallDelta]]:
        """(the content that can be released now, the calls' deltas)."""
        self.text += delta
        content, deltas = "", []
        pending = delta
        while pending:
            if not self._in_call:
                released, pending = self._outside(pending)
                content += released
            elif self.incremental:
                pending = self._inside(pending, deltas)
            else:
                self._held += pending
                pending = ""
        return content, deltas

    def _outside(self, delta: str) -> tuple[str, str]:
        """(content released, the text after a call's tag, to go on with)."""
        pending = self._held + delta
        start = pending.find(TOOL_CALL_OPEN)
        if start >= 0:
            self._in_call, self._scanned = True, 0
            after = pending[start + len(TOOL_CALL_OPEN):]
            self._held = TOOL_CALL_OPEN if not self.incremental else ""
            if not self.incremental:
                self._held += after
                after = ""
            return pending[:start], after
        keep = next((n for n in range(min(len(pending), len(TOOL_CALL_OPEN) - 1), 0, -1)
                     if TOOL_CALL_OPEN.startswith(pending[-n:])), 0)  # a call may be starting
        self._held = pending[len(pending) - keep:] if keep else ""
        return pending[: len(pending) - keep], ""

    def _inside(self, delta: str, deltas: list[CallDelta]) -> str:
        """Follow the current call (incremental); returns the text after its closing tag."""
        self._held += delta
        if self._current is None:
            head = _CALL_HEAD.match(self._held)
            if head is None:
                return ""  # the name is not written yet
            try:
                name = json.loads(head.group(1))
            except json.JSONDecodeError:
                name = None
            if not isinstance(name, str) or not name:
                self.incremental = False  # not a call this stream can follow: held, parsed at the end
                self._held = TOOL_CALL_OPEN + self._held
                return ""
            self._current = (ToolCall(name, ""), _Arguments())
            self._scanned = head.end()
            self.calls.append(self._current[0])
            deltas.append(CallDelta(len(self.calls) - 1, self._current[0], first=True))
        call, scanner = self._current
        if not scanner.closed:
            new = self._held[self._scanned:]
            taken = scanner.take(new)
            if taken:
                call.arguments += new[:taken]
                deltas.append(CallDelta(len(self.calls) - 1, call, new[:taken]))
            self._scanned += taken
        if scanner.closed:
            tail = _CALL_TAIL.match(self._held, self._scanned)
            if tail is None:
                return ""  # the closing tag is not written yet
            deltas.append(CallDelta(len(self.calls) - 1, call, done=True))
            after = self._held[tail.end():]
            self._in_call, self._current, self._held = False, None, ""
            return after
        return ""

    def finish(self) -> tuple[str, list[CallDelta]]:
        """(the rest of the content, the deltas of the calls not streamed yet) at the end of the
        choice; :attr:`calls` then holds every call."""
        if self.incremental and self._in_call:  # cut off inside a call (a grammar's reply never is)
            if self._current is not None:
                return "", [CallDelta(len(self.calls) - 1, self._current[0], done=True)]
            self._held = TOOL_CALL_OPEN + self._held  # never announced: parsed as a whole
        content, calls = parse_tool_calls(self._held)
        deltas = []
        for call in calls:
            self.calls.append(call)
            k = len(self.calls) - 1
            deltas += [CallDelta(k, call, call.arguments, first=True), CallDelta(k, call, done=True)]
        return ((content or "") if calls else self._held), deltas


def template_supports_tools(tokenizer) -> bool:
    """Whether the chat template renders a ``tools`` list (it reads the variable)."""
    template = getattr(tokenizer, "chat_template", None)
    if isinstance(template, dict):
        template = template.get("tool_use") or template.get("default")
    return isinstance(template, str) and re.search(r"\btools\b", template) is not None
