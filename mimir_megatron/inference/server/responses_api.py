"""OpenAI's Responses API (``POST /v1/responses``) over the chat path.

A request's ``input`` (a text, or a list of items: messages, the model's earlier
``function_call`` items and the client's ``function_call_output`` items) becomes a chat
conversation, rendered by the chat template like any chat request (``instructions`` first, as a
system message). The reply becomes output items: a ``message`` with ``output_text``, and one
``function_call`` item per tool call. ``previous_response_id`` continues a conversation kept in
memory (:class:`ResponseStore`: the newest ``capacity`` responses; older ids are answered with a
400 naming the field); ``store: false`` keeps nothing. A stored response can be read back
(``GET /v1/responses/{id}``), its input items listed (``GET /v1/responses/{id}/input_items``) and
deleted (``DELETE /v1/responses/{id}``); an id not (or no longer) kept is a 404.
"""

from __future__ import annotations

import collections
import dataclasses
import json
import threading
import time
import uuid
from typing import Any, AsyncIterator, Callable, Collection, Literal

from mimir_megatron.inference.server.protocol import ApiError, ResponsesBody, bad_request
from mimir_megatron.inference.tool_calls import (
    TOOL_CALL_OPEN,
    CallDelta,
    ToolCall,
    ToolCallStream,
    parse_tool_calls,
)
from mimir_megatron.inference.types import GenerationResult, TokenEvent, TopLogprobs

LogprobEntries = Callable[[list[int], list[float], list[TopLogprobs] | None], list[dict]]
"""(token ids, their log-probs, their alternatives) -> the output text's ``logprobs`` entries."""

DEFAULT_STORED_RESPONSES = 1024


@dataclasses.dataclass(frozen=True)
class StoredResponse:
    messages: list[dict]
    """The conversation up to and including the reply, as chat messages (for previous_response_id)."""
    response: dict
    """The response object as it was answered."""
    input_items: list[dict]
    """The request's own input items, with ids (for GET .../input_items)."""


class ResponseStore:
    """The newest ``capacity`` responses: their conversations (for ``previous_response_id``), the
    objects answered and their input items. Thread-safe; oldest dropped first."""

    def __init__(self, capacity: int = DEFAULT_STORED_RESPONSES) -> None:
        self.capacity = capacity
        self._items: collections.OrderedDict[str, StoredResponse] = collections.OrderedDict()
        self._lock = threading.Lock()

    def _not_kept(self, response_id: str) -> str:
        return (f"response {response_id!r} is not kept here (this server keeps the newest {self.capacity} "
                "stored responses, in memory)")

    def _find(self, response_id: str) -> StoredResponse | None:
        with self._lock:
            return self._items.get(response_id)

    def get(self, response_id: str) -> list[dict]:
        """The conversation to continue (a 400 naming ``previous_response_id`` when not kept)."""
        found = self._find(response_id)
        if found is None:
            raise ApiError(400, self._not_kept(response_id), "previous_response_id",
                           code="previous_response_not_found")
        return [dict(m) for m in found.messages]

    def stored(self, response_id: str) -> StoredResponse:
        """A kept response (a 404 when not kept: never stored, dropped or deleted)."""
        found = self._find(response_id)
        if found is None:
            raise ApiError(404, self._not_kept(response_id), "response_id", code="not_found")
        return found

    def put(self, response_id: str, stored: StoredResponse) -> None:
        with self._lock:
            self._items[response_id] = stored
            while len(self._items) > self.capacity:
                self._items.popitem(last=False)

    def delete(self, response_id: str) -> None:
        with self._lock:
            found = self._items.pop(response_id, None)
        if found is None:
            raise ApiError(404, self._not_kept(response_id), "response_id", code="not_found")

    def __len__(self) -> int:
        return len(self._items)


def list_input_items(stored: StoredResponse, limit: int = 20, order: Literal["asc", "desc"] = "desc",
                     after: str | None = None) -> dict:
    """``GET /v1/responses/{id}/input_items``: one page of the request's input items, OpenAI's
    list object (newest first by default; ``after`` an item id of the previous page)."""
    if not 1 <= limit <= 100:
        raise bad_request(f"limit must be between 1 and 100, got {limit}", "limit")
    items = stored.input_items if order == "asc" else stored.input_items[::-1]
    if after is not None:
        ids = [item["id"] for item in items]
        if after not in ids:
            raise bad_request(f"after: no input item {after!r} in this response", "after")
        items = items[ids.index(after) + 1:]
    page = items[:limit]
    return {"object": "list", "data": page, "first_id": page[0]["id"] if page else None,
            "last_id": page[-1]["id"] if page else None, "has_more": len(items) > limit}


