"""PrefixLM core attention in megatron's ``core_attention`` slot.

Megatron's attention module computes q, k, v and the sigmoid output gate; this slot receives
``[seq, batch, heads, head_dim]`` tensors, applies RoPE to q and k (the forward pass's table,
:class:`RotaryLayout`) and returns ``[seq, batch, heads * head_dim]``.
The kernel comes from ``kernels/`` (``mimir_kernels``). What it needs about the batch (dense mask,
FlexAttention block mask or variable-length indices) is a :class:`mimir_kernels.PrefixLMLayout`
built once per forward pass; it travels through megatron's ``packed_seq_params`` argument, which
megatron hands to this slot unchanged and keeps out of its activation checkpoints' saved inputs.

When decoding, the layout carries the KV cache of the current module application: this slot
stores its layer's new keys and values there and, once earlier tokens are cached, attends over
all of them (``mimir_kernels.cached_prefix_lm_attention``).
"""

from __future__ import annotations

from dataclasses import dataclass, fields

import torch
from megatron.core.transformer.module import MegatronModule
from mimir_kernels import PrefixLMLayout, cached_prefix_lm_attention, prefix_lm_attention

from mimir_megatron.model.rope import RotaryTable


@dataclass
class RotaryLayout(PrefixLMLayout):
    """The batch's layout plus its RoPE table: the recurrence hands megatron no ``rotary_pos_emb``
    and this slot applies RoPE to q and k instead (before caching keys, as megatron would), with
    cos and sin computed once per forward pass rather than once per layer and application."""

    rotary: RotaryTable | None = None

    @classmethod
    def of(cls, layout: PrefixLMLayout, rotary: RotaryTable) -> "RotaryLayout":
        return cls(**{f.name: getattr(layout, f.name) for f in fields(PrefixLMLayout)}, rotary=rotary)


class PrefixLMCoreAttention(MegatronModule):
    def __init__(self, config, layer_number: int, attn_mask_type=None, attention_type=None,
                 cp_comm_type=None, softmax_scale: float | None = None, pg_collection=None):
        super().__init__(config=config)
        self.layer_number = layer_number
        self.softmax_scale = softmax_scale

    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                attention_mask: torch.Tensor | None, attn_mask_type=None, attention_bias=None,
                packed_seq_params: PrefixLMLayout | None = None) -> torch.Tensor:
        if not isinstance(packed_seq_params, PrefixLMLayout):
            raise ValueError("PrefixLM attention needs the layout built from the batch "
                             "(mimir_kernels.build_layout), passed as packed_seq_params")
        layout = packed_seq_params
        rotary = getattr(layout, "rotary", None)
        if rotary is not None:  # RoPE from the forward pass's table (see RotaryLayout)
            query, key = rotary.apply(query), rotary.apply(key)
        if layout.kv_cache is not None:
            cached = layout.kv_cache.append(self.layer_number, key, value)
            if cached is not None:
                return cached_prefix_lm_attention(query, *cached, layout.dense_mask, self.softmax_scale)
        return prefix_lm_attention(query, key, value, layout, self.softmax_scale)
