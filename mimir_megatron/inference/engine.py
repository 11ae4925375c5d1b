"""The inference engine: batched, KV-cached PrefixLM decoding and continuation scoring on the
megatron model. Its jobs live beside it: request validation in :mod:`.requests`, decoding
sessions in :mod:`.session`, scoring in :mod:`.scoring`, the flattened generation step in
:mod:`.step`; this module holds the model's forward passes (a generation step, a whole batch)
and the entry points.

The engine drives :class:`mimir_megatron.model.HRMTextModel` itself (its ``recurrence`` and
``head_logits``): no second copy of the model. A prompt is the PrefixLM prefix, processed in one
pass with bidirectional attention inside it (prefill); every generated token then attends to the
prompt and the tokens before it through the cache (:mod:`mimir_megatron.inference.kv_cache`).

Batching is step-level: a :class:`DecodeSession` holds the rows decoding under one (H, L)
schedule; requests added while it runs are prefilled inside the next step (one forward pass with
the decoding rows' tokens) and join the batch. ``generate`` and the server both drive sessions.
With tensor parallelism every rank runs the same calls (same requests, same seeds) and obtains
the same tokens.
"""

from __future__ import annotations

import logging
import random
import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from mimir_kernels import PrefixLMLayout, build_layout

from mimir_megatron import backend
from mimir_megatron.chat import encode, render_chat
from mimir_megatron.inference import scoring
from mimir_megatron.inference.fast_stack import fast_stacks
from mimir_megatron.inference.kv_cache import KVCache
from mimir_megatron.inference.requests import RequestError, RequestLimits
from mimir_megatron.inference.sampling import LOGPROBS_MODES
from mimir_megatron.inference.session import DecodeSession
from mimir_megatron.inference.step import StepForward
from mimir_megatron.inference.text import default_stop_ids
from mimir_megatron.inference.types import GenerationRequest, GenerationResult, ScoreResult

__all__ = ["DecodeSession", "EngineStats", "InferenceEngine", "RequestError"]