def _text(content: Any, where: str) -> str:
    """The text of an item's ``content``: a string, or a list of text parts."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        texts = []
        for part in content:
            if not isinstance(part, dict) or part.get("type") not in ("input_text", "output_text", "text") \
                    or not isinstance(part.get("text"), str):
                raise bad_request("only text content parts (input_text, output_text) are supported", where)
            texts.append(part["text"])
        return "".join(texts)
    raise bad_request("content must be a string or a list of text parts", where)


def input_messages(body: ResponsesBody, earlier_calls: Collection[str] = ()) -> list[dict]:
    """``input`` as chat messages (without ``instructions``). A ``function_call_output`` must answer
    a call of the conversation: an earlier ``function_call`` item of the input, or a call among
    ``earlier_calls`` (those of the ``previous_response_id`` conversation), as OpenAI requires."""
    if isinstance(body.input, str):
        return [{"role": "user", "content": body.input}]
    messages: list[dict] = []
    calls = set(earlier_calls)
    for i, item in enumerate(body.input):
        where = f"input[{i}]"
        kind = item.get("type", "message")
        if kind == "message":
            role = item.get("role")
            if role not in ("user", "assistant", "system", "developer"):
                raise bad_request(f"role must be user, assistant, system or developer, got {role!r}", where)
            messages.append({"role": "system" if role == "developer" else role,
                             "content": _text(item.get("content"), where)})
        elif kind == "function_call":
            if not isinstance(item.get("name"), str) or not isinstance(item.get("arguments"), str):
                raise bad_request("a function_call item needs name and arguments (a JSON string)", where)
            call = {"id": item.get("call_id") or item.get("id") or "", "type": "function",
                    "function": {"name": item["name"], "arguments": item["arguments"]}}
            calls.add(call["id"])
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant" and last.get("tool_calls") is not None:
                last["tool_calls"].append(call)  # parallel calls: one assistant turn
            else:
                messages.append({"role": "assistant", "content": "", "tool_calls": [call]})
        elif kind == "function_call_output":
            if item.get("call_id") not in calls:
                raise bad_request(f"no function_call with call_id {item.get('call_id')!r} in this "
                                  "conversation (the input before it, or previous_response_id's)",
                                  f"{where}.call_id")
            output = item.get("output")
            if not isinstance(output, str):
                output = json.dumps(output) if output is not None else ""
            messages.append({"role": "tool", "tool_call_id": item.get("call_id", ""), "content": output})
        elif kind == "reasoning":
            continue  # this server produces none; a client replaying another model's is served without it
        else:
            raise bad_request(f"input item type {kind!r} is not supported (message, function_call, "
                              "function_call_output)", where)
    if not messages:
        raise bad_request("input must hold at least one message", "input")
    return messages


def _part(part: Any, output: bool) -> dict:
    if isinstance(part, dict) and part.get("type") == "text":
        part = {**part, "type": "output_text" if output else "input_text"}
    if isinstance(part, dict) and part.get("type") == "output_text":
        return {"annotations": [], **part}
    return part


def input_items(body: ResponsesBody) -> list[dict]:
    """The request's ``input`` as the Responses API lists it: every item with an id and a status,
    message content as parts (call after :func:`input_messages` has validated it)."""
    raw = [{"role": "user", "content": body.input}] if isinstance(body.input, str) else body.input
    items = []
    for item in raw:
        kind = item.get("type", "message")
        listed = {**item, "type": kind, "status": item.get("status") or "completed"}
        if kind == "message":
            output = item.get("role") == "assistant"
            content = item.get("content")
            parts = [{"type": "text", "text": content}] if isinstance(content, str) else content
            listed["content"] = [_part(part, output) for part in parts]
        listed.setdefault("id", _new_id({"message": "msg", "function_call": "fc"}.get(kind, "item")))
        items.append(listed)
    return items


def conversation(body: ResponsesBody, store: ResponseStore) -> tuple[list[dict], list[dict]]:
    """(the messages to render, instructions first; the conversation to remember, without them)."""
    history = store.get(body.previous_response_id) if body.previous_response_id else []
    earlier_calls = {call.get("id") for m in history for call in m.get("tool_calls") or ()}
    kept = history + input_messages(body, earlier_calls)
    system = [{"role": "system", "content": body.instructions}] if body.instructions else []
    return system + kept, kept


def _new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def _message_item(text: str, item_id: str, status: str = "completed", logprobs: list[dict] | None = None
                  ) -> dict:
    return {"type": "message", "id": item_id, "status": status, "role": "assistant",
            "content": [{"type": "output_text", "text": text, "annotations": [], "logprobs": logprobs or []}]}


def _before_the_calls(entries: list[dict]) -> list[dict]:
    """The entries of the tokens before the first tool call's tag (the message's own text)."""
    text = ""
    for i, entry in enumerate(entries):
        text += entry["token"]
        start = text.find(TOOL_CALL_OPEN)
        if start >= 0:
            at, kept = 0, 0
            for e in entries[: i + 1]:
                at += len(e["token"])
                if at > start:
                    break
                kept += 1
            return entries[:kept]
    return entries


def _call_item(call: ToolCall, status: str = "completed") -> dict:
    return {"type": "function_call", "id": _new_id("fc"), "call_id": call.id, "name": call.name,
            "arguments": call.arguments, "status": status}


def _echoed_tool(tool: dict) -> dict:
    """A function tool as the Response object echoes it: ``strict`` as it was compiled (strict
    unless the tool said ``strict: false``) and ``parameters`` always present, as OpenAI's are."""
    return {**tool, "parameters": tool.get("parameters"), "strict": tool.get("strict") is not False}


