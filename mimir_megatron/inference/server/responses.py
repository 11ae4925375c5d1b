"""From engine results to OpenAI's response bodies, whole or streamed as server-sent events."""

from __future__ import annotations

import json
from typing import AsyncIterator, Callable

from fastapi.responses import StreamingResponse

from mimir_megatron.inference.engine import InferenceEngine
from mimir_megatron.inference.server.protocol import ApiError, ChatBody, CompletionBody
from mimir_megatron.inference.types import GenerationResult, ScoreResult, TokenEvent

Events = AsyncIterator[tuple[int, TokenEvent]]


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


class Responses:
    """Response bodies for one engine (its tokenizer names the tokens)."""

    def __init__(self, engine: InferenceEngine) -> None:
        self.engine = engine

    def token_text(self, token_id: int) -> str:
        tok = self.engine.tokenizer
        if tok is None:
            return f"token_id:{token_id}"
        return tok.decode([token_id], skip_special_tokens=False)

    def legacy_logprobs(self, token_ids: list[int], logprobs: list[float], offset: int = 0) -> dict:
        tokens = [self.token_text(t) for t in token_ids]
        offsets, at = [], offset
        for t in tokens:
            offsets.append(at)
            at += len(t)
        return {"tokens": tokens, "token_logprobs": logprobs, "top_logprobs": None, "text_offset": offsets}

    def chat_logprobs(self, token_ids: list[int], logprobs: list[float]) -> dict:
        content = []
        for t, lp in zip(token_ids, logprobs):
            text = self.token_text(t)
            content.append({"token": text, "logprob": lp, "bytes": list(text.encode()), "top_logprobs": []})
        return {"content": content}

    # -- whole responses -------------------------------------------------------------------------

    def completion(self, head: dict, body: CompletionBody, results: list[GenerationResult],
                   prompt_tokens: int) -> dict:
        want = body.logprobs is not None
        choices = [{"index": i, "text": r.text if r.text is not None else "",
                    "logprobs": self.legacy_logprobs(r.token_ids, r.logprobs) if want else None,
                    "finish_reason": r.finish_reason} for i, r in enumerate(results)]
        return {**head, "choices": choices,
                "usage": usage(prompt_tokens, sum(len(r.token_ids) for r in results))}

    def chat(self, head: dict, body: ChatBody, results: list[GenerationResult], prompt_tokens: int) -> dict:
        choices = [{"index": i,
                    "message": {"role": "assistant", "content": r.text if r.text is not None else ""},
                    "logprobs": self.chat_logprobs(r.token_ids, r.logprobs) if body.logprobs else None,
                    "finish_reason": r.finish_reason} for i, r in enumerate(results)]
        return {**head, "choices": choices,
                "usage": usage(prompt_tokens, sum(len(r.token_ids) for r in results))}

    def score(self, results: list[ScoreResult], pairs: list[tuple[list[int], list[int]]]) -> dict:
        rows = [{"logprob": r.logprob, "token_logprobs": r.token_logprobs, "is_greedy": r.is_greedy,
                 "num_tokens": len(r.token_logprobs)} for r in results]
        return {"object": "score", "model": self.engine.model_name, "results": rows,
                "usage": {"prompt_tokens": sum(len(c) + len(x) for c, x in pairs)}}

    # -- streamed responses ----------------------------------------------------------------------

    def completion_chunks(self, head: dict, body: CompletionBody, prompt_tokens: int
                          ) -> Callable[[Events], AsyncIterator[str]]:
        want_logprobs = body.logprobs is not None

        async def chunks(events: Events):
            completion_tokens = 0
            offsets: dict[int, int] = {}
            async for index, event in events:
                completion_tokens += 1
                if not (event.text or event.finished or want_logprobs):
                    continue
                choice = {"index": index, "text": event.text or "", "logprobs": None,
                          "finish_reason": event.finish_reason}
                if want_logprobs:
                    choice["logprobs"] = self.legacy_logprobs([event.token_id], [event.logprob],
                                                              offsets.get(index, 0))
                offsets[index] = offsets.get(index, 0) + len(event.text or "")
                yield sse({**head, "choices": [choice]})
            if body.include_usage:
                yield sse({**head, "choices": [], "usage": usage(prompt_tokens, completion_tokens)})

        return chunks

    def chat_chunks(self, head: dict, body: ChatBody, prompt_tokens: int
                    ) -> Callable[[Events], AsyncIterator[str]]:
        head = {**head, "object": "chat.completion.chunk"}

        async def chunks(events: Events):
            for i in range(body.n):
                yield sse({**head, "choices": [{"index": i, "delta": {"role": "assistant", "content": ""},
                                                "logprobs": None, "finish_reason": None}]})
            completion_tokens = 0
            async for index, event in events:
                completion_tokens += 1
                if not (event.text or event.finished or body.logprobs):
                    continue
                logprobs = self.chat_logprobs([event.token_id], [event.logprob]) if body.logprobs else None
                choice = {"index": index, "delta": {"content": event.text} if event.text else {},
                          "logprobs": logprobs, "finish_reason": event.finish_reason}
                yield sse({**head, "choices": [choice]})
            if body.include_usage:
                yield sse({**head, "choices": [], "usage": usage(prompt_tokens, completion_tokens)})

        return chunks


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
