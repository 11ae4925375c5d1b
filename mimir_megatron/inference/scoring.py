"""Continuation scoring: the log-probability of each continuation given its context, in one
forward pass per batch of pairs (no cache), with a PrefixLM mask whose bidirectional part the
caller chooses per pair. ``InferenceEngine.score`` is the entry point."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from mimir_kernels import build_layout

from mimir_megatron.batch import single_sample_batch
from mimir_megatron.inference.requests import RequestError
from mimir_megatron.inference.surface import EngineSurface
from mimir_megatron.inference.types import ScoreResult

@torch.no_grad()
def score(
    engine: EngineSurface,
    pairs: list[tuple[list[int], list[int]]],
    h_cycles: int | None = None,
    l_cycles: int | None = None,
    *,
    bidirectional_tokens: Sequence[int | None] | None = None,
) -> list[ScoreResult]:
    """Log-probability of each continuation given its context. The first
    ``bidirectional_tokens[i]`` context tokens of pair ``i`` are the bidirectional prefix
    (None, the default: the whole context, the mask of a prompt in training); the rest of the
    context and the continuation are causal, as response text was in training."""
    plan = engine.plan(*engine.limits.schedule(h_cycles, l_cycles))
    if bidirectional_tokens is None:
        bidirectional_tokens = [None] * len(pairs)
    if len(bidirectional_tokens) != len(pairs):
        raise RequestError(
            f"bidirectional_tokens has {len(bidirectional_tokens)} entries for {len(pairs)} pairs",
            "bidirectional_tokens",
        )
    for (context, continuation), bidirectional in zip(pairs, bidirectional_tokens):
        engine.limits.check_pair(context, continuation, bidirectional)
    order = sorted(range(len(pairs)), key=lambda i: len(pairs[i][0]) + len(pairs[i][1]))
    results: list[ScoreResult | None] = [None] * len(pairs)
    for start in range(0, len(order), engine.max_batch_size):
        chunk = order[start : start + engine.max_batch_size]
        chunk_pairs = [pairs[i] for i in chunk]
        chunk_bidirectional = [bidirectional_tokens[i] for i in chunk]
        for i, res in zip(chunk, _score_batch(engine, chunk_pairs, chunk_bidirectional, plan)):
            results[i] = res
    return results  # type: ignore[return-value]


def _score_batch(engine: EngineSurface, pairs, bidirectional_tokens, plan) -> list[ScoreResult]:
    width = engine.pad_width(max(len(c) + len(x) - 1 for c, x in pairs))
    batch = single_sample_batch([c for c, _ in pairs], [x for _, x in pairs], seq_len=width)
    for row, ((context, _), bidirectional) in enumerate(zip(pairs, bidirectional_tokens)):
        if bidirectional is not None:  # the context's tail is causal, like response text
            batch.prefix_mask[row, bidirectional : len(context)] = False
    batch = batch.to(engine.device)
    layout = build_layout(engine.model.attention_backend, batch.segment_ids, batch.prefix_mask)
    hidden = engine.hidden_states(batch.input_ids, batch.position_ids, layout, plan)  # [s, b, h]
    out = []
    for row, (context, continuation) in enumerate(pairs):
        # Position len(context) - 1 + j predicts continuation[j].
        positions = torch.arange(
            len(context) - 1, len(context) - 1 + len(continuation), device=engine.device
        )
        logits = engine.model.head_logits(hidden[positions, row][:, None])[0].float()  # [n, vocab]
        target = torch.tensor(continuation, device=engine.device)
        token_lp = torch.log_softmax(logits, dim=-1).gather(1, target[:, None])[:, 0]
        out.append(
            ScoreResult(
                logprob=float(token_lp.sum()),
                token_logprobs=token_lp.tolist(),
                is_greedy=bool((logits.argmax(-1) == target).all()),
            )
        )
    return out
