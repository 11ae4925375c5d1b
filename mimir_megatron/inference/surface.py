"""What decoding sessions and scoring may use of the engine: its public surface, as a protocol.

:class:`~mimir_megatron.inference.engine.InferenceEngine` provides it; :mod:`.session` and
:mod:`.scoring` are written against this protocol, so they import nothing of the engine (no
circle) and reach none of its privates.
"""

from __future__ import annotations

from typing import Any, Protocol

import torch

from mimir_megatron.inference.kv_cache import KVCache
from mimir_megatron.inference.requests import RequestLimits


class EngineSurface(Protocol):
    model: Any
    """The HRM-Text model (``head_logits``, ``attention_backend``)."""
    tokenizer: Any
    device: torch.device
    limits: RequestLimits
    max_batch_size: int
    default_stop_ids: tuple[int, ...]
    logprobs_mode: str

    def plan(self, h: int, low: int) -> Any: ...

    def next_seed(self) -> int: ...

    def pad_width(self, width: int) -> int: ...

    def hidden_states(self, input_ids: torch.Tensor, position_ids: torch.Tensor, layout: Any,
                      plan: Any) -> torch.Tensor: ...

    @property
    def static_decode_shapes(self) -> bool: ...

    def new_cache(self, capacity: int = 0) -> KVCache: ...

    def release_cache(self, cache: KVCache) -> None: ...

    def forward(self, cache: KVCache, tokens: list[int], prompts: list[list[int]],
                plan: Any) -> torch.Tensor: ...
