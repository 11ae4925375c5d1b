"""Batched, KV-cached PrefixLM decoding and continuation scoring on the megatron model.

The engine drives :class:`mimir_megatron.model.HRMTextModel` itself (its ``recurrence`` and
``head_logits``): no second copy of the model. A prompt is the PrefixLM prefix, processed in one
pass with bidirectional attention inside it (prefill); every generated token then attends to the
prompt and the tokens before it through the cache (:mod:`mimir_megatron.inference.kv_cache`).

Batching is step-level: a :class:`DecodeSession` holds the rows decoding under one (H, L)
schedule; requests added while it runs are prefilled at the start of the next step and join the
batch. ``generate`` and the server both drive sessions. With tensor parallelism every rank runs
the same calls (same requests, same seeds) and obtains the same tokens.
"""

from __future__ import annotations

import logging
import random
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
from mimir_kernels import PrefixLMLayout, build_layout

from mimir_megatron.batch import single_sample_batch
from mimir_megatron.chat import encode, render_chat
from mimir_megatron.inference.fast_stack import fast_stacks
from mimir_megatron.inference.kv_cache import KVCache
from mimir_megatron.inference.sampling import LOGPROBS_MODES, History, needs_processing, next_tokens
from mimir_megatron.inference.text import StreamingText, default_stop_ids
from mimir_megatron.inference.types import (
    GenerationRequest,
    GenerationResult,
    RowConstraint,
    ScoreResult,
    TokenEvent,
    TopLogprobs,
)

log = logging.getLogger(__name__)


