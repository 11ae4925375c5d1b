"""Choosing the next token from a row's logits, with vLLM's sampling semantics.

Per row, in vLLM's order: the grammar's mask; ``min_tokens`` (the row's stop tokens are
forbidden until it has generated that many); ``logit_bias`` (added); ``repetition_penalty``
(every token of the prompt and the output so far: a positive logit divided by it, a negative one
multiplied); ``frequency_penalty`` and ``presence_penalty`` (output tokens: minus the penalty
times the token's count, minus the penalty once if it occurred). Then greedy (argmax), or
temperature, ``min_p`` (tokens below ``min_p`` times the most likely token's probability
dropped), top-k, top-p, and a draw from the row's own generator.

A row that sets none of these fields is not touched: its logits, and so its token, are exactly
those it would have decoding alone, whatever the other rows of the batch ask for.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from mimir_megatron.inference.types import SamplingParams

LOGPROBS_MODES = ("raw", "processed")
"""What returned log-probs are: ``raw``, the model's (temperature 1, nothing applied); or
``processed``, of the distribution the token was drawn from (vLLM's ``processed_logprobs``)."""


@dataclass(frozen=True)
class History:
    """What a row's penalties look at: its prompt, what it has generated, its stop tokens."""

    prompt: list[int]
    output: list[int]
    stops: frozenset[int] = frozenset()


def needs_processing(p: SamplingParams) -> bool:
    return bool(p.min_tokens or p.logit_bias or p.repetition_penalty != 1.0 or p.frequency_penalty
                or p.presence_penalty)


def processed_logits(logits: torch.Tensor, p: SamplingParams, history: History) -> torch.Tensor:
    """``[vocab]`` logits of one row after min_tokens, logit_bias and the penalties."""
    out = logits.clone()
    vocab = out.numel()
    if p.min_tokens and len(history.output) < p.min_tokens and history.stops:
        out[torch.tensor(sorted(s for s in history.stops if s < vocab), dtype=torch.long)] = float("-inf")
    if p.logit_bias:
        ids = torch.tensor([t for t, _ in p.logit_bias], dtype=torch.long)
        out.index_add_(0, ids.to(out.device), torch.tensor([b for _, b in p.logit_bias], dtype=out.dtype,
                                                           device=out.device))
    if p.repetition_penalty != 1.0:
        seen = torch.tensor(sorted(set(history.prompt) | set(history.output)), dtype=torch.long,
                            device=out.device)
        if len(seen):
            values = out[seen]
            out[seen] = torch.where(values > 0, values / p.repetition_penalty, values * p.repetition_penalty)
    if (p.frequency_penalty or p.presence_penalty) and history.output:
        counts = torch.bincount(torch.tensor(history.output, dtype=torch.long), minlength=vocab).to(out)
        out -= p.frequency_penalty * counts + p.presence_penalty * (counts > 0).to(out)
    return out


def filtered_logits(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """``[vocab]`` logits scaled by the temperature with tokens outside min-p / top-k / top-p at -inf."""
    scaled = logits / params.temperature
    if params.min_p > 0:
        probs = torch.softmax(scaled, dim=-1)
        scaled = scaled.masked_fill(probs < params.min_p * probs.max(), float("-inf"))
    if params.top_k and params.top_k < scaled.numel():
        kth = torch.topk(scaled, params.top_k).values[-1]
        scaled = scaled.masked_fill(scaled < kth, float("-inf"))
    if params.top_p < 1.0:
        order = torch.argsort(scaled, descending=True)
        probs = torch.softmax(scaled[order], dim=-1)
        # Keep a token if the tokens before it hold less than top_p: the most likely always stays.
        before = torch.cumsum(probs, dim=-1) - probs
        drop = order[before >= params.top_p]
        scaled = scaled.index_fill(0, drop, float("-inf"))
    return scaled


def next_tokens(
    logits: torch.Tensor,
    params: list[SamplingParams],
    generators: list[torch.Generator | None],
    allowed: torch.Tensor | None = None,
    histories: list[History | None] | None = None,
    logprobs_mode: str = "raw",
) -> tuple[torch.Tensor, torch.Tensor]:
    """Next token of each row of ``[rows, vocab]`` fp32 logits, and ``[rows, vocab]``
    log-probabilities: the model's (``logprobs_mode`` raw: temperature 1, nothing applied) or
    those of the distribution each row chose from (``processed``).

    Greedy rows are decided together; sampled rows draw from their own CPU generator, so a
    seeded request gives the same tokens whatever else is in the batch. ``allowed`` (``[rows,
    vocab]`` bool, structured output) restricts each row's choice; None: no restriction.
    ``histories`` (per row; needed by rows with penalties or ``min_tokens``) feed the penalties.
    """
    raw = logits
    if allowed is not None:
        logits = logits.masked_fill(~allowed, float("-inf"))
    rows = [i for i, p in enumerate(params) if needs_processing(p)]
    if rows:
        logits = logits.clone()
        for i in rows:
            logits[i] = processed_logits(logits[i], params[i], histories[i])
    chosen = logits.argmax(dim=-1)
    final = logits.clone() if logprobs_mode == "processed" else None
    for row, (p, gen) in enumerate(zip(params, generators)):
        if p.temperature > 0:
            kept = filtered_logits(logits[row], p)
            if final is not None:
                final[row] = kept
            probs = torch.softmax(kept, dim=-1).cpu()
            chosen[row] = torch.multinomial(probs, 1, generator=gen).item()
    return chosen, torch.log_softmax(raw if final is None else final, dim=-1)
