"""Chat calls to OpenAI-compatible endpoints with the pipeline's retry policy.

The official ``openai`` client is used with its own retries off (``max_retries=0``): its policy
gives up after a few seconds, while a server restart (a model loading again) takes longer, and
every retry here is recorded as evidence. 429, 408/409, 5xx, timeouts and connection loss are
retried with capped exponential backoff and jitter (honouring ``Retry-After``); when one request
has failed ``max_retries`` times in a row the run stops with :class:`EndpointUnavailable`, and the
unfinished rows are picked up by the next run. 401/403/404 (wrong key, URL or model name) stop
the run too (:class:`EndpointMisconfigured`). Other errors (400, 413, 422, ...) are the row's: it
is recorded with status ``error``.
"""

from __future__ import annotations

import asyncio
import os
import random
import time
from dataclasses import dataclass, field
from typing import Any

import openai

from mimir_megatron.errors import UserError
from mimir_megatron.integrity import fingerprint

RETRY_STATUS = (408, 409, 429)
# Wrong URL, model name or key: every row would fail the same way, so the run stops instead.
FATAL_STATUS = (401, 403, 404)


class EndpointUnavailable(UserError):
    """An endpoint kept failing with retryable errors; rerun to resume."""


class EndpointMisconfigured(UserError):
    """The endpoint refuses every request (401/403/404): fix the YAML, then rerun."""


class RequestRejected(Exception):
    """The server refused this request for good (4xx other than 408/409/429)."""

    def __init__(self, code: str, detail: str):
        super().__init__(f"{code}: {detail}")
        self.code = code
        self.detail = detail


@dataclass
class CallResult:
    text: str
    evidence: dict[str, Any] = field(default_factory=dict)


def _retry_after(exc: Exception) -> float | None:
    response = getattr(exc, "response", None)
    value = response.headers.get("retry-after") if response is not None else None
    try:
        return float(value) if value is not None else None
    except ValueError:
        return None


def _retryable(exc: Exception) -> bool:
    if isinstance(exc, openai.APIConnectionError):  # includes APITimeoutError
        return True
    if isinstance(exc, openai.APIStatusError):
        return exc.status_code in RETRY_STATUS or exc.status_code >= 500
    return False


def _describe(exc: Exception) -> str:
    status = getattr(exc, "status_code", None)
    return f"{type(exc).__name__}{f' {status}' if status else ''}"


class ChatEndpoint:
    """One named endpoint of a pipeline: an ``AsyncOpenAI`` client plus sampling settings."""

    def __init__(self, name: str, cfg: Any, retry: Any, rng: random.Random | None = None):
        self.name = name
        self.cfg = cfg
        self.retry = retry
        self._rng = rng or random.Random()
        self.client = openai.AsyncOpenAI(
            base_url=cfg.base_url,
            api_key=os.environ.get(cfg.api_key_env) or "EMPTY",
            max_retries=0,
            timeout=cfg.timeout_s,
        )

    async def close(self) -> None:
        await self.client.close()

    def backoff(self, failures: int, exc: Exception) -> float:
        r = self.retry
        wait = min(r.max_backoff_s, r.initial_backoff_s * 2 ** (failures - 1))
        wait *= self._rng.uniform(0.5, 1.0)  # jitter: clients that failed together retry apart
        hinted = _retry_after(exc)
        if hinted is not None:
            wait = min(r.max_backoff_s, max(wait, hinted))
        return wait

    async def chat(self, messages: list[dict[str, str]]) -> CallResult:
        cfg = self.cfg
        request: dict[str, Any] = {
            "model": cfg.model, "messages": messages, "temperature": cfg.temperature,
            "top_p": cfg.top_p, "max_tokens": cfg.max_tokens,
        }
        if cfg.seed is not None:
            request["seed"] = cfg.seed
        evidence: dict[str, Any] = {
            "endpoint": self.name, "base_url": cfg.base_url, "model": cfg.model,
            "prompt_sha256": str(fingerprint(messages)),
            "retries": [],
        }
        failures = 0
        start = time.monotonic()
        while True:
            try:
                response = await self.client.chat.completions.create(
                    **request, extra_body=dict(cfg.extra_body) or None)
                break
            except Exception as exc:  # noqa: BLE001 - sorted into retry / row error / bug below
                if not isinstance(exc, openai.OpenAIError):
                    raise
                if not _retryable(exc):
                    status = getattr(exc, "status_code", None)
                    if status in FATAL_STATUS:
                        raise EndpointMisconfigured(
                            f"endpoint {self.name} ({cfg.base_url}, model {cfg.model!r}) answered "
                            f"{status}: {exc}; check endpoints.{self.name} in the pipeline") from None
                    raise RequestRejected(f"api_error_{status or 'client'}", str(exc)[:500]) from None
                failures += 1
                if failures > self.retry.max_retries:
                    raise EndpointUnavailable(
                        f"endpoint {self.name} ({cfg.base_url}) still failing after "
                        f"{self.retry.max_retries} retries: {_describe(exc)}: {exc}") from None
                wait = self.backoff(failures, exc)
                evidence["retries"].append({"error": _describe(exc), "wait_s": round(wait, 3)})
                await asyncio.sleep(wait)
        choice = response.choices[0] if response.choices else None
        text = (choice.message.content if choice is not None else None) or ""
        usage = response.usage
        evidence |= {
            "response_model": response.model,
            "response_id": response.id,
            "finish_reason": choice.finish_reason if choice is not None else None,
            "usage": {"prompt_tokens": usage.prompt_tokens, "completion_tokens": usage.completion_tokens}
            if usage is not None else None,
            "latency_s": round(time.monotonic() - start, 3),
            "raw": text,
        }
        return CallResult(text, evidence)