class RequestError(ValueError):
    """A request the engine cannot serve; the message names the field (``field``: that field's
    name, when known; ``code``: a machine-readable reason such as ``context_length_exceeded``)."""

    def __init__(self, message: str, field: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.field, self.code = field, code


@dataclass
class EngineStats:
    prefill_tokens: int = 0
    prefill_seconds: float = 0.0
    decode_tokens: int = 0
    decode_seconds: float = 0.0

    def summary(self) -> str:
        def rate(n: int, s: float) -> str:
            return f"{n / s:,.0f} tokens/s" if s > 0 else "n/a"

        return (
            f"prefill {self.prefill_tokens:,} tokens ({rate(self.prefill_tokens, self.prefill_seconds)}), "
            f"decode {self.decode_tokens:,} tokens ({rate(self.decode_tokens, self.decode_seconds)})"
        )


class InferenceEngine:
    """Decoding and scoring for one model (any TP size; sequence parallelism is padded around).

    The L and H stacks run as :class:`~mimir_megatron.inference.fast_stack.FastStack` (the same
    weights without megatron's autograd machinery) wherever it applies; ``megatron_layers=True``
    runs megatron's modules instead (the reference). ``compile_decode=True`` runs decoding steps
    with static shapes through ``torch.compile`` (caches allocated to a power of two of the
    requests' prompt + new tokens, the whole allocation attended under a validity mask): one
    compile per (schedule, batch size, allocation), so it pays off for long generations of a
    steady batch (``docs/performance.md``) and is off by default.
    """

    def __init__(
        self,
        model,
        tokenizer=None,
        *,
        max_batch_size: int = 32,
        max_context: int | None = None,
        model_name: str = "mimir",
        seed: int = 0,
        megatron_layers: bool = False,
        compile_decode: bool = False,
        logprobs_mode: str = "raw",
    ) -> None:
        self.model = model.eval()
        # The stacks without megatron's per-call machinery (fast_stack.py) unless asked for
        # megatron's own modules (the reference in tests) or the model's setup is not covered.
        self._stacks = None if megatron_layers else fast_stacks(self.model)
        # Decoding steps with static shapes through torch.compile (see decode_step); off by
        # default: each (schedule, batch size, cache allocation) costs a compile.
        self._compiled_recurrence = (
            torch.compile(self.model.recurrence, dynamic=False) if compile_decode else None
        )
        if logprobs_mode not in LOGPROBS_MODES:
            raise ValueError(f"logprobs_mode must be one of {', '.join(LOGPROBS_MODES)}, "
                             f"got {logprobs_mode!r}")
        self.logprobs_mode = logprobs_mode
        """``raw``: returned log-probs are the model's; ``processed``: after penalties, the
        grammar's mask and the sampling filters (see :mod:`.sampling`)."""
        self.cfg = model.cfg
        self.tokenizer = tokenizer
        self.model_name = model_name
        self.max_batch_size = max_batch_size
        self.max_context = max_context or self.cfg.max_position_embeddings
        self.vocab_size = self.cfg.vocab_size
        self.trained_schedule = (self.cfg.h_cycles, self.cfg.l_cycles)
        self.cycle_limits: tuple[int, int] | None = None
        """Largest (H, L) a request may ask for; None: unbounded (the server sets it)."""
        self.default_stop_ids = default_stop_ids(tokenizer) if tokenizer is not None else ()
        self.device = next(model.parameters()).device
        self.stats = EngineStats()
        self._seeds = random.Random(seed)  # unseeded requests; identical on every TP rank
        # Sequence parallelism splits the sequence over TP ranks: inputs are padded to a multiple.
        self._seq_multiple = self.cfg.parallel.tensor_parallel_size if self.cfg.uses_sequence_parallel else 1

    # -- text helpers ----------------------------------------------------------------------------

    def _need_tokenizer(self):
        if self.tokenizer is None:
            raise RequestError("this model has no tokenizer: pass token ids, or load it with one")
        return self.tokenizer

    def encode(self, text: str) -> list[int]:
        return encode(self._need_tokenizer(), text)

    def decode(self, ids: list[int]) -> str:
        return self._need_tokenizer().decode(ids, skip_special_tokens=True)

    def render_chat(self, messages: list[dict], tools: list | None = None,
                    template_kwargs: dict | None = None) -> list[int]:
        return render_chat(self._need_tokenizer(), messages, tools, template_kwargs)

    def budget(self, request: GenerationRequest) -> int:
        """Tokens a request may generate: max_new_tokens, or less where the context ends first."""
        return min(request.params.max_new_tokens, self.max_context - len(request.prompt_ids))

    # -- checks ----------------------------------------------------------------------------------

    def schedule(self, h_cycles: int | None, l_cycles: int | None) -> tuple[int, int]:
        """The (H, L) schedule of a request (None: the trained one), checked: at least 1 each,
        and at most :attr:`cycle_limits` where set (a server bounds what one request may cost)."""
        h = self.cfg.h_cycles if h_cycles is None else h_cycles
        low = self.cfg.l_cycles if l_cycles is None else l_cycles
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
                    f"than the shortest reply the grammar (response format or forced tool call) "
                    f"allows: {shortest}", "max_new_tokens")

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

    # -- generation ------------------------------------------------------------------------------

    def open_session(self, h_cycles: int | None = None, l_cycles: int | None = None) -> "DecodeSession":
        return DecodeSession(self, *self.schedule(h_cycles, l_cycles))

    def generate(self, requests: list[GenerationRequest], progress: bool = False) -> list[GenerationResult]:
        """Results in request order; requests of one schedule decode together."""
        for r in requests:
            self.check_request(r)
        results: list[GenerationResult | None] = [None] * len(requests)
        groups: dict[tuple[int, int], list[int]] = {}
        for i, r in enumerate(requests):
            groups.setdefault(self.schedule(r.h_cycles, r.l_cycles), []).append(i)
        bar = None
        if progress:
            from tqdm import tqdm

            bar = tqdm(total=len(requests), desc="generate", unit="req")
        for (h, low), members in groups.items():
            session = DecodeSession(self, h, low)
            # Similar lengths are prefilled together: less padding.
            handles = {
                session.add(requests[i]): i
                for i in sorted(members, key=lambda i: len(requests[i].prompt_ids))
            }
            while session.active:
                for event in session.step():
                    if event.finished:
                        results[handles[event.handle]] = event.result
                        if bar is not None:
                            bar.update(1)
        if bar is not None:
            bar.close()
        return results  # type: ignore[return-value]

    # -- scoring ---------------------------------------------------------------------------------

    @torch.no_grad()
    def score(
        self,
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
        plan = self._plan(*self.schedule(h_cycles, l_cycles))
        if bidirectional_tokens is None:
            bidirectional_tokens = [None] * len(pairs)
        if len(bidirectional_tokens) != len(pairs):
            raise RequestError(
                f"bidirectional_tokens has {len(bidirectional_tokens)} entries for {len(pairs)} pairs",
                "bidirectional_tokens",
            )
        for (context, continuation), bidirectional in zip(pairs, bidirectional_tokens):
            self.check_pair(context, continuation, bidirectional)
        order = sorted(range(len(pairs)), key=lambda i: len(pairs[i][0]) + len(pairs[i][1]))
        results: list[ScoreResult | None] = [None] * len(pairs)
        for start in range(0, len(order), self.max_batch_size):
            chunk = order[start : start + self.max_batch_size]
            chunk_pairs = [pairs[i] for i in chunk]
            chunk_bidirectional = [bidirectional_tokens[i] for i in chunk]
            for i, res in zip(chunk, self._score_batch(chunk_pairs, chunk_bidirectional, plan)):
                results[i] = res
        return results  # type: ignore[return-value]

    def _score_batch(self, pairs, bidirectional_tokens, plan) -> list[ScoreResult]:
        width = max(len(c) + len(x) - 1 for c, x in pairs)
        width += -width % self._seq_multiple
        batch = single_sample_batch([c for c, _ in pairs], [x for _, x in pairs], seq_len=width)
        for row, ((context, _), bidirectional) in enumerate(zip(pairs, bidirectional_tokens)):
            if bidirectional is not None:  # the context's tail is causal, like response text
                batch.prefix_mask[row, bidirectional : len(context)] = False
        batch = batch.to(self.device)
        layout = build_layout(self.model.attention_backend, batch.segment_ids, batch.prefix_mask)
        hidden = self.model.full_sequence(
            self.model.recurrence(batch.input_ids, batch.position_ids, layout, plan, stacks=self._stacks)
        )  # [s, b, h]
        out = []
        for row, (context, continuation) in enumerate(pairs):
            # Position len(context) - 1 + j predicts continuation[j].
            positions = torch.arange(
                len(context) - 1, len(context) - 1 + len(continuation), device=self.device
            )
            logits = self.model.head_logits(hidden[positions, row][:, None])[0].float()  # [n, vocab]
            target = torch.tensor(continuation, device=self.device)
            token_lp = torch.log_softmax(logits, dim=-1).gather(1, target[:, None])[:, 0]
            out.append(
                ScoreResult(
                    logprob=float(token_lp.sum()),
                    token_logprobs=token_lp.tolist(),
                    is_greedy=bool((logits.argmax(-1) == target).all()),
                )
            )
        return out

    # -- forward passes used by sessions ---------------------------------------------------------

    def _plan(self, h: int, low: int):
        return self.model.window_plan(1, h, low)  # no gradients anywhere (run under no_grad)

    def _pad_width(self, width: int) -> int:
        return width + (-width % self._seq_multiple)

    @torch.no_grad()
    def prefill(self, prompts: list[list[int]], plan, capacity: int = 0) -> tuple[KVCache, torch.Tensor]:
        """Left-padded prompts in one bidirectional pass; a fresh cache (``capacity`` positions
        allocated up front) and ``[rows, vocab]`` fp32 logits of the token after each prompt."""
        rows, width = len(prompts), self._pad_width(max(map(len, prompts)))
        ids = torch.zeros(rows, width, dtype=torch.long)
        positions = torch.zeros_like(ids)
        real = torch.zeros(rows, width, dtype=torch.bool)
        for r, prompt in enumerate(prompts):
            n = len(prompt)
            ids[r, width - n :] = torch.tensor(prompt)
            positions[r, width - n :] = torch.arange(n)
            real[r, width - n :] = True
        ids, positions, real = ids.to(self.device), positions.to(self.device), real.to(self.device)
        layout = build_layout(self.model.attention_backend, real.long(), real)
        cache = KVCache(rows, self.device, capacity=self._pad_width(max(capacity, width)))
        start = time.perf_counter()
        hidden = self.model.full_sequence(
            self.model.recurrence(ids, positions, layout, plan, kv_cache=cache, stacks=self._stacks)
        )
        cache.advance(real)
        logits = self.model.head_logits(hidden[-1:])[:, 0].float()  # left padding: all rows end last
        self.stats.prefill_tokens += sum(map(len, prompts))
        self.stats.prefill_seconds += time.perf_counter() - start
        return cache, logits

    @torch.no_grad()
    def decode_step(
        self, cache: KVCache, tokens: torch.Tensor, positions: torch.Tensor, plan
    ) -> torch.Tensor:
        """One new token per row through the cache; ``[rows, vocab]`` fp32 logits of the next."""
        rows, width = len(tokens), self._pad_width(1)
        ids = torch.zeros(rows, width, dtype=torch.long, device=self.device)
        pos = torch.zeros_like(ids)
        ids[:, 0], pos[:, 0] = tokens, positions
        valid = torch.zeros(rows, width, dtype=torch.bool, device=self.device)
        valid[:, 0] = True
        start = time.perf_counter()
        if self._compiled_recurrence is not None and width == 1 and cache.can_step_static():
            # Static shapes: the whole allocated cache, a tensor write index; one compiled graph
            # per (schedule, batch size, allocation).
            layout = PrefixLMLayout("dense", dense_mask=cache.static_attention_mask())
            with cache.static_step():
                hidden = self._compiled_recurrence(
                    ids, pos, layout, plan, kv_cache=cache, stacks=self._stacks
                )
        else:
            layout = PrefixLMLayout("dense", dense_mask=cache.attention_mask(valid))
            hidden = self.model.recurrence(ids, pos, layout, plan, kv_cache=cache, stacks=self._stacks)
        hidden = self.model.full_sequence(hidden)
        cache.advance(valid)
        logits = self.model.head_logits(hidden[:1])[:, 0].float()
        self.stats.decode_tokens += rows
        self.stats.decode_seconds += time.perf_counter() - start
        return logits


@dataclass
class _Row:
    handle: int
    request: GenerationRequest
    stops: frozenset[int]
    generator: torch.Generator | None
    text: StreamingText | None
    constraint: RowConstraint | None = None
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    top_logprobs: list[TopLogprobs] = field(default_factory=list)

    @property
    def next_position(self) -> int:  # of the last sampled token, which the next step feeds
        return len(self.request.prompt_ids) + len(self.tokens) - 1


class DecodeSession:
    """The rows decoding under one schedule; requests join at step boundaries."""

    def __init__(self, engine: InferenceEngine, h_cycles: int, l_cycles: int) -> None:
        self.engine = engine
        self.schedule = (h_cycles, l_cycles)
        self._plan = engine._plan(h_cycles, l_cycles)
        self._rows: list[_Row] = []  # in cache row order
        self._pending: list[_Row] = []
        self._cache: KVCache | None = None
        self._next_handle = 0

    @property
    def active(self) -> int:
        return len(self._rows) + len(self._pending)

    @property
    def capacity_left(self) -> int:
        return max(0, self.engine.max_batch_size - self.active)

    def add(self, request: GenerationRequest) -> int:
        """Queue a request; it is prefilled at the start of the next step. Returns its handle."""
        engine = self.engine
        engine.check_request(request)
        if engine.schedule(request.h_cycles, request.l_cycles) != self.schedule:
            raise RequestError("request schedule differs from this session's")
        p = request.params
        stops = frozenset(p.stop_token_ids) | (
            frozenset(engine.default_stop_ids) if p.use_default_stops else frozenset()
        )
        generator = None
        if p.temperature > 0:
            generator = torch.Generator().manual_seed(
                p.seed if p.seed is not None else engine._seeds.getrandbits(63)
            )
        text = None
        if engine.tokenizer is not None:
            text = StreamingText(engine.tokenizer, p.stop_strings, p.skip_special_tokens)
        constraint = None
        if request.constraint is not None:
            constraint = request.constraint.start(engine.budget(request))
        row = _Row(self._next_handle, request, stops, generator, text, constraint)
        self._next_handle += 1
        self._pending.append(row)
        return row.handle

    def cancel(self, handle: int) -> bool:
        """Drop a request that is waiting or decoding (its client has gone); False if unknown."""
        if any(r.handle == handle for r in self._pending):
            self._pending = [r for r in self._pending if r.handle != handle]
            return True
        if any(r.handle == handle for r in self._rows):
            self._drop_finished({handle})
            return True
        return False

    def step(self) -> list[TokenEvent]:
        """Prefill the waiting requests (their first token), then one decoding step for the rows
        that were already decoding. Finished rows leave the batch."""
        events: list[TokenEvent] = []
        decoding = list(self._rows)
        if decoding:
            tokens = torch.tensor([r.tokens[-1] for r in decoding], device=self.engine.device)
            positions = torch.tensor([r.next_position for r in decoding], device=self.engine.device)
            logits = self.engine.decode_step(self._cache, tokens, positions, self._plan)
            events += self._emit(decoding, logits)
        joining = self._pending[: max(0, self.engine.max_batch_size - len(self._rows))]
        if joining:
            self._pending = self._pending[len(joining) :]
            capacity = 0  # eager: the cache doubles as needed (a row may stop long before its limit)
            if self.engine._compiled_recurrence is not None:
                # Static shapes: allocated once for the rows' prompt + new tokens, rounded to a
                # power of two (few allocations, few compiles).
                need = max(len(r.request.prompt_ids) + r.request.params.max_new_tokens for r in joining)
                capacity = min(self.engine.max_context, max(64, 1 << (need - 1).bit_length()))
            cache, logits = self.engine.prefill([r.request.prompt_ids for r in joining], self._plan, capacity)
            if self._cache is None:
                self._cache = cache
            else:
                self._cache.merge(cache)
            self._rows += joining
            events += self._emit(joining, logits)
        self._drop_finished({e.handle for e in events if e.finished})
        return events

    def _emit(self, rows: list[_Row], logits: torch.Tensor) -> list[TokenEvent]:
        params = [r.request.params for r in rows]
        generators = [r.generator for r in rows]
        histories = [History(r.request.prompt_ids, r.tokens, r.stops) if needs_processing(r.request.params)
                     else None for r in rows]
        allowed = None
        if any(r.constraint is not None for r in rows):  # per-row Python only when a grammar is there
            allowed = torch.ones(logits.shape, dtype=torch.bool)
            for i, row in enumerate(rows):
                if row.constraint is not None:
                    row.constraint.allowed(allowed[i])
            allowed = allowed.to(logits.device)
        mode = self.engine.logprobs_mode
        chosen, all_logprobs = next_tokens(logits, params, generators, allowed, histories, mode)
        # A grammar refuses a token that would leave its reply unfinishable within the budget: the
        # row chooses again without it (after three refusals, the completion's next token).
        refused = [i for i, r in enumerate(rows) if r.constraint is not None
                   and not r.constraint.accept(int(chosen[i]))]
        for attempt in range(4):
            if not refused:
                break
            for i in refused:
                allowed[i, chosen[i]] = False
                fallback = rows[i].constraint.fallback
                if (attempt == 2 or not allowed[i].any()) and fallback is not None:
                    allowed[i] = False
                    allowed[i, fallback] = True
            sub = torch.tensor(refused, device=logits.device)
            again, again_logprobs = next_tokens(logits[sub], [params[i] for i in refused],
                                                [generators[i] for i in refused], allowed[sub],
                                                [histories[i] for i in refused], mode)
            chosen[sub] = again
            if mode == "processed":
                all_logprobs[sub] = again_logprobs
            refused = [i for i in refused if not rows[i].constraint.accept(int(chosen[i]))]
        for i in refused:  # never expected: a fallback is always accepted
            raise RuntimeError(f"the grammar of row {rows[i].handle} accepts no token")
        logprobs = all_logprobs.gather(1, chosen[:, None])[:, 0]
        k = max(r.request.params.top_logprobs for r in rows)
        top = None
        if k:
            values, indices = torch.topk(all_logprobs, k, dim=-1)
            top = [list(zip(i, v)) for i, v in zip(indices.tolist(), values.tolist())]
        events = []
        for i, (row, token, lp) in enumerate(zip(rows, chosen.tolist(), logprobs.tolist())):
            row.tokens.append(token)
            row.logprobs.append(lp)
            row_top = None
            if row.request.params.top_logprobs:
                row_top = top[i][: row.request.params.top_logprobs]
                row.top_logprobs.append(row_top)
            reason = self._finish_reason(row, token)
            delta = None
            if row.text is not None:
                ids = row.tokens[:-1] if token in row.stops else row.tokens
                searching = len(row.tokens) >= row.request.params.min_tokens  # vLLM: stop strings too
                delta = row.text.update(ids, final=reason is not None, search=searching)
                if row.text.stopped:
                    reason = "stop"
            result = None
            if reason is not None:
                result = GenerationResult(
                    list(row.request.prompt_ids),
                    list(row.tokens),
                    row.text.text if row.text is not None else None,
                    list(row.logprobs),
                    reason,
                    list(row.top_logprobs) if row.request.params.top_logprobs else None,
                )
            events.append(
                TokenEvent(row.handle, token, lp, delta, reason is not None, reason, result, row_top)
            )
        return events

    def _finish_reason(self, row: _Row, token: int) -> str | None:
        if token in row.stops or (row.constraint is not None and row.constraint.done):
            return "stop"
        if len(row.tokens) >= row.request.params.max_new_tokens:
            return "length"
        if len(row.request.prompt_ids) + len(row.tokens) >= self.engine.max_context:
            return "length"
        return None

    def _drop_finished(self, finished: set[int]) -> None:
        if not finished:
            return
        keep = [i for i, r in enumerate(self._rows) if r.handle not in finished]
        self._rows = [self._rows[i] for i in keep]
        self._cache.select_rows(torch.tensor(keep, dtype=torch.long))
        if not self._rows:
            self._cache = None
