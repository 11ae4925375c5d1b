"""Log-likelihood of multiple-choice letters through the server's ``POST /v1/score``.

The server scores a continuation after a context with the training mask (context bidirectional,
continuation causal), which harness HF backends cannot do for a PrefixLM. The context is the
conversation rendered with the model's chat template up to the generation prompt, sent as token
ids when the tokenizer is known here; otherwise the plain user text is sent and the server
tokenizes it (a base-model reading, warned about once).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import httpx

from mimir_megatron.inference.api_keys import Endpoint

from .http_retry import RetryPolicy, post_json_async

log = logging.getLogger(__name__)

Renderer = Callable[[list[dict[str, str]]], list[int]]


def chat_renderer(tokenizer) -> Renderer:  # noqa: ANN001 (a transformers tokenizer)
    def render(messages: list[dict[str, str]]) -> list[int]:
        ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        return list(ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids)

    return render


Encoder = Callable[[str], list[int]]


def load_renderer(tokenizer_dir: str | Path | None) -> tuple[Renderer | None, Encoder | None]:
    """(chat renderer, plain encoder) of a tokenizer directory, or (None, None) without one."""
    if not tokenizer_dir or not (Path(tokenizer_dir) / "tokenizer.json").is_file():
        return None, None
    from mimir_megatron.chat import load_tokenizer

    tok = load_tokenizer(tokenizer_dir)
    return chat_renderer(tok), (lambda text: tok.encode(text, add_special_tokens=False))


class ScoreClient:
    """Sums of continuation log-probs for (conversation, continuation) pairs."""

    def __init__(self, endpoint: Endpoint | str, model: str, render: Renderer | None = None,
                 encode: Callable[[str], list[int]] | None = None, timeout_s: float = 600.0,
                 retry: RetryPolicy = RetryPolicy()):
        endpoint = Endpoint.of(endpoint)
        self.url = endpoint.base_url + "/score"
        self.headers = endpoint.headers
        self.model = model
        self.render = render
        self.encode = encode
        self.timeout_s = timeout_s
        self.retry = retry
        self._warned = False

    def _context(self, messages: list[dict[str, str]]) -> Any:
        if self.render is not None:
            return self.render(messages)
        if not self._warned:
            log.warning("no tokenizer for log-likelihood scoring: sending plain text contexts "
                        "without the chat template (pass --tokenizer to render it)")
            self._warned = True
        return "\n\n".join(m["content"] for m in messages)

    def body(self, messages: list[dict[str, str]], continuations: Sequence[str],
             schedule: dict[str, int] | None) -> dict[str, Any]:
        context = self._context(messages)
        items = [{"context": context,
                  "continuation": self.encode(c) if self.encode is not None else c}
                 for c in continuations]
        return {"model": self.model, "items": items, **(schedule or {})}

    async def logprobs(self, messages: list[dict[str, str]], continuations: Sequence[str],
                       schedule: dict[str, int] | None = None) -> list[float]:
        async with httpx.AsyncClient(timeout=self.timeout_s, headers=self.headers) as client:
            # a dropped connection or a full queue is retried, not the task's failure
            response = await post_json_async(client, self.url, self.body(messages, continuations, schedule),
                                             self.retry)
        return [float(r["logprob"]) for r in response.json()["results"]]
