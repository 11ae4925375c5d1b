"""Choosing the next token from a row's logits: greedy, or temperature / top-k / top-p sampling."""

from __future__ import annotations

import torch

from mimir_megatron.inference.types import SamplingParams


def filtered_logits(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """``[vocab]`` logits scaled by the temperature with tokens outside top-k / top-p at -inf."""
    scaled = logits / params.temperature
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
) -> tuple[torch.Tensor, torch.Tensor]:
    """Next token of each row of ``[rows, vocab]`` fp32 logits, and the ``[rows, vocab]`` model
    log-probabilities (temperature 1, no filtering, no mask: the convention of returned log-probs).

    Greedy rows are decided together; sampled rows draw from their own CPU generator, so a
    seeded request gives the same tokens whatever else is in the batch. ``allowed`` (``[rows,
    vocab]`` bool, structured output) restricts each row's choice; None: no restriction.
    """
    logprobs = torch.log_softmax(logits, dim=-1)
    if allowed is not None:
        logits = logits.masked_fill(~allowed, float("-inf"))
    chosen = logits.argmax(dim=-1)
    for row, (p, gen) in enumerate(zip(params, generators)):
        if p.temperature > 0:
            probs = torch.softmax(filtered_logits(logits[row], p), dim=-1).cpu()
            chosen[row] = torch.multinomial(probs, 1, generator=gen).item()
    return chosen, logprobs
