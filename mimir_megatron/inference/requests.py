"""Request validation: whether the engine can serve a request, and the field to blame when not.

One owner for every check of what a caller sends (token ids in the vocabulary, the context
length, the (H, L) schedule and its bounds, the sampling parameters, a grammar's shortest reply
within the budget): the engine, ``mimir generate``, the server and lm-eval's client all call
:class:`RequestLimits`. A refusal is a :class:`RequestError` whose ``field`` and ``code`` the
server turns into OpenAI's error object.
"""

from __future__ import annotations

from dataclasses import dataclass

from mimir_megatron.inference.types import GenerationRequest


class RequestError(ValueError):
    """A request the engine cannot serve; the message names the field (``field``: that field's
    name, when known; ``code``: a machine-readable reason such as ``context_length_exceeded``)."""

    def __init__(self, message: str, field: str | None = None, code: str | None = None,
                 minimum: int | None = None) -> None:
        super().__init__(message)
        self.field, self.code = field, code
        self.minimum = minimum
        """The smallest value ``field`` could take here, where the refusal is that it is too small."""


@dataclass
class RequestLimits:
    """What one model can serve: its vocabulary, its context and its trained (H, L) schedule."""

    vocab_size: int
    max_context: int
    """Positions a request may use: prompt + generated tokens, or context + continuation."""
    trained_schedule: tuple[int, int]
    cycle_limits: tuple[int, int] | None = None
    """Largest (H, L) a request may ask for; None: unbounded (the server sets it)."""

    def budget(self, request: GenerationRequest) -> int:
        """Tokens a request may generate: max_new_tokens, or less where the context ends first."""
        return min(request.params.max_new_tokens, self.max_context - len(request.prompt_ids))

    def schedule(self, h_cycles: int | None, l_cycles: int | None) -> tuple[int, int]:
        """The (H, L) schedule of a request (None: the trained one), checked: at least 1 each,
        and at most :attr:`cycle_limits` where set (a server bounds what one request may cost)."""
        h = self.trained_schedule[0] if h_cycles is None else h_cycles
        low = self.trained_schedule[1] if l_cycles is None else l_cycles
        limits = self.cycle_limits or (None, None)
        for name, value, limit in (("h_cycles", h, limits[0]), ("l_cycles", low, limits[1])):
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise RequestError(f"{name} must be an integer >= 1, got {value!r}", name)
            if limit is not None and value > limit:
                raise RequestError(f"{name} must be at most {limit} here (the trained schedule is "
                                   f"{self.trained_schedule[0]}x{self.trained_schedule[1]}; mimir serve "
                                   "--max-cycles-factor sets the bound), got {value}", name)
        return h, low

    def check_request(self, request: GenerationRequest) -> None:
        """Raise :class:`RequestError` naming the first bad field."""
        errors = request.params.errors()
        if errors:
            raise RequestError(errors[0], errors[0].split(" ", 1)[0])
        self.check_ids(request.prompt_ids, "prompt")
        if len(request.prompt_ids) >= self.max_context:
            raise RequestError(
                f"prompt has {len(request.prompt_ids)} tokens; the context holds "
                f"{self.max_context} (prompt + generated)",
                "prompt",
                "context_length_exceeded",
            )
        self.schedule(request.h_cycles, request.l_cycles)
        bias_ids = [t for t, _ in request.params.logit_bias]
        if bias_ids:
            self.check_ids(bias_ids, "logit_bias")
        if request.constraint is not None:
            budget = self.budget(request)
            if request.constraint.min_tokens(budget) is None:
                need = request.constraint.min_tokens(self.max_context)
                shortest = f"{need} tokens" if need is not None else "more tokens than the context holds"
                raise RequestError(
                    f"max_new_tokens allows {budget} tokens (with the prompt, within the context), fewer "
                    f"than the shortest reply the grammar (response format or tool call) "
                    f"allows: {shortest}", "max_new_tokens", minimum=need)

    def check_fits(self, prompt_tokens: int, max_new_tokens: int) -> None:
        """A prompt and the tokens a client asked for must fit the context together (OpenAI's and
        vLLM's rule; a request that asks for no number is cut where the context ends)."""
        if prompt_tokens + max_new_tokens > self.max_context:
            raise RequestError(
                f"the model's context holds {self.max_context} tokens; the prompt ({prompt_tokens}) and "
                f"max_new_tokens ({max_new_tokens}) ask for {prompt_tokens + max_new_tokens}",
                "prompt", "context_length_exceeded")

    def check_pair(self, context: list[int], continuation: list[int],
                   bidirectional_tokens: int | None = None) -> None:
        """Raise :class:`RequestError` if a (context, continuation) pair cannot be scored with
        its first ``bidirectional_tokens`` context tokens bidirectional (None: all of them)."""
        if isinstance(context, (list, tuple)) and not context:
            # Position len(context) - 1 predicts continuation[0]: an empty context has none.
            raise RequestError(
                "context must hold at least one token (the one that predicts the first "
                "continuation token); to score a whole text causally, send a beginning-of-text "
                "token as the context",
                "context",
            )
        self.check_ids(context, "context")
        self.check_ids(continuation, "continuation")
        if bidirectional_tokens is not None and (
            not isinstance(bidirectional_tokens, int)
            or isinstance(bidirectional_tokens, bool)
            or not 0 <= bidirectional_tokens <= len(context)
        ):
            raise RequestError(
                f"bidirectional_tokens must be an integer in [0, {len(context)}] (the context "
                f"length) or null, got {bidirectional_tokens!r}",
                "bidirectional_tokens",
            )
        if len(context) + len(continuation) - 1 > self.max_context:
            raise RequestError(
                f"context + continuation have {len(context) + len(continuation)} "
                f"tokens; the context holds {self.max_context}",
                "continuation",
                "context_length_exceeded",
            )

    def check_ids(self, ids: list[int], name: str) -> None:
        if not isinstance(ids, (list, tuple)) or not ids:
            raise RequestError(f"{name} must be a non-empty list of token ids", name)
        bad = [
            t for t in ids if not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < self.vocab_size
        ]
        if bad:
            raise RequestError(
                f"{name} holds {bad[0]!r}, outside the vocabulary [0, {self.vocab_size})", name
            )
