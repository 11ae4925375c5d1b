"""Input layouts of public chat data, normalised to the ``messages`` form `mimir prepare` renders.

- ``messages``: ``{"messages": [{"role", "content"}...], "tools": [...]}`` or
  ``{"prompt": ..., "completion": ...}`` (strings or message lists).
- ``sharegpt``: ``{"conversations": [{"from", "value"}...], "system": ..., "tools": ...}`` with
  ``from`` in human, gpt, system, tool, function_call, observation (LLaMA-Factory's names).
- ``alpaca``: ``{"instruction", "input", "output", "system", "history": [[q, a], ...]}``.
- ``columns``: a mapping of ``prompt``, ``completion``, ``system``, ``messages``, ``tools`` onto
  the file's own column names, e.g. ``prompt=problem,completion=generated_solution``.

``auto`` looks at the first lines of a file and picks one layout for the whole file (lines that do
not fit it are rejected as ``bad_schema``); the decision and its counts go into the manifest.
"""

from __future__ import annotations

import json
import logging
from collections import Counter
from pathlib import Path
from typing import Any, Iterable, Mapping

from mimir_megatron.errors import UserError

from .records import RecordError
from .shards import ShardTask, sample_records

log = logging.getLogger(__name__)

INPUT_FORMATS = ("auto", "messages", "sharegpt", "alpaca", "columns")
LAYOUTS = INPUT_FORMATS[1:]
COLUMN_TARGETS = ("prompt", "completion", "system", "messages", "tools")
DETECT_LINES = 32  # lines of a file that `auto` looks at

_SHAREGPT_ROLES = {
    "human": "user",
    "user": "user",
    "gpt": "assistant",
    "assistant": "assistant",
    "model": "assistant",
    "chatgpt": "assistant",
    "bing": "assistant",
    "system": "system",
    "tool": "tool",
    "observation": "tool",
    "function_call": "assistant",  # a tool call: the value is {"name", "arguments"} JSON
}


def parse_columns(spec: str | Mapping[str, str] | None) -> dict[str, str]:
    """``prompt=problem,completion=solution`` (or a mapping from YAML) -> {target: column}."""
    if not spec:
        return {}
    if isinstance(spec, str):
        pairs = {}
        for part in spec.split(","):
            target, sep, column = part.partition("=")
            if not sep or not target.strip() or not column.strip():
                raise UserError(f"columns: {part!r} is not TARGET=COLUMN")
            pairs[target.strip()] = column.strip()
    else:
        pairs = {str(k): str(v) for k, v in spec.items()}
    unknown = sorted(set(pairs) - set(COLUMN_TARGETS))
    if unknown:
        raise UserError(f"columns: unknown target(s) {unknown}; targets are {list(COLUMN_TARGETS)}")
    if "messages" not in pairs and not {"prompt", "completion"} <= set(pairs):
        raise UserError("columns: needs prompt= and completion=, or messages=")
    return pairs


def layout_of(obj: Any, columns: Mapping[str, str] | None = None) -> str | None:
    """The layout one decoded line fits, or None."""
    if not isinstance(obj, dict):
        return None
    if columns and all(c in obj for t, c in columns.items() if t in ("prompt", "completion", "messages")):
        return "columns"
    messages = obj.get("messages")
    if isinstance(messages, list) and messages and all(isinstance(m, dict) for m in messages):
        return "sharegpt" if "from" in messages[0] and "role" not in messages[0] else "messages"
    if "prompt" in obj and "completion" in obj:
        return "messages"
    if isinstance(obj.get("conversations"), list):
        return "sharegpt"
    if "instruction" in obj and "output" in obj:
        return "alpaca"
    return None


def detect_layout(objs: Iterable[Any], source: str, columns: Mapping[str, str] | None) -> dict:
    """Decide one layout from the first decoded lines of ``source``; UserError if none fits.

    Returns the manifest record: ``{"format", "sampled", "matches"}``.
    """
    votes: Counter[str] = Counter()
    sampled = 0
    keys: Counter[str] = Counter()
    for obj in objs:
        sampled += 1
        layout = layout_of(obj, columns)
        votes[layout or "none"] += 1
        if isinstance(obj, dict):
            keys.update(obj.keys())
    fitting = [(n, layout) for layout, n in votes.items() if layout != "none"]
    if not fitting:
        seen = ", ".join(k for k, _ in keys.most_common(20)) or "no JSON objects"
        raise UserError(
            f"{source}: unknown input layout in the first {sampled} line(s); columns seen: {seen}. "
            "Use --input-format columns --columns prompt=COL,completion=COL (or messages=COL)"
        )
    best = max(fitting, key=lambda t: (t[0], -LAYOUTS.index(t[1])))[1]
    return {"format": best, "sampled": sampled, "matches": dict(sorted(votes.items()))}


def decide_layouts(tasks: list[ShardTask], input_format: str, columns: Mapping[str, str]) -> dict[str, dict]:
    """The detect-layout stage of `mimir prepare`: per input file, its layout and, for ``auto``,
    the votes of its first lines (the manifest's ``input_formats``)."""
    if input_format == "auto" and columns:
        input_format = "columns"  # a column mapping names the layout
    decided: dict[str, dict] = {}
    for task in tasks:
        if task.path in decided:
            continue
        if input_format != "auto":
            decided[task.path] = {"requested": input_format, "format": input_format}
            continue
        sample = sample_records(Path(task.path), task.kind, DETECT_LINES)
        record = detect_layout(sample, task.path, columns)
        decided[task.path] = {"requested": "auto", **record}
        log.info("%s: input layout %s (first %d lines: %s)", task.path, record["format"],
                 record["sampled"], record["matches"])
    return decided


