"""Sampling against hand-computed distributions: temperature, top-p, top-k.

The frequencies come from next_tokens itself (4,000 seeded draws, so the result is fixed), and
are compared with softmax(logits / T) restricted to the kept tokens, computed here by hand.
"""

from __future__ import annotations

import math

import pytest
import torch

from mimir_megatron.inference.sampling import filtered_logits, next_tokens
from mimir_megatron.inference.types import SamplingParams

DRAWS = 4000
# Probabilities .5 / .3 / .15 / .05 (the nucleus example: top_p .7 keeps tokens 0 and 1).
PROBS = torch.tensor([0.5, 0.3, 0.15, 0.05])
LOGITS = PROBS.log()


def frequencies(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    generator = torch.Generator().manual_seed(1234)
    rows = logits.expand(DRAWS, -1).contiguous()
    chosen, _ = next_tokens(rows, [params] * DRAWS, [generator] * DRAWS)
    return torch.bincount(chosen, minlength=logits.numel()).float() / DRAWS


def by_hand(probs: list[float], temperature: float, keep: list[int]) -> torch.Tensor:
    weights = [p ** (1 / temperature) if i in keep else 0.0 for i, p in enumerate(probs)]
    return torch.tensor([w / sum(weights) for w in weights])


@pytest.mark.parametrize("temperature", [0.5, 2.0])
def test_temperature_reshapes_the_distribution(temperature):
    """T = 0.5 sharpens (token 0: .5 -> .69), T = 2 flattens (token 3: .05 -> .13); a temperature
    applied after the softmax would leave .5/.3/.15/.05."""
    expected = by_hand(PROBS.tolist(), temperature, keep=[0, 1, 2, 3])
    got = frequencies(LOGITS, SamplingParams(temperature=temperature))
    assert (got - expected).abs().max() < 0.03, (got, expected)
    assert (got - PROBS).abs().max() > 0.1  # the draws could tell the two apart
    kept = filtered_logits(LOGITS, SamplingParams(temperature=temperature))
    torch.testing.assert_close(torch.softmax(kept, -1), expected)


def test_top_p_keeps_the_token_that_crosses_the_threshold():
    """.5 alone is less than .7, so the nucleus is {0, 1} (.8): the token crossing top_p stays."""
    params = SamplingParams(temperature=1.0, top_p=0.7)
    kept = filtered_logits(LOGITS, params)
    assert torch.isfinite(kept).tolist() == [True, True, False, False]
    got = frequencies(LOGITS, params)
    expected = by_hand(PROBS.tolist(), 1.0, keep=[0, 1])  # .625 / .375
    assert got[2:].sum() == 0 and (got - expected).abs().max() < 0.03, (got, expected)


@pytest.mark.parametrize("top_p, keep", [(0.3, [0]), (0.79, [0, 1]), (0.81, [0, 1, 2]), (1.0, [0, 1, 2, 3])])
def test_top_p_boundaries(top_p, keep):
    kept = filtered_logits(LOGITS, SamplingParams(temperature=1.0, top_p=top_p))
    assert torch.isfinite(kept).nonzero().flatten().tolist() == keep


def test_top_p_applies_to_the_tempered_distribution():
    """top_p .6: at T = 0.5 token 0 holds .69, enough alone; at T = 2 it holds .38 and token 1
    .29, so both stay (without the temperature: .5 + .3, also both)."""
    sharp = filtered_logits(LOGITS, SamplingParams(temperature=0.5, top_p=0.6))
    flat = filtered_logits(LOGITS, SamplingParams(temperature=2.0, top_p=0.6))
    assert torch.isfinite(sharp).tolist() == [True, False, False, False]
    assert torch.isfinite(flat).tolist() == [True, True, False, False]
    assert math.isclose(by_hand(PROBS.tolist(), 2.0, [0, 1, 2, 3])[:2].sum().item(), 0.673, abs_tol=1e-3)


def test_top_k_keeps_the_k_most_likely():
    params = SamplingParams(temperature=1.0, top_k=2)
    assert torch.isfinite(filtered_logits(LOGITS, params)).tolist() == [True, True, False, False]
    got = frequencies(LOGITS, params)
    assert got[2:].sum() == 0 and (got - by_hand(PROBS.tolist(), 1.0, [0, 1])).abs().max() < 0.03


def test_greedy_takes_the_argmax_and_reports_its_log_probability():
    chosen, logprobs = next_tokens(LOGITS[None], [SamplingParams(temperature=0.0)], [None])
    assert chosen.tolist() == [0]
    assert logprobs.shape == (1, LOGITS.numel())  # every token's log-prob (for top_logprobs)
    assert logprobs[0, chosen[0]].item() == pytest.approx(math.log(0.5), abs=1e-6)
