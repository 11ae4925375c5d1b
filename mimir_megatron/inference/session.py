"""Decoding sessions: the rows that decode together under one (H, L) schedule, joining at step
boundaries. A session drives the engine through its public surface (``plan``, ``new_cache``,
``forward``, ``release_cache`` once its rows have all left, ``next_seed``, ``limits``);
``generate`` and the server's scheduler drive sessions."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from mimir_megatron.inference.kv_cache import KVCache
from mimir_megatron.inference.requests import RequestError
from mimir_megatron.inference.surface import EngineSurface
from mimir_megatron.inference.sampling import History, needs_processing, next_tokens
from mimir_megatron.inference.text import StreamingText
from mimir_megatron.inference.types import (
    GenerationRequest,
    GenerationResult,
    RowConstraint,
    TokenEvent,
    TopLogprobs,
)

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

    def __init__(self, engine: EngineSurface, h_cycles: int, l_cycles: int) -> None:
        self.engine = engine
        self.schedule = (h_cycles, l_cycles)
        self._plan = engine.plan(h_cycles, l_cycles)
        self._rows: list[_Row] = []  # in cache row order (rows that leave: the last ones move up)
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
        engine.limits.check_request(request)
        if engine.limits.schedule(request.h_cycles, request.l_cycles) != self.schedule:
            raise RequestError("request schedule differs from this session's")
        p = request.params
        stops = frozenset(p.stop_token_ids) | (
            frozenset(engine.default_stop_ids) if p.use_default_stops else frozenset()
        )
        generator = None
        if p.temperature > 0:
            generator = torch.Generator().manual_seed(
                p.seed if p.seed is not None else engine.next_seed()
            )
        text = None
        if engine.tokenizer is not None:
            # Stop strings apply to free text: a grammar's reply (JSON, a tool call) is never cut
            # into something that does not parse; it ends when the grammar completes.
            stop_strings = () if request.constraint is not None else p.stop_strings
            text = StreamingText(engine.tokenizer, stop_strings, p.skip_special_tokens)
        constraint = None
        if request.constraint is not None:
            constraint = request.constraint.start(engine.limits.budget(request))
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
        """One forward pass: a token for every decoding row and the first token of every waiting
        request that fits the batch (its prompt prefilled in the same pass). Finished rows leave."""
        decoding = list(self._rows)
        joining = self._pending[: max(0, self.engine.max_batch_size - len(self._rows))]
        self._pending = self._pending[len(joining) :]
        joining.sort(key=lambda r: len(r.request.prompt_ids))  # equal lengths: one attention call
        if not decoding and not joining:
            return []
        if self._cache is None:
            capacity = 0  # eager: the cache doubles as needed (a row may stop long before its limit)
            if self.engine.static_decode_shapes:  # CUDA graphs: room for the rows' prompt + new tokens
                need = max(len(r.request.prompt_ids) + r.request.params.max_new_tokens for r in joining)
                capacity = min(self.engine.limits.max_context, max(64, 1 << (need - 1).bit_length()))
            self._cache = self.engine.new_cache(capacity)
        logits = self.engine.forward(self._cache, [r.tokens[-1] for r in decoding],
                                     [r.request.prompt_ids for r in joining], self._plan)
        self._rows += joining
        events = self._emit(self._rows, logits)
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
        if len(row.request.prompt_ids) + len(row.tokens) >= self.engine.limits.max_context:
            return "length"
        return None

    def _drop_finished(self, finished: set[int]) -> None:
        if not finished:
            return
        order = self._cache.remove([i for i, r in enumerate(self._rows) if r.handle in finished])
        self._rows = [self._rows[i] for i in order]
        if not self._rows:
            self.engine.release_cache(self._cache)
            self._cache = None
