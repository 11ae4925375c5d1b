"""What the audits need from a model: greedy outputs, a greedy check, decoding; and the adapter
that provides it on top of the inference engine (``mimir_megatron.inference``)."""

from __future__ import annotations

from pathlib import Path
from typing import Protocol

from mimir_megatron.errors import UserError


class AuditModel(Protocol):
    name: str

    def greedy(self, prompts: list[list[int]], max_new_tokens: int) -> list[list[int]]:
        """Greedy continuation of each prompt (the prompt is the bidirectional prefix); a final
        stop token is not part of the returned ids."""

    def greedy_reproduces(self, pairs: list[tuple[list[int], list[int]]]) -> list[bool]:
        """For each (context, continuation): would greedy decoding from context produce it?"""

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

    def greedy(self, prompts: list[list[int]], max_new_tokens: int) -> list[list[int]]:
        from mimir_megatron.inference import GenerationRequest, SamplingParams

        params = SamplingParams(max_new_tokens=max_new_tokens, temperature=0.0)
        results = self.engine.generate([GenerationRequest(prompt_ids=list(p), params=params) for p in prompts])
        outputs = []
        for r in results:
            ids = list(r.token_ids)
            if r.finish_reason == "stop" and ids:
                ids = ids[:-1] if self._is_stop(ids[-1]) else ids
            outputs.append(ids)
        return outputs

    def _is_stop(self, token_id: int) -> bool:
        tok = self.engine.tokenizer
        stops = {getattr(tok, "eos_token_id", None)} if tok is not None else set()
        for name in ("<end_of_turn>", "<eos>"):
            if tok is not None and name in tok.get_vocab():
                stops.add(tok.convert_tokens_to_ids(name))
        return token_id in stops

    def greedy_reproduces(self, pairs: list[tuple[list[int], list[int]]]) -> list[bool]:
        return [bool(r.is_greedy) for r in self.engine.score([(list(c), list(x)) for c, x in pairs])]

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


def load_audit_model(model: str, *, ema: bool = False, tokenizer: str | None = None,
                     device: str | None = None, batch_size: int = 32) -> EngineAuditModel:
    """A training checkpoint (has trainer_state.json), a transformers hrm_text directory (has
    config.json) or `mimir import` weights."""
    from mimir_megatron.inference import load_engine

    path = Path(model)
    if not path.is_dir():
        raise UserError(f"--model {model}: not a directory")
    kwargs: dict = {"max_batch_size": batch_size}
    if tokenizer:
        kwargs["tokenizer"] = tokenizer
    if device:
        kwargs["device"] = device
    if (path / "trainer_state.json").is_file():
        engine = load_engine(checkpoint=str(path), ema=ema, **kwargs)
    elif (path / "config.json").is_file():
        engine = load_engine(hf=str(path), **kwargs)
    else:
        engine = load_engine(weights=str(path), **kwargs)
    return EngineAuditModel(engine, batch_size=batch_size)
