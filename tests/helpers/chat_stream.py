"""Reading a streamed chat completion as a client does (the openai SDK's chunk objects)."""

from __future__ import annotations


def streamed_tool_calls(chunks) -> tuple[list[tuple[str, str, str]], list[int]]:
    """(each call's (id, name, arguments), the deltas' concatenation by index as OpenAI defines
    it; how many chunks carried each call's arguments, by index) of choice 0's stream."""
    calls: dict[int, list[str]] = {}
    pieces: dict[int, int] = {}
    for chunk in chunks:
        for delta in (chunk.choices[0].delta.tool_calls or []) if chunk.choices else []:
            call = calls.setdefault(delta.index, ["", "", ""])
            if delta.id:
                assert not call[0], f"call {delta.index} announced twice"
                call[0], call[1] = delta.id, delta.function.name
            call[2] += delta.function.arguments or ""
            pieces[delta.index] = pieces.get(delta.index, 0) + bool(delta.function.arguments)
    return [tuple(calls[k]) for k in sorted(calls)], [pieces[k] for k in sorted(pieces)]
