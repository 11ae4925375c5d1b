"""The chat template's tool-call syntax, read back from generated text into OpenAI ``tool_calls``.

The project's templates (the demo tokenizer under ``data_prep/``, what ``mimir prepare`` trains on)
write each call of an assistant turn as ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``
after the turn's text. A call whose JSON does not parse stays in the content as text (the client
sees what the model wrote), as vLLM's parsers do.
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


def _call(payload: str) -> ToolCall | None:
    try:
        obj = json.loads(payload)
    except json.JSONDecodeError:
        return None
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not obj["name"]:
        return None
    arguments = obj.get("arguments", {})
    if isinstance(arguments, str):  # already a JSON string: keep it if it parses
        try:
            json.loads(arguments)
        except json.JSONDecodeError:
            return None
        return ToolCall(obj["name"], arguments)
    if not isinstance(arguments, dict):
        return None
    return ToolCall(obj["name"], json.dumps(arguments, ensure_ascii=False))


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


class ToolCallStream:
    """Streaming: content deltas pass through until a call may be starting; from the first
    ``<tool_call>`` on, the text is held and parsed when the choice finishes."""

    def __init__(self) -> None:
        self._held = ""
        self._in_call = False
        self.text = ""

    def feed(self, delta: str) -> str:
        """The content that can be released now."""
        self.text += delta
        if self._in_call:
            self._held += delta
            return ""
        pending = self._held + delta
        start = pending.find(TOOL_CALL_OPEN)
        if start >= 0:
            self._in_call, self._held = True, pending[start:]
            return pending[:start]
        keep = next((n for n in range(min(len(pending), len(TOOL_CALL_OPEN) - 1), 0, -1)
                     if TOOL_CALL_OPEN.startswith(pending[-n:])), 0)  # a call may be starting
        self._held = pending[len(pending) - keep:] if keep else ""
        return pending[: len(pending) - keep]

    def finish(self) -> tuple[str, list[ToolCall]]:
        """(the rest of the content, the calls) at the end of the choice."""
        content, calls = parse_tool_calls(self._held)
        return (content or "") if calls else self._held, calls


def template_supports_tools(tokenizer) -> bool:
    """Whether the chat template renders a ``tools`` list (it reads the variable)."""
    template = getattr(tokenizer, "chat_template", None)
    if isinstance(template, dict):
        template = template.get("tool_use") or template.get("default")
    return isinstance(template, str) and re.search(r"\btools\b", template) is not None
