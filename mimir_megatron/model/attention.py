"""PrefixLM core attention in megatron's ``core_attention`` slot.

Megatron's attention module computes q, k, v, the sigmoid output gate and RoPE; this slot
receives ``[seq, batch, heads, head_dim]`` tensors and the boolean PrefixLM mask and returns
``[seq, batch, heads * head_dim]``. The kernel comes from ``kernels/`` (``mimir_kernels``).
"""

from __future__ import annotations

import torch
from megatron.core.transformer.module import MegatronModule
from mimir_kernels import dense_prefix_lm_attention


class PrefixLMCoreAttention(MegatronModule):
    def __init__(self, config, layer_number: int, attn_mask_type=None, attention_type=None,
                 cp_comm_type=None, softmax_scale: float | None = None, pg_collection=None):
        super().__init__(config=config)
        self.softmax_scale = softmax_scale

    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                attention_mask: torch.Tensor, attn_mask_type=None, attention_bias=None,
                packed_seq_params=None) -> torch.Tensor:
        if attention_mask is None:
            raise ValueError("PrefixLM attention needs the mask built from the batch")
        return dense_prefix_lm_attention(query, key, value, attention_mask, self.softmax_scale)
