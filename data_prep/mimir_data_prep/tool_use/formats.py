"""Readers of the public function-calling formats; each turns one decoded line into a Trace.

- ``xlam``: ``{"query", "tools", "answers"}`` with tools and answers as JSON strings (or lists);
  the sample is the user query and the assistant's calls.
- ``glaive``: ``{"system": "SYSTEM: ... -\\n{function}\\n\\n{function}", "chat": "USER: ...
  ASSISTANT: <functioncall> {...} <|endoftext|> FUNCTION RESPONSE: ..."}`` (or the whole text in
  one ``sample``/``text`` field). Arguments are often a single-quoted JSON string.
- ``hermes``: ShareGPT ``conversations`` with ``<tools>`` in the system turn, ``<tool_call>`` in
  gpt turns and ``<tool_response>`` in tool turns; payloads are JSON or Python dict literals.
- ``toolace``: a ``system`` field with the function list as JSON, ``conversations`` whose
  assistant turns call as ``[name(arg=value, ...)]`` and whose tool turns hold
  ``[{"name", "results"}]``.

A system prompt that declares the tools (and explains a legacy calling syntax) is replaced by the
native ``tools`` field; that and every other normalisation is noted on the trace.
"""

from __future__ import annotations

import json
import re
from typing import Any, Callable

from .literals import parse_arguments, parse_call_list, parse_literal
from .schema import declaration
from .trace import Call, ConversionError, Result, Trace, Turn

FORMATS = ("xlam", "glaive", "hermes", "toolace")

_ROLES = {
    "human": "user",
    "user": "user",
    "gpt": "assistant",
    "assistant": "assistant",
    "system": "system",
    "tool": "tool",
    "observation": "tool",
    "function_response": "tool",
}
_ENDOFTEXT = "<|endoftext|>"
_GLAIVE_MARKER = re.compile(r"(?:^|\n)[ \t]*(USER|ASSISTANT|FUNCTION RESPONSE):[ \t]?")
_GLAIVE_ARGS = re.compile(r"^\{\s*\"name\"\s*:\s*\"([^\"]+)\"\s*,\s*\"arguments\"\s*:\s*'(.*)'\s*\}$", re.S)
_TAG = {tag: re.compile(rf"<{tag}>(.*?)</{tag}>", re.S) for tag in ("tools", "tool_call", "tool_response")}
_CALL_LIST = re.compile(r"^\s*\[\s*[\w .\-]+\(", re.S)


def detect_format(obj: Any) -> str | None:
    """The format one decoded line is written in, or None."""
    if not isinstance(obj, dict):
        return None
    if "query" in obj and "answers" in obj:
        return "xlam"
    if isinstance(obj.get("chat"), str):
        return "glaive"
    for key in ("sample", "text"):
        if isinstance(obj.get(key), str) and obj[key].lstrip().startswith(("SYSTEM:", "USER:")):
            return "glaive"
    turns = obj.get("conversations")
    if isinstance(turns, list):
        text = " ".join(str(t.get("value", "")) for t in turns if isinstance(t, dict))
        if any(f"<{tag}>" in text for tag in _TAG):
            return "hermes"
        return "toolace" if isinstance(obj.get("system"), str) else "hermes"
    return None


def read(obj: Any, fmt: str) -> Trace:
    if not isinstance(obj, dict):
        raise ConversionError("bad_schema", f"expected a JSON object, got {type(obj).__name__}")
    return _READERS[fmt](obj)


# --- shared helpers ----------------------------------------------------------------------------


def _tools(items: Any, trace: Trace) -> list[dict[str, Any]]:
    if isinstance(items, dict):
        items = [items]
    if not isinstance(items, list):
        raise ConversionError("bad_tools", f"tools are a {type(items).__name__}, not a list")
    out = []
    for item in items:
        decl, recovered = declaration(item)
        if recovered:
            trace.notes["schema_recovered"] += 1
        out.append(decl)
    return out


def _loads(value: Any, what: str, reason: str) -> Any:
    """A field that may be stored as a JSON (or Python literal) string."""
    if not isinstance(value, str):
        return value
    try:
        return parse_literal(value)[0]
    except ValueError as exc:
        raise ConversionError(reason, f"{what}: {exc}") from None


def _call(obj: Any, trace: Trace, where: str) -> Call:
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not obj["name"].strip():
        raise ConversionError("bad_call", f"{where}: a call needs a 'name'")
    arguments, how = parse_arguments(obj.get("arguments", obj.get("parameters")))
    if how:
        trace.notes[how] += 1
    return Call(obj["name"].strip(), arguments)


