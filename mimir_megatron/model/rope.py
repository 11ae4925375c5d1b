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


class RotaryTable:
    """cos and sin of one forward pass's angles, computed once and applied in every layer of every
    module application (megatron's unfused RoPE recomputes both, and a ``* mscale``, per call:
    2 x layers x applications times per forward).

    :meth:`apply` equals megatron's rotate-half ``apply_rotary_pos_emb`` bit for bit:
    ``t * cos + rotate_half(t) * sin`` with ``rotate_half(t) = cat(-t2, t1)``; here the sign sits
    in the table (``sin_signed = cat(-sin1, sin2)``, so ``cat(t2, t1) * sin_signed``), and
    ``(-a) * b == a * (-b)`` exactly in IEEE arithmetic.
    """

    def __init__(self, angles: torch.Tensor) -> None:
        self.cos = torch.cos(angles)
        sin = torch.sin(angles)
        half = sin.shape[-1] // 2
        self.sin_signed = torch.cat((-sin[..., :half], sin[..., half:]), dim=-1)
        self._cast: dict[torch.dtype, tuple[torch.Tensor, torch.Tensor]] = {}

    def apply(self, t: torch.Tensor) -> torch.Tensor:
        """RoPE on ``[seq, batch, heads, head_dim]`` (the table broadcasts over heads)."""
        if t.dtype not in self._cast:  # bf16 compute: cast once per forward, not per layer
            self._cast[t.dtype] = (self.cos.to(t.dtype), self.sin_signed.to(t.dtype))
        cos, sin_signed = self._cast[t.dtype]
        t1, t2 = torch.chunk(t, 2, dim=-1)
        return t * cos + torch.cat((t2, t1), dim=-1) * sin_signed