def _assistant_message(text: str | None, calls: list[ToolCall]) -> dict:
    message: dict = {"role": "assistant", "content": text or ""}
    if calls:
        message["tool_calls"] = [c.as_dict() for c in calls]
    return message


class ResponseBuilder:
    """One response's object, whole or as stream events."""

    def __init__(self, body: ResponsesBody, model: str, prompt_tokens: int, parse_tool_calls: bool,
                 store: ResponseStore, remembered: list[dict],
                 logprobs: LogprobEntries | None = None, stream_calls: bool = False) -> None:
        self.body, self.model, self.prompt_tokens = body, model, prompt_tokens
        self.parse_tool_calls, self.store, self.remembered = parse_tool_calls, store, remembered
        self.stream_calls = stream_calls
        """Every call is well-formed (a grammar): its arguments stream as they are generated."""
        self.logprobs = logprobs
        """Serves the output text's log-probs (None: not asked for)."""
        self.id = _new_id("resp")
        self.created = int(time.time())

    def _object(self, status: str, output: list[dict], completion_tokens: int, finish: str | None) -> dict:
        b = self.body
        text_format = (b.text or {}).get("format") if isinstance(b.text, dict) else None
        return {**({"user": b.user} if b.user is not None else {}),  # a string in OpenAI's spec, or absent
            "id": self.id, "object": "response", "created_at": self.created, "status": status,
            "model": self.model, "output": output, "error": None,
            "incomplete_details": {"reason": "max_output_tokens"} if finish == "length" else None,
            "instructions": b.instructions, "max_output_tokens": b.max_output_tokens,
            "previous_response_id": b.previous_response_id,
            "parallel_tool_calls": b.parallel_tool_calls is not False,
            "temperature": 1.0 if b.temperature is None else b.temperature,
            "top_p": 1.0 if b.top_p is None else b.top_p,
            "tool_choice": b.tool_choice or "auto", "tools": [_echoed_tool(t) for t in b.tools or ()],
            "text": {"format": text_format or {"type": "text"}}, "reasoning": b.reasoning,
            "store": b.store is not False, "truncation": b.truncation or "disabled",
            "metadata": b.metadata or {},
            # OpenAI's: null until the response is done (a client that adds the usage of every
            # event it sees would count the input again)
            "usage": None if status == "in_progress" else {
                "input_tokens": self.prompt_tokens,
                "input_tokens_details": {"cached_tokens": 0, "cache_write_tokens": 0},
                "output_tokens": completion_tokens, "output_tokens_details": {"reasoning_tokens": 0},
                "total_tokens": self.prompt_tokens + completion_tokens},
        }

    def _finish(self, text: str | None, calls: list[ToolCall], response: dict) -> dict:
        """Keeps the answered response (unless ``store: false``); returns it."""
        if self.body.store is not False:
            self.store.put(self.id, StoredResponse([*self.remembered, _assistant_message(text, calls)],
                                                   response, input_items(self.body)))
        return response

    def _split(self, text: str) -> tuple[str | None, list[ToolCall]]:
        if not self.parse_tool_calls:
            return text, []
        content, calls = parse_tool_calls(text)
        return (content, calls) if calls else (text, [])

    def whole(self, result: GenerationResult) -> dict:
        text, calls = self._split(result.text or "")
        entries = []
        if self.logprobs is not None:
            entries = self.logprobs(result.token_ids, result.logprobs, result.top_logprobs)
            entries = _before_the_calls(entries) if calls else entries
        # A reply without calls is a message, even an empty one (a client looks for it).
        message = [_message_item(text or "", _new_id("msg"), logprobs=entries)] if text or not calls else []
        output = message + [_call_item(c) for c in calls]
        status = "incomplete" if result.finish_reason == "length" else "completed"
        response = self._object(status, output, len(result.token_ids), result.finish_reason)
        return self._finish(text, calls, response)

    async def events(self, events: AsyncIterator[tuple[int, TokenEvent]]) -> AsyncIterator[dict]:
        """OpenAI's stream events: created, in_progress, the output items with their deltas (a
        call's arguments as they are generated where a grammar makes the call well-formed),
        completed (or incomplete)."""
        sequence = iter(range(1 << 30))

        def event(kind: str, **fields) -> dict:
            return {"type": kind, "sequence_number": next(sequence), **fields}

        yield event("response.created", response=self._object("in_progress", [], 0, None))
        yield event("response.in_progress", response=self._object("in_progress", [], 0, None))
        stream = ToolCallStream(self.stream_calls) if self.parse_tool_calls else None
        message_id, text, tokens, finish, output = _new_id("msg"), "", 0, None, []
        message_at: int | None = None  # the open message's output index
        calls: dict[int, tuple[int, dict]] = {}  # call index -> (output index, item)
        pending: list[dict] = []  # log-probs of tokens whose text is not released yet
        released: list[dict] = []

        def open_message():
            nonlocal message_at
            message_at = len(output)
            output.append(None)  # its place, filled when it is done
            item = _message_item("", message_id, "in_progress")
            item["content"] = []
            yield event("response.output_item.added", output_index=message_at, item=item)
            part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
            yield event("response.content_part.added", item_id=message_id, output_index=message_at,
                        content_index=0, part=part)

        def close_message():
            nonlocal message_at
            part = {"type": "output_text", "text": text, "annotations": [], "logprobs": released}
            yield event("response.output_text.done", item_id=message_id, output_index=message_at,
                        content_index=0, text=text, logprobs=released)
            yield event("response.content_part.done", item_id=message_id, output_index=message_at,
                        content_index=0, part=part)
            output[message_at] = _message_item(text, message_id, logprobs=released)
            yield event("response.output_item.done", output_index=message_at, item=output[message_at])
            message_at = None

        def call_events(delta: CallDelta):
            if delta.first:
                if message_at is not None:  # the text before the calls is complete
                    yield from close_message()
                item = _call_item(delta.call, "in_progress")
                calls[delta.index] = (len(output), item)
                output.append(None)
                yield event("response.output_item.added", output_index=calls[delta.index][0],
                            item={**item, "arguments": ""})
            index, item = calls[delta.index]
            if delta.arguments:
                yield event("response.function_call_arguments.delta", item_id=item["id"], output_index=index,
                            delta=delta.arguments)
            if delta.done:
                yield event("response.function_call_arguments.done", item_id=item["id"], output_index=index,
                            name=delta.call.name, arguments=delta.call.arguments)
                output[index] = {**item, "arguments": delta.call.arguments, "status": "completed"}
                yield event("response.output_item.done", output_index=index, item=output[index])

        async for _, token_event in events:
            tokens += 1
            if self.logprobs is not None:
                tops = None if token_event.top_logprobs is None else [token_event.top_logprobs]
                pending += self.logprobs([token_event.token_id], [token_event.logprob], tops)
            delta, call_deltas = token_event.text or "", []
            if stream is not None:
                delta, call_deltas = stream.feed(delta)
                if token_event.finished:
                    rest, more = stream.finish()
                    delta, call_deltas = delta + rest, call_deltas + more
            if token_event.finished and stream is not None and stream.calls:
                pending = _before_the_calls(released + pending)[len(released):]
            if delta:
                if message_at is None:
                    for e in open_message():
                        yield e
                text += delta
                yield event("response.output_text.delta", item_id=message_id, output_index=message_at,
                            content_index=0, delta=delta, logprobs=pending)
                released, pending = released + pending, []
            for call_delta in call_deltas:
                for e in call_events(call_delta):
                    yield e
            if token_event.finished:
                finish = token_event.finish_reason
                released, pending = released + pending, []
                if message_at is None and not text and not calls:  # a reply without calls is a message
                    for e in open_message():
                        yield e
                if message_at is not None:
                    for e in close_message():
                        yield e
        status = "incomplete" if finish == "length" else "completed"
        final = [item for item in output if item is not None]
        calls_made = stream.calls if stream is not None else []
        response = self._finish(text or None, calls_made, self._object(status, final, tokens, finish))
        yield event(f"response.{status}", response=response)


async def sse_events(events: AsyncIterator[dict]) -> AsyncIterator[str]:
    """Server-sent events in OpenAI's form (``event:`` names the type); an error after the 200
    header travels as an ``error`` event."""
    sequence = -1
    try:
        async for e in events:
            sequence = e["sequence_number"]
            yield f"event: {e['type']}\ndata: {json.dumps(e)}\n\n"
    except ApiError as exc:
        error = {"type": "error", "code": exc.code, "message": exc.message, "param": exc.param,
                 "sequence_number": sequence + 1}
        yield f"event: error\ndata: {json.dumps(error)}\n\n"
