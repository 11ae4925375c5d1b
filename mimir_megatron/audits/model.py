"""What the audits need from a model: greedy outputs, a greedy check, decoding; and the adapter
that provides it on top of the inference engine (``mimir_megatron.inference``)."""

from __future__ import annotations

from typing import Protocol

from mimir_megatron.checkpoint.model_dir import ModelDir, detect_model_dir
from mimir_megatron.errors import UserError


class AuditModel(Protocol):
    name: str

    def greedy(self, prompts: list[list[int]], max_new_tokens: int, stop: bool = True) -> list[list[int]]:
        """Greedy continuation of each prompt (the prompt is the bidirectional prefix). With
        ``stop``, decoding ends at an end-of-turn token, which is not part of the returned ids;
        without, exactly ``max_new_tokens`` are produced."""

    def greedy_reproduces(self, pairs: list[tuple[list[int], list[int]]],
                          bidirectional_tokens: list[int | None] | None = None) -> list[bool]:
        """For each (context, continuation): would greedy decoding from context produce it?
        ``bidirectional_tokens``: per pair, how many leading context tokens are the bidirectional
        prefix (None: all of the context, the paper's protocol); the rest is causal."""

    def decode(self, ids: list[int]) -> str | None:
        """Text of ids, or None without a tokenizer."""

    def prompt_ids(self, record: dict) -> list[int]:
        """Token ids of a generic prompt record (prompt_ids, messages, or prompt text)."""


class EngineAuditModel:
    """:class:`AuditModel` over an ``InferenceEngine``."""

    def __init__(self, engine, batch_size: int = 32) -> None:
        self.engine = engine
        self.name = str(getattr(engine, "model_name", "model"))
        self.batch_size = batch_size

    def greedy(self, prompts: list[list[int]], max_new_tokens: int, stop: bool = True) -> list[list[int]]:
        from mimir_megatron.inference import GenerationRequest, SamplingParams

        params = SamplingParams(max_new_tokens=max_new_tokens, temperature=0.0, use_default_stops=stop)
        outputs = []
        for first in range(0, len(prompts), self.batch_size):
            requests = [GenerationRequest(prompt_ids=list(p), params=params)
                        for p in prompts[first:first + self.batch_size]]
            for r in self.engine.generate(requests):
                ids = list(r.token_ids)
                if stop and r.finish_reason == "stop" and ids and ids[-1] in self.engine.default_stop_ids:
                    ids = ids[:-1]
                outputs.append(ids)
        return outputs

    def greedy_reproduces(self, pairs: list[tuple[list[int], list[int]]],
                          bidirectional_tokens: list[int | None] | None = None) -> list[bool]:
        scores = self.engine.score([(list(c), list(x)) for c, x in pairs],
                                   bidirectional_tokens=bidirectional_tokens)
        return [bool(r.is_greedy) for r in scores]

    def decode(self, ids: list[int]) -> str | None:
        if self.engine.tokenizer is None:
            return None
        return self.engine.decode(list(ids))

    def prompt_ids(self, record: dict) -> list[int]:
        if "prompt_ids" in record:
            return [int(t) for t in record["prompt_ids"]]
        if self.engine.tokenizer is None:
            raise UserError("text prompts need a tokenizer; give prompt_ids or a model with a tokenizer")
        if "messages" in record:
            return list(self.engine.render_chat(record["messages"]))
        return list(self.engine.render_chat([{"role": "user", "content": str(record["prompt"])}]))


def load_audit_model(model: ModelDir | str, *, ema: bool = False, tokenizer: str | None = None,
                     batch_size: int = 32) -> EngineAuditModel:
    """The audited model: a model directory of any form
    (:func:`mimir_megatron.checkpoint.resolve_model_dir`), or its path to recognise."""
    from mimir_megatron.inference import load_engine

    source = model if isinstance(model, ModelDir) else detect_model_dir(model)
    engine = load_engine(model=source, ema=ema, tokenizer=tokenizer, max_batch_size=batch_size)
    return EngineAuditModel(engine, batch_size=batch_size)
