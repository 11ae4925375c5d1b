"""SwiGLU, ``silu(x1) * x2`` of the two halves of the MLP's first projection, in one autograd node.

Megatron's unfused path (``MLP.forward``'s ``glu``) runs ``chunk``, ``silu``, ``x2 + glu_linear_offset``
(a copy of the half, the offset being 0) and a ``mul``, and its backward joins the two halves'
gradients with a ``cat``. This computes the same products with the same kernels (``silu``,
``mul``, ``silu_backward``) and writes the two gradient halves straight into one tensor: the same
bits (the one difference, ``x2 + 0.0`` turning a ``-0.0`` into ``+0.0``, changes only the sign of
a zero product), one node instead of five, no copy of ``x2`` saved for backward. Only the input
is kept for backward: ``silu(x1)`` (FFN-wide) is recomputed there, an elementwise pass that frees
a third of the MLP's activations (the reference keeps the same: the projection's output).

It sits in megatron's MLP activation slot (``MLPSubmodules.activation_func``), which megatron uses
when ``TransformerConfig.use_te_activation_func`` is set: the name says TE, but the slot takes any
module; both are set in this package (``hrm.transformer_config`` and ``spec.block_spec``).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


class _SwiGLU(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:
        gate, linear = torch.chunk(x, 2, dim=-1)
        ctx.save_for_backward(x)
        return F.silu(gate) * linear

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        (x,) = ctx.saved_tensors
        gate, linear = torch.chunk(x, 2, dim=-1)
        activated = F.silu(gate)  # recomputed (the same kernel, the same bits): not kept from forward
        half = gate.shape[-1]
        out = torch.empty(x.shape, dtype=grad.dtype, device=grad.device)
        torch.mul(grad, activated, out=out[..., half:])  # d/d linear
        torch.ops.aten.silu_backward.grad_input(grad * linear, gate, grad_input=out[..., :half])
        return out


def swiglu(x: torch.Tensor) -> torch.Tensor:
    """``silu(x[..., :n]) * x[..., n:]`` for a last dimension of ``2n``."""
    return _SwiGLU.apply(x)


class SwiGLU(torch.nn.Module):
    """Megatron's MLP activation slot (built with ``config=``); see the module docstring."""

    def __init__(self, config=None) -> None:
        super().__init__()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return swiglu(x)
