"""The Completions and Chat Completions APIs' replies (``/v1/completions``, ``/v1/chat/completions``,
and ``/v1/score``'s): from engine results to OpenAI's bodies, whole or streamed as server-sent
events. The Responses API (``/v1/responses``) is :mod:`.responses_api`'s."""

from __future__ import annotations

import json
from typing import AsyncIterator, Callable

from fastapi.responses import StreamingResponse

from mimir_megatron.inference.engine import InferenceEngine
from mimir_megatron.inference.server.protocol import ApiError, ChatBody, CompletionBody
from mimir_megatron.inference.server.translation import Generation
from mimir_megatron.inference.tool_calls import CallDelta, ToolCallStream, parse_tool_calls
from mimir_megatron.inference.types import GenerationResult, ScoreResult, TokenEvent, TopLogprobs

Events = AsyncIterator[tuple[int, TokenEvent]]


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


class CompletionBodies:
    """Response bodies for one engine (its tokenizer names the tokens)."""

    def __init__(self, engine: InferenceEngine) -> None:
        self.engine = engine

    def token_text(self, token_id: int) -> str:
        tok = self.engine.tokenizer
        if tok is None:
            return f"token_id:{token_id}"
        return tok.decode([token_id], skip_special_tokens=False)

    def legacy_logprobs(self, token_ids: list[int], logprobs: list[float], tops: list[TopLogprobs] | None,
                        offset: int = 0) -> dict:
        """Completions' log-probs; ``top_logprobs`` as one {token text: log-prob} dict per token."""
        tokens = [self.token_text(t) for t in token_ids]
        offsets, at = [], offset
        for t in tokens:
            offsets.append(at)
            at += len(t)
        top = None if tops is None else [self._top_dict(step) for step in tops]
        return {"tokens": tokens, "token_logprobs": [_finite(lp) for lp in logprobs], "top_logprobs": top,
                "text_offset": offsets}

    def _top_dict(self, step: TopLogprobs) -> dict[str, float]:
        """{token text: log-prob}, most likely first; a token whose text an earlier one already has
        (bytes of one character decode alike) is keyed ``token_id:N``, so none is lost."""
        out: dict[str, float] = {}
        for token_id, logprob in step:
            text = self.token_text(token_id)
            out[text if text not in out else f"token_id:{token_id}"] = _finite(logprob)
        return out

    def _entry(self, token_id: int, logprob: float) -> dict:
        text = self.token_text(token_id)
        return {"token": text, "logprob": _finite(logprob), "bytes": list(text.encode())}

    def chat_logprobs(self, token_ids: list[int], logprobs: list[float],
                      tops: list[TopLogprobs] | None) -> dict:
        content = []
        for i, (t, lp) in enumerate(zip(token_ids, logprobs)):
            alternatives = [self._entry(a, alp) for a, alp in tops[i]] if tops is not None else []
            content.append({**self._entry(t, lp), "top_logprobs": alternatives})
        return {"content": content, "refusal": None}

    # -- whole responses -------------------------------------------------------------------------

    def completion(self, head: dict, body: CompletionBody, results: list[GenerationResult],
                   generation: Generation) -> dict:
        want = body.logprobs is not None
        choices = [{"index": i, "text": r.text if r.text is not None else "",
                    "logprobs": (self.legacy_logprobs(r.token_ids, r.logprobs, r.top_logprobs)
                                 if want else None),
                    "finish_reason": r.finish_reason} for i, r in enumerate(results)]
        return {**head, "choices": choices,
                "usage": usage(generation.prompt_tokens, sum(len(r.token_ids) for r in results))}

    def chat(self, head: dict, body: ChatBody, results: list[GenerationResult],
             generation: Generation) -> dict:
        choices = []
        for i, r in enumerate(results):
            message: dict = {"role": "assistant", "content": r.text if r.text is not None else "",
                             "refusal": None}
            finish = r.finish_reason
            if generation.parse_tool_calls:
                content, calls = parse_tool_calls(message["content"])
                if calls:
                    message = {"role": "assistant", "content": content, "refusal": None,
                               "tool_calls": [c.as_dict() for c in calls]}
                    finish = _tool_finish(finish)
            choices.append({"index": i, "message": message, "finish_reason": finish,
                            "logprobs": self.chat_logprobs(r.token_ids, r.logprobs, r.top_logprobs)
                            if body.logprobs else None})
        return {**head, "choices": choices,
                "usage": usage(generation.prompt_tokens, sum(len(r.token_ids) for r in results))}

    def score(self, results: list[ScoreResult], pairs: list[tuple[list[int], list[int]]]) -> dict:
        rows = [{"logprob": r.logprob, "token_logprobs": r.token_logprobs, "is_greedy": r.is_greedy,
                 "num_tokens": len(r.token_logprobs)} for r in results]
        return {"object": "score", "model": self.engine.model_name, "results": rows,
                "usage": {"prompt_tokens": sum(len(c) + len(x) for c, x in pairs)}}

    # -- streamed responses ----------------------------------------------------------------------

    def completion_chunks(self, head: dict, body: CompletionBody, generation: Generation
                          ) -> Callable[[Events], AsyncIterator[str]]:
        want_logprobs = body.logprobs is not None

        async def chunks(events: Events):
            completion_tokens = 0
            offsets: dict[int, int] = {}
            async for index, event in events:
                completion_tokens += 1
                # A chunk for every token, as vLLM streams: one whose text is held back (an
                # incomplete character, a possible stop string's start) carries "", and the
                # client hears of the first token when it is made, not a step or more later.
                choice = {"index": index, "text": event.text or "", "logprobs": None,
                          "finish_reason": event.finish_reason}
                if want_logprobs:
                    tops = None if event.top_logprobs is None else [event.top_logprobs]
                    choice["logprobs"] = self.legacy_logprobs([event.token_id], [event.logprob], tops,
                                                              offsets.get(index, 0))
                offsets[index] = offsets.get(index, 0) + len(event.text or "")
                yield sse({**head, "choices": [choice]})
            if body.include_usage:
                total = usage(generation.prompt_tokens, completion_tokens)
                yield sse({**head, "choices": [], "usage": total})

        return chunks

    def chat_chunks(self, head: dict, body: ChatBody, generation: Generation
                    ) -> Callable[[Events], AsyncIterator[str]]:
        head = {**head, "object": "chat.completion.chunk"}

        def chunk(index: int, delta: dict, logprobs: dict | None = None, finish: str | None = None) -> str:
            return sse({**head, "choices": [{"index": index, "delta": delta, "logprobs": logprobs,
                                             "finish_reason": finish}]})

        async def chunks(events: Events):
            tool_streams = ({i: ToolCallStream(generation.stream_calls) for i in range(body.choices)}
                            if generation.parse_tool_calls else {})
            for i in range(body.choices):
                yield chunk(i, {"role": "assistant", "content": ""})
            completion_tokens = 0
            async for index, event in events:
                completion_tokens += 1
                text, finish = event.text or "", event.finish_reason
                calls: list[CallDelta] = []
                if index in tool_streams:
                    text, calls = tool_streams[index].feed(text)
                    if event.finished:
                        rest, more = tool_streams[index].finish()
                        text, calls = text + rest, calls + more
                        finish = _tool_finish(finish) if tool_streams[index].calls else finish
                calls = [d for d in calls if d.first or d.arguments]  # chat has no end-of-call delta
                if not (text or calls or event.finished or body.logprobs):
                    continue
                logprobs = None
                if body.logprobs:
                    tops = None if event.top_logprobs is None else [event.top_logprobs]
                    logprobs = self.chat_logprobs([event.token_id], [event.logprob], tops)
                if calls:  # OpenAI's delta format: by the call's index, id and name on its first
                    if text:
                        yield chunk(index, {"content": text}, logprobs)
                        text, logprobs = "", None
                    for delta in calls:
                        yield chunk(index, {"tool_calls": [_tool_call_delta(delta)]}, logprobs)
                        logprobs = None
                    if not event.finished:
                        continue
                yield chunk(index, {"content": text} if text else {}, logprobs, finish)
            if body.include_usage:
                total = usage(generation.prompt_tokens, completion_tokens)
                yield sse({**head, "choices": [], "usage": total})

        return chunks


def _tool_call_delta(delta: CallDelta) -> dict:
    if delta.first:
        return {"index": delta.index, "id": delta.call.id, "type": "function",
                "function": {"name": delta.call.name, "arguments": delta.arguments}}
    return {"index": delta.index, "function": {"arguments": delta.arguments}}


def _finite(logprob: float) -> float:
    """JSON has no -inf: a token the processed distribution excludes is reported as -9999 (vLLM's)."""
    return max(logprob, -9999.0)


def _tool_finish(finish: str) -> str:
    """A reply that ends after its tool calls finishes as ``tool_calls`` (not when cut by length)."""
    return "tool_calls" if finish == "stop" else finish


def sse(payload: dict | str) -> str:
    return f"data: {payload if isinstance(payload, str) else json.dumps(payload)}\n\n"


def stream(events: Events, chunks: Callable[[Events], AsyncIterator[str]]) -> StreamingResponse:
    """An SSE response; an error after the 200 header travels as an event, then no ``[DONE]``."""
    async def body():
        try:
            async for piece in chunks(events):
                yield piece
        except ApiError as exc:
            yield sse(exc.body())
            return
        yield sse("[DONE]")

    return StreamingResponse(body(), media_type="text/event-stream")
