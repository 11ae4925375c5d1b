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


# -- vLLM's per-row processors, against the logits they must produce (computed here token by token) --

from mimir_megatron.inference.sampling import History, processed_logits  # noqa: E402


def _by_hand(logits: list[float], prompt: list[int], output: list[int], stops: set[int], *, rep=1.0, freq=0.0,
             pres=0.0, bias=(), min_tokens=0) -> list[float]:
    """vLLM's order, one token at a time: min_tokens, logit_bias, repetition, frequency, presence."""
    out = list(logits)
    for t in range(len(out)):
        if min_tokens and len(output) < min_tokens and t in stops:
            out[t] = float("-inf")
            continue
        out[t] += sum(b for token, b in bias if token == t)
        if t in prompt or t in output:
            out[t] = out[t] / rep if out[t] > 0 else out[t] * rep
        out[t] -= freq * output.count(t) + pres * (1 if t in output else 0)
    return out


CASES = {
    "frequency": dict(freq=0.7), "presence": dict(pres=1.3), "repetition": dict(rep=1.8),
    "logit_bias": dict(bias=((2, 5.0), (9, -100.0))), "min_tokens": dict(min_tokens=6),
    "all": dict(freq=-0.4, pres=0.5, rep=0.6, bias=((0, 2.5),), min_tokens=6),
}


@pytest.mark.parametrize("case", CASES)
def test_penalties_bias_and_min_tokens_give_vllms_logits(case):
    g = torch.Generator().manual_seed(7)
    logits = torch.randn(12, generator=g) * 3  # positive and negative logits
    prompt, output, stops = [1, 3, 3, 8], [3, 5, 5, 5, 11], {11, 6}
    kw = CASES[case]
    params = SamplingParams(frequency_penalty=kw.get("freq", 0.0), presence_penalty=kw.get("pres", 0.0),
                            repetition_penalty=kw.get("rep", 1.0), logit_bias=kw.get("bias", ()),
                            min_tokens=kw.get("min_tokens", 0))
    got = processed_logits(logits, params, History(prompt, output, frozenset(stops)))
    expected = torch.tensor(_by_hand(logits.tolist(), prompt, output, stops, **kw))
    assert torch.equal(torch.isinf(got), torch.isinf(expected))
    torch.testing.assert_close(got[~torch.isinf(got)], expected[~torch.isinf(expected)])
    assert not torch.equal(got, logits)  # each case changes something

    # processed log-probs are those of the processed logits; raw ones the model's
    chosen, raw = next_tokens(logits[None], [params], [None], None, [History(prompt, output, frozenset(stops))])
    _, processed = next_tokens(logits[None], [params], [None], None, [History(prompt, output, frozenset(stops))],
                               "processed")
    assert chosen.item() == int(expected.argmax())
    torch.testing.assert_close(raw[0], torch.log_softmax(logits, -1))
    torch.testing.assert_close(processed[0], torch.log_softmax(expected, -1))


def test_min_p_drops_tokens_below_a_fraction_of_the_most_likely():
    """.5 / .3 / .15 / .05 with min_p .25: the bar is .125, so token 3 goes; at T = 2 the
    probabilities flatten (.38 .29 .20 .12 ... recomputed here) before the bar applies."""
    kept = filtered_logits(LOGITS, SamplingParams(temperature=1.0, min_p=0.25))
    assert torch.isfinite(kept).tolist() == [True, True, True, False]
    flat = by_hand(PROBS.tolist(), 2.0, keep=[0, 1, 2, 3])
    bar = 0.4 * flat.max()
    kept = filtered_logits(LOGITS, SamplingParams(temperature=2.0, min_p=0.4))
    assert torch.isfinite(kept).tolist() == (flat >= bar).tolist()
    got = frequencies(LOGITS, SamplingParams(temperature=1.0, min_p=0.25))
    assert got[3] == 0 and (got - by_hand(PROBS.tolist(), 1.0, [0, 1, 2])).abs().max() < 0.03


def test_rows_without_processors_are_bit_for_bit_as_alone():
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(4, 50, generator=g)
    plain = [SamplingParams(), SamplingParams(temperature=0.8, seed=1)]
    busy = SamplingParams(frequency_penalty=2.0, repetition_penalty=1.5, logit_bias=((7, 30.0),), min_tokens=2)
    history = History([1, 2], [7, 7], frozenset({3}))
    params = [plain[0], busy, plain[1], busy]
    gens = [None, None, torch.Generator().manual_seed(9), None]
    chosen, logprobs = next_tokens(logits, params, gens, None, [None, history, None, history])
    for row, p in ((0, plain[0]), (2, plain[1])):
        gen = torch.Generator().manual_seed(9) if p.temperature else None
        alone, alone_lp = next_tokens(logits[row:row + 1], [p], [gen])
        assert chosen[row] == alone[0] and torch.equal(logprobs[row], alone_lp[0])
    assert chosen[1] != logits[1].argmax() or chosen[3] != logits[3].argmax()  # the busy rows did change
