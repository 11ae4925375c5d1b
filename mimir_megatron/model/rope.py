"""RoPE angles from per-token positions (which restart at 0 for every packed sample)."""

from __future__ import annotations

import torch


def rotary_angles(position_ids: torch.Tensor, head_dim: int, theta: float) -> torch.Tensor:
    """Angles ``[seq, batch, 1, head_dim]`` for megatron's rotate-half ``apply_rotary_pos_emb``.

    Computed per row rather than per position index because packed samples restart their
    positions; megatron's RotaryEmbedding assumes one position range shared by the batch.
    """
    inv_freq = 1.0 / (
        theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32, device=position_ids.device) / head_dim)
    )
    freqs = position_ids.to(torch.float32)[..., None] * inv_freq  # [b, s, d/2]
    angles = torch.cat((freqs, freqs), dim=-1)  # rotate-half layout
    return angles.transpose(0, 1)[:, :, None, :].contiguous()