log = logging.getLogger(__name__)


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
    runs megatron's modules instead (the reference). ``compile_decode=True`` runs decoding-only
    steps through ``torch.compile``: on CPU with dynamic shapes (one compile per schedule, for
    every batch size and length), on a GPU as CUDA graphs over static shapes (rows padded to a
    power of two, caches allocated up front, the whole allocation attended under a mask; a graph
    per schedule, allocation and padded row count); see
    :func:`~mimir_megatron.backend.decode_compile_options`. Off by default: the first decoding
    step of each schedule waits for its compile (``docs/performance.md``).
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
        # megatron's own modules (the reference in tests) or the model's setup is not covered;
        # generation steps as one flattened pass (step.py) under the same conditions.
        self._stacks = None if megatron_layers else fast_stacks(self.model)
        self._step = None if megatron_layers else StepForward.of(self.model, compile_decode)
        if compile_decode and self._step is None:
            raise ValueError("compile_decode needs the engine's flattened step (inference/step.py), which "
                             "does not run with megatron_layers, sequence parallelism, TE layers or FP8")
        self._compile_decode = compile_decode
        self._spare_cache: KVCache | None = None  # release_cache
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
        self.limits = RequestLimits(
            vocab_size=self.cfg.vocab_size, max_context=max_context or self.cfg.max_position_embeddings,
            trained_schedule=(self.cfg.h_cycles, self.cfg.l_cycles))
        """What a request may ask of this model; every check of a request goes through it."""
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

    # -- generation ------------------------------------------------------------------------------

    def open_session(self, h_cycles: int | None = None, l_cycles: int | None = None) -> "DecodeSession":
        return DecodeSession(self, *self.limits.schedule(h_cycles, l_cycles))

    def generate(self, requests: list[GenerationRequest], progress: bool = False) -> list[GenerationResult]:
        """Results in request order; requests of one schedule decode together."""
        for r in requests:
            self.limits.check_request(r)
        results: list[GenerationResult | None] = [None] * len(requests)
        groups: dict[tuple[int, int], list[int]] = {}
        for i, r in enumerate(requests):
            groups.setdefault(self.limits.schedule(r.h_cycles, r.l_cycles), []).append(i)
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

    def score(
        self,
        pairs: list[tuple[list[int], list[int]]],
        h_cycles: int | None = None,
        l_cycles: int | None = None,
        *,
        bidirectional_tokens: Sequence[int | None] | None = None,
    ) -> list[ScoreResult]:
        """Log-probability of each continuation given its context (see :func:`.scoring.score`)."""
        return scoring.score(self, pairs, h_cycles, l_cycles, bidirectional_tokens=bidirectional_tokens)

    # -- forward passes used by sessions ---------------------------------------------------------

    @property
    def max_context(self) -> int:
        return self.limits.max_context

    @property
    def step_forward(self) -> StepForward | None:
        """The flattened step (``inference/step.py``), or None where the model's own recurrence
        runs (megatron's layers, TE, FP8, sequence parallelism)."""
        return self._step

    def plan(self, h: int, low: int):
        """The window plan of an (H, L) schedule, without gradients (inference runs under no_grad)."""
        return self.model.window_plan(1, h, low)

    def next_seed(self) -> int:
        """A seed for a request that set none; the same sequence on every TP rank."""
        return self._seeds.getrandbits(63)

    def pad_width(self, width: int) -> int:
        """``width`` rounded up to what sequence parallelism splits evenly over the TP ranks."""
        return width + (-width % self._seq_multiple)

    def hidden_states(self, input_ids: torch.Tensor, position_ids: torch.Tensor, layout,
                      plan) -> torch.Tensor:
        """``[s, b, h]`` final hidden states of a whole batch in one pass (no cache)."""
        return self.model.full_sequence(
            self.model.recurrence(input_ids, position_ids, layout, plan, stacks=self._stacks))

    @property
    def static_decode_shapes(self) -> bool:
        """Whether decoding-only steps run compiled with static shapes (CUDA graphs,
        :func:`~mimir_megatron.backend.decode_compile_options`): sessions then allocate caches up
        front (:meth:`new_cache`'s ``capacity``), and the cache's buffers stay at one address."""
        return self._compile_decode and backend.uses_cuda_graphs(self.device)

    def new_cache(self, capacity: int = 0) -> KVCache:
        """An empty cache for a session's rows (see :meth:`forward`), ``capacity`` positions per
        row allocated at once (no growth, and so no new static graph, below it): the cache the
        last session handed back (:meth:`release_cache`) where there is one and no capacity is
        asked for, else a new one."""
        if capacity == 0 and self._spare_cache is not None:
            spare, self._spare_cache = self._spare_cache, None
            return spare
        return KVCache(self.device, capacity, static=self.static_decode_shapes)

    def release_cache(self, cache: KVCache) -> None:
        """Take back the cache of a session whose rows have all left, cleared, for the next
        session: its first step (a request's first token) then allocates no buffers (allocating
        and zeroing them was ~6 % of a 64-token prompt's prefill on 2 CPU cores). Kept: one
        cache, at the room its batch grew to, as a serving engine keeps its KV space; not a
        static one (CUDA graphs), whose sessions ask for their capacity."""
        if cache.static:
            return
        cache.clear()
        self._spare_cache = cache

    @torch.no_grad()
    def forward(self, cache: KVCache, tokens: list[int], prompts: list[list[int]], plan) -> torch.Tensor:
        """One scheduling step: the new token of every row of ``cache`` (all rows or none) and the
        whole prompt of every request that joins (its row is appended to the cache), in one pass.
        Returns ``[rows, vocab]`` fp32 logits of the token after each: decoding rows, then prompts.

        With :class:`~mimir_megatron.inference.step.StepForward` (the default wherever it
        applies) the step is one flattened forward over all of its tokens; otherwise the model's
        own recurrence runs one pass for the decoding rows and one for the prompts (right-padded).
        Statistics: a step's seconds are shared between prefill and decode by token count."""
        start = time.perf_counter()
        if self._step is not None:
            hidden = self._step(cache, tokens, prompts, plan)
        else:
            hidden = self._model_passes(cache, tokens, prompts, plan)
        logits = self.model.head_logits(hidden[None])[:, 0].float()
        seconds = time.perf_counter() - start
        prompt_tokens = sum(map(len, prompts))
        share = prompt_tokens / max(1, prompt_tokens + len(tokens))
        self.stats.prefill_tokens += prompt_tokens
        self.stats.prefill_seconds += seconds * share
        self.stats.decode_tokens += len(tokens)
        self.stats.decode_seconds += seconds * (1 - share)
        return logits

    def _model_passes(self, cache: KVCache, tokens: list[int], prompts: list[list[int]],
                      plan) -> torch.Tensor:
        """:meth:`forward` through ``model.recurrence`` (megatron's layers or the fast stacks): the
        decoding rows in one pass (each row's token, then padding up to what sequence parallelism
        splits), the prompts in another (right-padded, bidirectional inside each prompt)."""
        out = []
        if tokens:
            rows, width = len(tokens), self.pad_width(1)
            lengths = torch.tensor(cache.lengths, dtype=torch.long)
            ids = torch.zeros(rows, width, dtype=torch.long)
            ids[:, 0] = torch.tensor(tokens)
            positions = lengths[:, None] + torch.arange(width)
            cache.reserve(rows, max(cache.lengths) + width)
            layout = PrefixLMLayout("dense", dense_mask=cache.pass_mask(0, rows, width))
            with cache.pass_over(0, rows, width):
                hidden = self.model.recurrence(ids.to(self.device), positions.to(self.device), layout, plan,
                                               kv_cache=cache, stacks=self._stacks)
            out.append(self.model.full_sequence(hidden)[0])
            cache.commit([1] * rows)
        if prompts:
            rows, width = len(prompts), self.pad_width(max(map(len, prompts)))
            ids = torch.zeros(rows, width, dtype=torch.long)
            positions = torch.zeros_like(ids)
            real = torch.zeros(rows, width, dtype=torch.bool)
            for r, prompt in enumerate(prompts):
                ids[r, : len(prompt)] = torch.tensor(prompt)
                positions[r, : len(prompt)] = torch.arange(len(prompt))
                real[r, : len(prompt)] = True
            ids, positions, real = ids.to(self.device), positions.to(self.device), real.to(self.device)
            layout = build_layout(self.model.attention_backend, real.long(), real)
            first = cache.rows
            cache.reserve(first + rows, width)
            with cache.pass_over(first, rows, width):
                hidden = self.model.full_sequence(self.model.recurrence(
                    ids, positions, layout, plan, kv_cache=cache, stacks=self._stacks))
            last = torch.tensor([len(p) - 1 for p in prompts], device=self.device)
            out.append(hidden[last, torch.arange(rows, device=self.device)])
            cache.add_rows([len(p) for p in prompts])
        return out[0] if len(out) == 1 else torch.cat(out)
