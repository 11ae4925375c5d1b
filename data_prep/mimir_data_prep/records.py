"""Turning one raw input line (JSONL) or row (Parquet) into a conversation, or a named reject.

Nothing here raises on bad data except :class:`RecordError`, which carries the reject reason,
so that the caller can count every line it read as either accepted or rejected.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, replace
from typing import Any

# Every reason a line can be rejected for; the manifest counts each of them (zeros included).
REJECT_REASONS = (
    "empty_line",
    "invalid_utf8",
    "control_characters",
    "malformed_json",
    "bad_schema",
    "missing_role",
    "unknown_role",
    "no_final_assistant",
    "template_error",
    "response_too_short",
    "too_long",
    "corrupt_row_group",
    "benchmark_overlap",  # contains benchmark text of a `--denylist` (mimir audit contamination)
    "personal_data",  # a direct identifier under `--personal-data reject` (personal_data.py)
)

CONTROL_CHAR_POLICIES = ("reject", "strip")
# C0 controls except tab, newline and carriage return; DEL; C1 controls. NUL is the common one.
_CONTROL = re.compile("[\x00-\x08\x0b\x0c\x0e-\x1f\x7f-\x9f]")
# The same characters in UTF-8 bytes (none of these bytes occurs inside another character's): a
# deletion and a short search, where the regex on the decoded line took ~3 us a KiB.
_CONTROL_C0_BYTES = bytes([*range(0x09), 0x0B, 0x0C, *range(0x0E, 0x20), 0x7F])
_CONTROL_C1_UTF8 = re.compile(rb"\xc2[\x80-\x9f]")

KNOWN_ROLES = frozenset({"system", "developer", "user", "assistant", "tool"})


class RecordError(Exception):
    """A line that cannot become a training sample; ``reason`` is one of REJECT_REASONS."""

    def __init__(self, reason: str, detail: str) -> None:
        assert reason in REJECT_REASONS, reason
        super().__init__(reason, detail)
        self.reason = reason
        self.detail = detail


@dataclass(frozen=True)
class Conversation:
    """Messages in the common chat format, ending with the assistant turn that is trained on."""

    messages: list[dict[str, Any]]
    tools: list[Any] | None = None


def decode_json_line(raw: bytes, control_chars: str = "reject") -> Any:
    """Bytes of one JSONL line (newline stripped) to a Python object.

    Raw control bytes (invalid inside JSON strings) are rejected as ``control_characters``; under
    ``control_chars="strip"`` they are let through the parser, and :func:`clean_control_chars`
    removes and counts them together with escaped ones (``\\u0000``).
    """
    if not raw.strip():
        raise RecordError("empty_line", "blank line")
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise RecordError("invalid_utf8", f"byte {exc.start}: {exc.reason}") from None
    match = _CONTROL.search(text) if holds_control_bytes(raw) else None
    if match and control_chars != "strip":
        where = f"raw U+{ord(match.group()):04X} at column {match.start() + 1}"
        raise RecordError("control_characters", where)
    try:
        # without keywords json.loads reuses its decoder (strict); a keyword builds a new one
        return json.loads(text) if match is None else json.loads(text, strict=False)
    except json.JSONDecodeError as exc:
        raise RecordError("malformed_json", f"column {exc.colno}: {exc.msg}") from None
    except RecursionError:  # json recurses once per nesting level
        raise RecordError("malformed_json", "nested too deeply") from None


def holds_control_bytes(raw: bytes) -> bool:
    """Whether the UTF-8 bytes ``raw`` hold a control character (what ``_CONTROL`` matches in
    their text) as itself, not escaped."""
    return (len(raw.translate(None, _CONTROL_C0_BYTES)) != len(raw)
            or (b"\xc2" in raw and _CONTROL_C1_UTF8.search(raw) is not None))


def to_conversation(obj: Any) -> Conversation:
    """Accept ``{"messages": [...], "tools": ...}`` or ``{"prompt": ..., "completion": ...}``.

    ``prompt``/``completion`` may be strings or message lists (the TRL conversational form).
    """
    if not isinstance(obj, dict):
        raise RecordError("bad_schema", f"expected a JSON object, got {type(obj).__name__}")
    if "messages" in obj and obj["messages"] is not None:
        messages = obj["messages"]
    elif "prompt" in obj and "completion" in obj:
        messages = _as_messages(obj["prompt"], "user") + _as_messages(
            obj["completion"], "assistant"
        )
    else:
        raise RecordError("bad_schema", "needs a 'messages' list or 'prompt' and 'completion'")
    if not isinstance(messages, list) or not messages:
        raise RecordError("bad_schema", "'messages' must be a non-empty list")
    tools = obj.get("tools")
    if isinstance(tools, str):  # Parquet exports often store tools as a JSON string
        try:
            tools = json.loads(tools) if tools.strip() else None
        except json.JSONDecodeError:
            raise RecordError("bad_schema", "'tools' is a string but not valid JSON") from None
    if tools is not None and not isinstance(tools, list):
        raise RecordError("bad_schema", "'tools' must be a list")
    cleaned = [_check_message(i, m) for i, m in enumerate(messages)]
    last = cleaned[-1]
    if last["role"] != "assistant":
        raise RecordError(
            "no_final_assistant", f"last message has role {last['role']!r}, expected 'assistant'"
        )
    if not last.get("content") and not last.get("tool_calls"):
        raise RecordError("no_final_assistant", "final assistant turn is empty")
    return Conversation(cleaned, tools or None)


def _as_messages(value: Any, role: str) -> list[dict[str, Any]]:
    if isinstance(value, str):
        return [{"role": role, "content": value}]
    if isinstance(value, list):
        return value
    raise RecordError("bad_schema", f"{role} part must be a string or a message list")


def _check_message(index: int, message: Any) -> dict[str, Any]:
    if not isinstance(message, dict):
        raise RecordError("bad_schema", f"message {index} is not an object")
    role = message.get("role")
    if role is None or role == "":
        raise RecordError("missing_role", f"message {index} has no role")
    if role not in KNOWN_ROLES:
        raise RecordError("unknown_role", f"message {index} has role {role!r}")
    content = message.get("content")
    if content is not None and not isinstance(content, str):
        raise RecordError("bad_schema", f"message {index} content must be a string")
    # Parquet fills absent struct fields with None; drop them so templates see plain dicts (a
    # message without one is kept as it is: nothing changes a message after this)
    if type(message) is dict and None not in message.values():
        return message
    return {k: v for k, v in message.items() if v is not None or k == "content"}


def clean_control_chars(conv: Conversation, policy: str = "reject") -> tuple[Conversation, int]:
    """Find control characters in every string of the conversation (contents, tool calls, tools).

    ``reject`` raises RecordError('control_characters'); ``strip`` removes them. Returns the
    conversation and the number of characters removed.
    """
    try:
        found = _count_control(conv.messages) + _count_control(conv.tools)
    except RecursionError:
        raise RecordError("bad_schema", "nested too deeply") from None
    if not found:
        return conv, 0
    if policy != "strip":
        where = _first_control(conv.messages, "messages") or _first_control(conv.tools, "tools")
        raise RecordError("control_characters", f"{found} control character(s), first in {where}")
    return replace(conv, messages=_strip(conv.messages), tools=_strip(conv.tools)), found


def _count_control(value: Any) -> int:
    if isinstance(value, str):
        return len(_CONTROL.findall(value))
    if isinstance(value, dict):
        return sum(_count_control(v) for v in value.values())
    if isinstance(value, (list, tuple)):
        return sum(_count_control(v) for v in value)
    return 0


def _first_control(value: Any, path: str) -> str | None:
    if isinstance(value, str):
        match = _CONTROL.search(value)
        return f"{path} (U+{ord(match.group()):04X})" if match else None
    items = value.items() if isinstance(value, dict) else enumerate(value) if isinstance(value, list) else ()
    for key, item in items:
        if found := _first_control(item, f"{path}[{key!r}]"):
            return found
    return None


def _strip(value: Any) -> Any:
    if isinstance(value, str):
        return _CONTROL.sub("", value)
    if isinstance(value, dict):
        return {k: _strip(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_strip(v) for v in value]
    return value
