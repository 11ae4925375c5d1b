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
        return _Rotate.apply(t, *self._cast[t.dtype])


def _rotate(t: torch.Tensor, cos: torch.Tensor, sin_signed: torch.Tensor, swap: bool) -> torch.Tensor:
    """``t * cos + cat(t2, t1) * sin_signed`` (``swap``: ``cat(u2, u1)`` with ``u = t * sin_signed``,
    the transpose, which the backward pass needs), written into one new tensor without the ``cat``.

    The same products and one addition per element as the plain expression, so the same bits:
    the rotated half-products are written first and ``t * cos`` is added to them, and IEEE
    addition commutes exactly.
    """
    half = t.shape[-1] // 2
    out = torch.empty(torch.broadcast_shapes(t.shape, cos.shape), dtype=t.dtype, device=t.device)
    lo, hi = (slice(None, half), slice(half, None))
    if swap:  # out1 = t2 * s2, out2 = t1 * s1
        torch.mul(t[..., hi], sin_signed[..., hi], out=out[..., lo])
        torch.mul(t[..., lo], sin_signed[..., lo], out=out[..., hi])
    else:  # out1 = t2 * s1, out2 = t1 * s2
        torch.mul(t[..., hi], sin_signed[..., lo], out=out[..., lo])
        torch.mul(t[..., lo], sin_signed[..., hi], out=out[..., hi])
    return out.add_(t * cos)


class _Rotate(torch.autograd.Function):
    """RoPE with a hand-written backward: autograd's version of the plain expression runs a
    ``chunk``, a ``cat`` and five nodes per call (forward and backward each copy the tensor once
    more); this runs the same arithmetic in one node. Gradient: ``g * cos + swap(g * sin_signed)``,
    the two terms autograd sums for ``t``."""

    @staticmethod
    def forward(ctx, t: torch.Tensor, cos: torch.Tensor, sin_signed: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(cos, sin_signed)
        return _rotate(t, cos, sin_signed, swap=False)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        cos, sin_signed = ctx.saved_tensors
        return _rotate(grad, cos, sin_signed, swap=True), None, None