def normalise(obj: Any, layout: str, columns: Mapping[str, str] | None = None) -> Any:
    """One decoded line in ``layout`` -> the ``messages`` layout (RecordError if it does not fit)."""
    if layout == "messages":
        return obj
    if not isinstance(obj, dict):
        raise RecordError("bad_schema", f"expected a JSON object, got {type(obj).__name__}")
    if layout == "sharegpt":
        return _from_sharegpt(obj)
    if layout == "alpaca":
        return _from_alpaca(obj)
    if layout == "columns":
        return _from_columns(obj, columns or {})
    raise ValueError(f"unknown layout {layout!r}")


def _from_sharegpt(obj: dict) -> dict:
    turns = obj.get("conversations")
    if turns is None:
        turns = obj.get("messages")
    if not isinstance(turns, list) or not turns:
        raise RecordError("bad_schema", "sharegpt: needs a non-empty 'conversations' list")
    messages: list[dict[str, Any]] = []
    if isinstance(obj.get("system"), str) and obj["system"]:
        messages.append({"role": "system", "content": obj["system"]})
    pending: list[str] = []  # ids of calls awaiting an observation
    calls = 0
    for i, turn in enumerate(turns):
        if not isinstance(turn, dict):
            raise RecordError("bad_schema", f"sharegpt: turn {i} is not an object")
        who, value = turn.get("from"), turn.get("value")
        if who is None or who == "":
            raise RecordError("missing_role", f"sharegpt: turn {i} has no 'from'")
        role = _SHAREGPT_ROLES.get(who)
        if role is None:
            raise RecordError("unknown_role", f"sharegpt: turn {i} has from={who!r}")
        if not isinstance(value, str):
            raise RecordError("bad_schema", f"sharegpt: turn {i} value must be a string")
        if who == "function_call":
            tool_calls = []
            for call in _calls(value, i):  # one call, or a list of parallel calls
                calls += 1
                tool_calls.append({"id": f"call_{calls}", "type": "function", "function": call})
                pending.append(f"call_{calls}")
            messages.append({"role": "assistant", "content": "", "tool_calls": tool_calls})
        elif role == "tool":
            message = {"role": "tool", "content": value}
            if pending:
                message["tool_call_id"] = pending.pop(0)
            messages.append(message)
        else:
            messages.append({"role": role, "content": value})
    out: dict[str, Any] = {"messages": messages}
    if obj.get("tools") is not None:
        out["tools"] = obj["tools"]
    return out


def _calls(value: str, index: int) -> list[dict]:
    """{"name", "arguments"} JSON (or a list of them) -> [{"name", "arguments": {...}}]."""
    try:
        parsed = json.loads(value)
    except json.JSONDecodeError:
        raise RecordError("bad_schema", f"sharegpt: function_call turn {index} is not JSON") from None
    out = []
    for call in parsed if isinstance(parsed, list) else [parsed]:
        if not isinstance(call, dict) or not isinstance(call.get("name"), str):
            raise RecordError("bad_schema", f"sharegpt: function_call turn {index} has no 'name'")
        arguments = call.get("arguments", {})
        if isinstance(arguments, str):
            try:
                arguments = json.loads(arguments) if arguments.strip() else {}
            except json.JSONDecodeError:
                raise RecordError("bad_schema", f"sharegpt: turn {index} arguments are not JSON") from None
        out.append({"name": call["name"], "arguments": arguments})
    if not out:
        raise RecordError("bad_schema", f"sharegpt: function_call turn {index} holds no call")
    return out


def _from_alpaca(obj: dict) -> dict:
    instruction, output = obj.get("instruction"), obj.get("output")
    extra = obj.get("input") or ""
    if not isinstance(instruction, str) or not isinstance(output, str) or not isinstance(extra, str):
        raise RecordError("bad_schema", "alpaca: 'instruction', 'input' and 'output' must be strings")
    messages: list[dict[str, Any]] = []
    if isinstance(obj.get("system"), str) and obj["system"]:
        messages.append({"role": "system", "content": obj["system"]})
    for pair in obj.get("history") or []:
        if not (isinstance(pair, list) and len(pair) == 2 and all(isinstance(x, str) for x in pair)):
            raise RecordError("bad_schema", "alpaca: 'history' must be a list of [prompt, answer]")
        messages += [{"role": "user", "content": pair[0]}, {"role": "assistant", "content": pair[1]}]
    prompt = f"{instruction}\n\n{extra}" if extra.strip() else instruction
    messages += [{"role": "user", "content": prompt}, {"role": "assistant", "content": output}]
    return {"messages": messages}


def _from_columns(obj: dict, columns: Mapping[str, str]) -> dict:
    missing = [c for t, c in columns.items() if t != "system" and t != "tools" and c not in obj]
    if missing:
        raise RecordError("bad_schema", f"columns: missing column(s) {missing}")
    out: dict[str, Any] = {}
    if "messages" in columns:
        out["messages"] = obj[columns["messages"]]
    else:
        prompt, completion = obj[columns["prompt"]], obj[columns["completion"]]
        system = obj.get(columns["system"]) if "system" in columns else None
        if system is not None and not isinstance(system, str):
            raise RecordError("bad_schema", "columns: the system column must be a string")
        if system and isinstance(prompt, str):
            prompt = [{"role": "system", "content": system}, {"role": "user", "content": prompt}]
        out["prompt"], out["completion"] = prompt, completion
    if "tools" in columns and obj.get(columns["tools"]) is not None:
        out["tools"] = obj[columns["tools"]]
    return out
