"""One entry point for PrefixLM attention over packed samples, whatever the kernel.

All backends take megatron's layout, ``query/key/value: [seq, batch, heads, head_dim]``, and
return ``[seq, batch, heads * head_dim]``, with the semantics of the dense reference
(:func:`mimir_kernels.dense_prefix_lm_attention`):

* ``dense``: SDPA with a ``[batch, 1, seq, seq]`` boolean mask; any device, O(seq^2) memory.
* ``flex``: FlexAttention with a block-sparse mask (:mod:`mimir_kernels.flex_prefix_lm`).
* ``varlen``: two variable-length passes, prefix then response
  (:mod:`mimir_kernels.varlen_prefix_lm`).

Decoding with a KV cache: a layout may carry ``kv_cache``, the cache of one module application
(:mod:`mimir_megatron.inference.kv_cache`). The core-attention slot stores the new tokens' keys and
values there; when earlier tokens are cached, the new queries attend to all cached keys with the
layout's dense ``[batch, 1, new, cached]`` mask (:func:`cached_prefix_lm_attention`); otherwise
(prefill) the layout's backend runs on the new tokens alone.

What a backend needs about the batch is derived from ``segment_ids`` and ``prefix_mask`` once per
forward pass by :func:`build_layout` and shared by every layer: a :class:`PrefixLMLayout`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from mimir_kernels.flex_prefix_lm import build_block_mask, flex_prefix_lm_attention
from mimir_kernels.prefix_lm import dense_prefix_lm_attention, prefix_lm_mask
from mimir_kernels.varlen_prefix_lm import build_varlen_index, varlen_prefix_lm_attention

ATTENTION_BACKENDS = ("dense", "flex", "varlen")


@dataclass
class PrefixLMLayout:
    """Everything one attention backend needs for one batch, built once per forward pass and
    shared by every layer and module application."""

    backend: str
    # megatron's Attention reads this attribute: the layout travels as `packed_seq_params`
    qkv_format: str = "sbhd"
    dense_mask: torch.Tensor | None = None  # [b,1,s,s] bool, True = masked out (dense backend)
    block_mask: Any = None  # torch FlexAttention BlockMask (flex backend)
    varlen: Any = None  # index tensors of the two-pass path (varlen backend): a VarlenIndex
    kv_cache: Any = None  # decoding: the cache of one module application (see module docstring)


def _check_backend(backend: str) -> None:
    if backend not in ATTENTION_BACKENDS:
        raise ValueError(f"unknown attention backend {backend!r}; available: {', '.join(ATTENTION_BACKENDS)}")


def build_layout(backend: str, segment_ids: torch.Tensor, prefix_mask: torch.Tensor) -> PrefixLMLayout:
    """The layout of one ``[batch, seq]`` batch for ``backend``, on the batch's device."""
    _check_backend(backend)
    if segment_ids.shape != prefix_mask.shape or segment_ids.dim() != 2:
        raise ValueError(f"segment_ids {tuple(segment_ids.shape)} and prefix_mask "
                         f"{tuple(prefix_mask.shape)} must both be [batch, seq]")
    prefix_mask = prefix_mask.bool()
    if backend == "dense":
        return PrefixLMLayout(backend, dense_mask=prefix_lm_mask(segment_ids, prefix_mask))
    if backend == "flex":
        return PrefixLMLayout(backend, block_mask=build_block_mask(segment_ids, prefix_mask))
    return PrefixLMLayout(backend, varlen=build_varlen_index(segment_ids, prefix_mask))


def prefix_lm_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                        layout: PrefixLMLayout, softmax_scale: float | None = None) -> torch.Tensor:
    """``[seq, batch, heads, head_dim]`` x3 -> ``[seq, batch, heads * head_dim]`` with ``layout``'s
    backend; ``softmax_scale`` defaults to ``head_dim ** -0.5``."""
    _check_backend(layout.backend)
    if layout.backend == "dense":
        return dense_prefix_lm_attention(query, key, value, layout.dense_mask, softmax_scale)
    if layout.backend == "flex":
        return flex_prefix_lm_attention(query, key, value, layout.block_mask, softmax_scale)
    return varlen_prefix_lm_attention(query, key, value, layout.varlen, softmax_scale)


def cached_prefix_lm_attention(query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
                               masked_out: torch.Tensor, softmax_scale: float | None = None) -> torch.Tensor:
    """New queries against cached keys and values (decoding).

    Args:
        query: ``[new, batch, heads, head_dim]`` (megatron's layout).
        keys, values: ``[batch, heads, cached, head_dim]``, the new tokens included (SDPA's layout,
            so that a growing cache is read without a copy).
        masked_out: ``[batch, 1, new, cached]`` bool, True = masked out.

    Returns:
        ``[new, batch, heads * head_dim]``.
    """
    new, batch, heads, head_dim = query.shape
    out = torch.nn.functional.scaled_dot_product_attention(
        query.permute(1, 2, 0, 3), keys, values, attn_mask=~masked_out, scale=softmax_scale
    )
    return out.permute(2, 0, 1, 3).reshape(new, batch, heads * head_dim)
