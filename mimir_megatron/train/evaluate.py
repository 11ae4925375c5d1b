"""Exact-match evaluation by greedy decoding on held-out prompt/completion pairs.

Decoding runs on the inference engine (KV-cached, batched; :mod:`mimir_megatron.inference`) over
the model being trained. All TP ranks decode the same rows; data-parallel ranks split the samples.
"""

from __future__ import annotations

from pathlib import Path

import torch
import torch.distributed as dist

from mimir_megatron.inference import GenerationRequest, InferenceEngine, SamplingParams


@torch.no_grad()
def exact_match(model, samples, *, max_new_tokens: int, device: torch.device | None = None, dp_rank: int = 0,
                dp_size: int = 1, dp_group=None, batch_size: int = 64,
                stop_token_ids: tuple[int, ...] | None = None) -> tuple[float, int]:
    """Share of samples whose greedy completion equals the reference exactly; (score, count).

    Generation stops on ``stop_token_ids`` (the template's end-of-turn tokens) when given, else on
    each reference completion's last token (its end-of-turn token, as ``mimir prepare`` renders).
    """
    mine = samples[dp_rank::dp_size]
    was_training = model.training
    engine = InferenceEngine(model, None, max_batch_size=batch_size)
    requests = [
        GenerationRequest(list(s.prompt_ids), SamplingParams(
            max_new_tokens=max_new_tokens,
            stop_token_ids=tuple(stop_token_ids) if stop_token_ids else (int(s.completion_ids[-1]),)))
        for s in mine
    ]
    try:
        results = engine.generate(requests)
    finally:
        model.train(was_training)
    correct = sum(r.token_ids == list(s.completion_ids) for r, s in zip(results, mine))
    totals = torch.tensor([correct, len(mine)], dtype=torch.float64)
    if dist.is_initialized() and dp_size > 1:
        dist.all_reduce(totals, group=dp_group)
    return (totals[0] / totals[1].clamp(min=1)).item(), int(totals[1].item())


def eval_stop_ids(prepared_dir: str | Path) -> tuple[int, ...] | None:
    """The template's end-of-turn ids recorded in a prepared dataset's manifest (``mimir prepare``
    writes them); None for datasets prepared before they were recorded."""
    from mimir_megatron.data.manifest import MANIFEST_NAME, Manifest

    if not (Path(prepared_dir) / MANIFEST_NAME).is_file():
        return None
    return Manifest.read(prepared_dir).tokenizer.end_of_turn_ids or None


def suite_scores(model, cfg, log_dir: Path) -> dict[str, float]:
    """``cfg.eval.suite`` on an engine over the model being trained (rank 0, TP=1): InspectAI
    through an in-process ``mimir serve`` thread, exactly as ``mimir eval`` runs it."""
    from mimir_megatron.evaluation import run_suite_on_engine

    tokenizer = None
    if cfg.model.tokenizer:
        from mimir_megatron.chat import load_tokenizer

        tokenizer = load_tokenizer(cfg.model.tokenizer)
    was_training = model.training
    try:
        engine = InferenceEngine(model, tokenizer, model_name=cfg.run_dir.name or "training")
        return run_suite_on_engine(engine, cfg.eval.suite, limit=cfg.eval.limit,
                                   data_dir=cfg.eval.data_dir or None, log_dir=log_dir)
    finally:
        model.train(was_training)