def _text(value: Any) -> str:
    return value if isinstance(value, str) else json.dumps(value, ensure_ascii=False)


def _turns(obj: dict) -> list[tuple[str, str]]:
    turns = obj.get("conversations")
    if not isinstance(turns, list) or not turns:
        raise ConversionError("bad_schema", "needs a non-empty 'conversations' list")
    out = []
    for i, turn in enumerate(turns):
        if not isinstance(turn, dict) or not isinstance(turn.get("value"), str):
            raise ConversionError("bad_schema", f"turn {i} needs a string 'value'")
        role = _ROLES.get(turn.get("from") or turn.get("role"))
        if role is None:
            raise ConversionError("bad_schema", f"turn {i} has from={turn.get('from')!r}")
        out.append((role, turn["value"]))
    return out


# --- xLAM --------------------------------------------------------------------------------------


def _xlam(obj: dict) -> Trace:
    query = obj.get("query")
    if not isinstance(query, str) or not query.strip():
        raise ConversionError("bad_schema", "xlam: 'query' must be a non-empty string")
    trace = Trace([], [])
    trace.tools = _tools(_loads(obj.get("tools") or [], "xlam tools", "bad_tools"), trace)
    answers = _loads(obj.get("answers"), "xlam answers", "bad_call")
    if not isinstance(answers, list):
        raise ConversionError("bad_call", "xlam: 'answers' must be a list of calls")
    calls = [_call(a, trace, f"answer {i}") for i, a in enumerate(answers)]
    trace.turns = [Turn("user", query), Turn("assistant", "", calls)]
    return trace


# --- Glaive ------------------------------------------------------------------------------------


def _glaive(obj: dict) -> Trace:
    system, chat = obj.get("system") or "", obj.get("chat")
    if not isinstance(chat, str):
        text = obj.get("sample") if isinstance(obj.get("sample"), str) else obj.get("text")
        if not isinstance(text, str):
            raise ConversionError("bad_schema", "glaive: needs 'chat' (and 'system') or 'sample'")
        first = _GLAIVE_MARKER.search(text)
        system, chat = (text[: first.start()], text[first.start() :]) if first else (text, "")
    if not isinstance(system, str):
        raise ConversionError("bad_schema", "glaive: 'system' must be a string")
    trace = Trace([], [])
    system = re.sub(r"^\s*SYSTEM:\s*", "", system)
    functions, rest = _glaive_functions(system)
    if functions:
        trace.tools = _tools(functions, trace)
        trace.notes["system_prompt_replaced"] += 1
    elif rest.strip():
        trace.turns.append(Turn("system", rest.strip()))
    parts = _GLAIVE_MARKER.split(chat)
    if parts[0].strip():
        raise ConversionError("bad_schema", "glaive: text before the first USER:/ASSISTANT: marker")
    for marker, body in zip(parts[1::2], parts[2::2]):
        if _ENDOFTEXT in body:
            body = body.replace(_ENDOFTEXT, "")
            trace.notes["endoftext_stripped"] += 1
        body = body.strip()
        if marker == "USER":
            trace.turns.append(Turn("user", body))
        elif marker == "FUNCTION RESPONSE":
            trace.turns.append(Turn("tool", results=[Result(body)]))
        elif "<functioncall>" in body:
            content, _, call = body.partition("<functioncall>")
            trace.turns.append(Turn("assistant", content.strip(), [_glaive_call(call.strip(), trace)]))
        else:
            trace.turns.append(Turn("assistant", body))
    return trace


def _glaive_functions(system: str) -> tuple[list[Any], str]:
    """The JSON objects after the system text (Glaive lists one per paragraph), and the text."""
    start = system.find("{")
    if start < 0:
        return [], system
    decoder = json.JSONDecoder()
    functions, pos = [], start
    while pos < len(system) and system[pos] == "{":
        try:
            obj, pos = decoder.raw_decode(system, pos)
        except json.JSONDecodeError as exc:
            raise ConversionError("bad_tools", f"glaive: function list: {exc.msg}") from None
        functions.append(obj)
        while pos < len(system) and system[pos].isspace():
            pos += 1
    return functions, system[:start]


def _glaive_call(text: str, trace: Trace) -> Call:
    try:
        obj = parse_literal(text)[0]
    except ValueError:
        # '{"name": "f", "arguments": '{"q": "it's"}'}': the quote inside breaks both parsers.
        match = _GLAIVE_ARGS.match(text)
        if not match:
            raise ConversionError("bad_call", "glaive: <functioncall> is not JSON or a literal") from None
        obj = {"name": match.group(1), "arguments": match.group(2)}
    return _call(obj, trace, "glaive <functioncall>")


