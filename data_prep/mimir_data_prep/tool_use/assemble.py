"""A Trace to the chat format `mimir prepare` reads: ``tools``, assistant ``tool_calls`` with ids,
``tool`` messages answering them by ``tool_call_id``, then the final answer.

Results are matched to the open calls of the latest assistant turn: by function name when the
format names it, otherwise in order. A call that gets no result before the conversation moves on
and a result that answers no open call are *dangling*: ``drop-part`` cuts them out (a repair,
counted), ``drop-sample`` rejects the line. Calls in the final assistant turn need no result:
they are what the sample teaches.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from .trace import ConversionError, Trace

DANGLING_POLICIES = ("drop-part", "drop-sample")


@dataclass
class Assembled:
    sample: dict[str, Any]  # {"tools"?, "messages"}
    repairs: Counter[str] = field(default_factory=Counter)  # reason -> parts cut out


def assemble(trace: Trace, dangling: str = "drop-part") -> Assembled:
    declared = {t["function"]["name"] for t in trace.tools}
    messages: list[dict[str, Any]] = []
    repairs: Counter[str] = Counter()
    open_calls: list[tuple[dict, dict]] = []  # (assistant message, call) awaiting a result
    ids = 0

    def close_dangling() -> None:
        for message, call in open_calls:
            _dangle(dangling, "call_without_result", f"call {call['function']['name']!r} got no result")
            message["tool_calls"].remove(call)
            repairs["call_without_result"] += 1
        open_calls.clear()

    for turn in trace.turns:
        if turn.role == "tool":
            for result in turn.results:
                match = _match(open_calls, result.name)
                if match is None:
                    _dangle(dangling, "result_without_call", f"result for {result.name or 'no open call'!r}")
                    repairs["result_without_call"] += 1
                    continue
                open_calls.remove(match)
                call = match[1]
                messages.append(
                    {
                        "role": "tool",
                        "tool_call_id": call["id"],
                        "name": call["function"]["name"],
                        "content": result.content,
                    }
                )
            continue
        close_dangling()
        if turn.role != "assistant" or not turn.calls:
            messages.append({"role": turn.role, "content": turn.content})
            continue
        message: dict[str, Any] = {"role": "assistant", "content": turn.content, "tool_calls": []}
        for call in turn.calls:
            if call.name not in declared:
                raise ConversionError(
                    "undeclared_function", f"call of {call.name!r}, declared: {sorted(declared)}"
                )
            ids += 1
            entry = {
                "id": f"call_{ids}",
                "type": "function",
                "function": {"name": call.name, "arguments": call.arguments},
            }
            message["tool_calls"].append(entry)
            open_calls.append((message, entry))
        messages.append(message)
    final = messages[-1] if messages else None
    if final is not None and final["role"] == "assistant":
        open_calls = [(m, c) for m, c in open_calls if m is not final]  # calls of the final turn
    close_dangling()
    messages = [m for m in messages if not _empty_assistant(m)]
    for m in messages:
        if m["role"] == "assistant" and "tool_calls" in m and not m["tool_calls"]:
            del m["tool_calls"]
    if not messages or messages[-1]["role"] != "assistant":
        last = messages[-1]["role"] if messages else "nothing"
        raise ConversionError("no_final_answer", f"the conversation ends with {last}, not an assistant turn")
    if not any(m["role"] == "user" for m in messages):
        raise ConversionError("bad_schema", "no user turn")
    sample: dict[str, Any] = {"messages": messages}
    if trace.tools:
        sample = {"tools": trace.tools, **sample}
    return Assembled(sample, repairs)


def _match(open_calls: list[tuple[dict, dict]], name: str | None) -> tuple[dict, dict] | None:
    for pair in open_calls:
        if name is None or pair[1]["function"]["name"] == name:
            return pair
    return None


def _dangle(policy: str, reason: str, detail: str) -> None:
    if policy == "drop-sample":
        raise ConversionError(reason, detail)


def _empty_assistant(message: dict[str, Any]) -> bool:
    return message["role"] == "assistant" and not message["content"].strip() and not message.get("tool_calls")
