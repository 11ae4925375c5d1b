"""PrefixLM attention over packed samples: the mask rule and the dense CPU reference.

Rule, for query q and key k of one row: attention is allowed iff
``segment[q] == segment[k] != 0`` and (``k <= q`` or (``prefix[q]`` and ``prefix[k]``)).
Prefix tokens see their whole prefix, response tokens see everything before them in their own
sample, nothing crosses samples.
"""

from __future__ import annotations

import torch


def prefix_lm_mask(segment_ids: torch.Tensor, prefix_mask: torch.Tensor) -> torch.Tensor:
    """Boolean mask ``[batch, 1, seq, seq]``, True = masked out (megatron's convention).

    Padding queries (segment 0) are given their own position as the only key. Their outputs are
    never read, but an empty softmax row would produce NaN, and ``0 * NaN`` in the next matmul
    would leak into real tokens.
    """
    seq = segment_ids.shape[-1]
    same_sample = (segment_ids[:, :, None] == segment_ids[:, None, :]) & (
        segment_ids[:, :, None] != 0
    )
    positions = torch.arange(seq, device=segment_ids.device)
    causal = positions[None, :] <= positions[:, None]  # [q, k]: k <= q
    both_prefix = prefix_mask[:, :, None] & prefix_mask[:, None, :]
    allowed = same_sample & (causal[None] | both_prefix)
    padding_self = (segment_ids == 0)[:, :, None] & torch.eye(
        seq, dtype=torch.bool, device=segment_ids.device
    )[None]
    return ~(allowed | padding_self)[:, None]


def dense_prefix_lm_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    masked_out: torch.Tensor,
    softmax_scale: float | None = None,
) -> torch.Tensor:
    """Reference attention in megatron's layout.

    Args:
        query, key, value: ``[seq, batch, heads, head_dim]``.
        masked_out: ``[batch, 1, seq, seq]`` bool, True = masked out (see :func:`prefix_lm_mask`).
        softmax_scale: defaults to ``head_dim ** -0.5``.

    Returns:
        ``[seq, batch, heads * head_dim]``.
    """
    seq, batch, heads, head_dim = query.shape
    q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))  # [b, h, s, d]
    out = torch.nn.functional.scaled_dot_product_attention(
        q, k, v, attn_mask=~masked_out, scale=softmax_scale
    )
    return out.permute(2, 0, 1, 3).reshape(seq, batch, heads * head_dim)
