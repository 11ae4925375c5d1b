"""What callers hand the inference engine and what it returns."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Protocol

import torch


SEED_MIN, SEED_MAX = -(2**63), 2**64 - 1
"""The seeds torch's generator takes."""


@dataclass(frozen=True)
class SamplingParams:
    max_new_tokens: int = 256
    temperature: float = 0.0
    """0 decodes greedily (argmax); otherwise logits are divided by it before sampling."""
    top_k: int = 0
    """Sample among the k most likely tokens only; 0 = off."""
    top_p: float = 1.0
    """Nucleus sampling: the smallest set of most likely tokens whose probability reaches top_p."""
    seed: int | None = None
    """Makes sampling reproducible for this request (independent of the rest of the batch)."""
    stop_token_ids: tuple[int, ...] = ()
    """Added to the engine's default stop ids (the tokenizer's end-of-turn / eos tokens)."""
    stop_strings: tuple[str, ...] = ()
    """Generation stops when the text contains one; the text is cut before it."""
    use_default_stops: bool = True
    """Whether the engine's default stop ids apply."""
    top_logprobs: int = 0
    """Also return the k most likely tokens and their log-probabilities at each step (k <= 20)."""
    min_p: float = 0.0
    """Drop tokens whose probability is below min_p times the most likely token's (vLLM's)."""
    frequency_penalty: float = 0.0
    """Subtracted from a token's logit once per time it occurs in the output so far."""
    presence_penalty: float = 0.0
    """Subtracted from a token's logit once if it occurs in the output so far."""
    repetition_penalty: float = 1.0
    """Tokens of the prompt and output so far: positive logits divided by it, negative multiplied."""
    logit_bias: tuple[tuple[int, float], ...] = ()
    """(token id, bias) pairs added to the logits."""
    min_tokens: int = 0
    """Stop tokens and stop strings take effect only after this many generated tokens."""
    skip_special_tokens: bool = True
    """Whether the returned text leaves out special tokens."""

    def errors(self) -> list[str]:
        """One message per invalid field (empty when valid)."""
        out = []
        if self.seed is not None and not (isinstance(self.seed, int) and SEED_MIN <= self.seed <= SEED_MAX):
            out.append(f"seed must be an integer in [-2**63, 2**64 - 1], got {self.seed!r}")
        if not isinstance(self.max_new_tokens, int) or self.max_new_tokens < 1:
            out.append(f"max_new_tokens must be an integer >= 1, got {self.max_new_tokens!r}")
        if not 0 <= self.temperature < math.inf:
            out.append(f"temperature must be a finite number >= 0, got {self.temperature!r}")
        if not isinstance(self.top_k, int) or self.top_k < 0:
            out.append(f"top_k must be an integer >= 0, got {self.top_k!r}")
        if not 0 < self.top_p <= 1:
            out.append(f"top_p must be in (0, 1], got {self.top_p!r}")
        if any(not s for s in self.stop_strings):
            out.append("stop strings must not be empty")
        if not isinstance(self.top_logprobs, int) or not 0 <= self.top_logprobs <= 20:
            out.append(f"top_logprobs must be an integer in [0, 20], got {self.top_logprobs!r}")
        if not 0 <= self.min_p <= 1:
            out.append(f"min_p must be in [0, 1], got {self.min_p!r}")
        for name in ("frequency_penalty", "presence_penalty"):
            if not -2 <= getattr(self, name) <= 2:
                out.append(f"{name} must be in [-2, 2], got {getattr(self, name)!r}")
        if not 0 < self.repetition_penalty < math.inf:
            out.append(f"repetition_penalty must be a finite number > 0, got {self.repetition_penalty!r}")
        outside = [(token, bias) for token, bias in self.logit_bias if not -100 <= bias <= 100]
        if outside:
            out.append(f"logit_bias values must be in [-100, 100], got {outside[0][1]!r} for token "
                       f"{outside[0][0]}")
        if not isinstance(self.min_tokens, int) or not 0 <= self.min_tokens <= self.max_new_tokens:
            out.append(f"min_tokens must be an integer in [0, max_new_tokens={self.max_new_tokens}], "
                       f"got {self.min_tokens!r}")
        return out


class RowConstraint(Protocol):
    """One row's decoding constraint (a grammar's state): the engine masks the row's logits to the
    allowed tokens before choosing, then reports the chosen token."""

    def allowed(self, out: torch.Tensor) -> None:
        """Fill a ``[vocab]`` bool tensor: True where a token may come next."""

    def accept(self, token: int) -> bool:
        """Take the chosen token, or refuse it (False: state unchanged; the engine chooses again
        without it) when the row could no longer finish within its budget."""

    @property
    def fallback(self) -> int | None:
        """A token :meth:`accept` never refuses (None: any allowed token will do)."""

    @property
    def done(self) -> bool:
        """Nothing more may follow: the row finishes (``stop``)."""


class Constraint(Protocol):
    """What a request carries: a fresh :class:`RowConstraint` per decoded row."""

    def start(self, budget: int) -> RowConstraint:
        """The state of a row that may generate at most ``budget`` tokens."""

    def min_tokens(self, budget: int) -> int | None:
        """Tokens the shortest constrained reply takes; None when more than ``budget``."""


@dataclass(frozen=True)
class GenerationRequest:
    prompt_ids: list[int]
    params: SamplingParams = field(default_factory=SamplingParams)
    h_cycles: int | None = None
    """Schedule for this request; default: the one the weights were trained with."""
    l_cycles: int | None = None
    constraint: Constraint | None = None
    """Structured output: the tokens each step may choose (see :mod:`.grammar`); None: any."""


TopLogprobs = list[tuple[int, float]]
"""The k most likely (token id, log-probability) pairs at one step, most likely first."""


@dataclass
class GenerationResult:
    prompt_ids: list[int]
    token_ids: list[int]
    """Generated ids; the stop token is included when one ended generation."""
    text: str | None
    """Decoded generated text (special tokens and a matched stop string removed); None without a
    tokenizer."""
    logprobs: list[float]
    """Log-probability of each generated token under the model (temperature 1, no filtering)."""
    finish_reason: str
    """``stop`` (a stop token or string, or a completed grammar) or ``length`` (max_new_tokens or
    the context limit)."""
    top_logprobs: list[TopLogprobs] | None = None
    """Per generated token, when ``top_logprobs`` was asked for."""


@dataclass
class ScoreResult:
    logprob: float
    """Sum of the continuation tokens' log-probabilities given the context."""
    token_logprobs: list[float]
    is_greedy: bool
    """Whether greedy decoding from the context produces the continuation."""


@dataclass
class TokenEvent:
    """One generated token of one request, as a decoding step produces it (for streaming)."""

    handle: int
    token_id: int
    logprob: float
    text: str | None
    """Text this token adds ("" while it completes no character or may start a stop string)."""
    finished: bool
    finish_reason: str | None
    result: GenerationResult | None
    """The whole result, on the request's last event."""
    top_logprobs: TopLogprobs | None = None