# --- Hermes ------------------------------------------------------------------------------------


def _hermes(obj: dict) -> Trace:
    trace = Trace([], [])
    for role, value in _turns(obj):
        # The prompt usually mentions "<tools></tools> XML tags" before the real block.
        blocks = [b for b in _TAG["tools"].findall(value) if b.strip()] if role == "system" else []
        if blocks:
            trace.tools = _tools(_hermes_tools(blocks[0]), trace)
            trace.notes["system_prompt_replaced"] += 1
        elif role == "assistant":
            calls = [
                _call(_payload(b, "bad_call"), trace, "<tool_call>") for b in _TAG["tool_call"].findall(value)
            ]
            content = _TAG["tool_call"].sub("", value).strip()
            if "<tool_call>" in content or "</tool_call>" in content:
                raise ConversionError("bad_call", "hermes: unclosed <tool_call>")
            trace.turns.append(Turn("assistant", content, calls))
        elif role == "tool":
            blocks = _TAG["tool_response"].findall(value) or [value]
            trace.turns.append(Turn("tool", results=[_hermes_result(b) for b in blocks]))
        else:
            trace.turns.append(Turn(role, value))
    return trace


def _hermes_tools(text: str) -> Any:
    try:
        return parse_literal(text.strip())[0]
    except ValueError:
        pass
    try:  # one declaration per line
        return [parse_literal(line)[0] for line in text.strip().splitlines() if line.strip()]
    except ValueError as exc:
        raise ConversionError("bad_tools", f"hermes <tools>: {exc}") from None


def _payload(text: str, reason: str) -> Any:
    try:
        return parse_literal(text.strip())[0]
    except ValueError as exc:
        raise ConversionError(reason, f"payload: {exc}") from None


def _hermes_result(text: str) -> Result:
    try:
        obj = parse_literal(text.strip())[0]
    except ValueError:
        return Result(text.strip())
    if isinstance(obj, dict) and isinstance(obj.get("name"), str):
        return Result(_text(obj.get("content", {k: v for k, v in obj.items() if k != "name"})), obj["name"])
    return Result(_text(obj))


# --- ToolACE -----------------------------------------------------------------------------------


def _toolace(obj: dict) -> Trace:
    trace = Trace([], [])
    system = obj.get("system") or ""
    if not isinstance(system, str):
        raise ConversionError("bad_schema", "toolace: 'system' must be a string")
    functions = _toolace_functions(system)
    if functions is not None:
        trace.tools = _tools(functions, trace)
        trace.notes["system_prompt_replaced"] += 1
    elif system.strip():
        trace.turns.append(Turn("system", system.strip()))
    names = [t["function"]["name"] for t in trace.tools]
    for role, value in _turns(obj):
        if role == "assistant" and _CALL_LIST.match(value):
            calls = [Call(c.name, c.arguments) for c in parse_call_list(value, names)]
            trace.notes["calls_from_python_syntax"] += 1
            trace.turns.append(Turn("assistant", "", calls))
        elif role == "tool":
            trace.turns.append(Turn("tool", results=_toolace_results(value)))
        else:
            trace.turns.append(Turn(role, value))
    return trace


def _toolace_functions(system: str) -> list[Any] | None:
    """The first JSON list of named objects in the system text; None if there is none."""
    decoder = json.JSONDecoder()
    for match in re.finditer(r"\[\s*\{", system):
        try:
            value, _ = decoder.raw_decode(system, match.start())
        except json.JSONDecodeError:
            continue
        if isinstance(value, list) and all(isinstance(v, dict) and "name" in v for v in value):
            return value
    if "[{" in system.replace(" ", ""):
        raise ConversionError("bad_tools", "toolace: the system text holds no parseable function list")
    return None


def _toolace_results(text: str) -> list[Result]:
    try:
        value = parse_literal(text.strip())[0]
    except ValueError:
        return [Result(text.strip())]
    items = value if isinstance(value, list) else [value]
    if items and all(isinstance(v, dict) and "name" in v for v in items):
        return [Result(_text(v.get("results", v.get("content", v))), str(v["name"])) for v in items]
    return [Result(_text(value))]


_READERS: dict[str, Callable[[dict], Trace]] = {
    "xlam": _xlam,
    "glaive": _glaive,
    "hermes": _hermes,
    "toolace": _toolace,
}
