"""Megatron's attention with an output gate that keeps no fp32 sigmoid for backward.

megatron's ``Attention._apply_output_gate`` computes ``x * sigmoid(gate.float())`` and, run
eagerly, autograd keeps the fp32 sigmoid (4 bytes a hidden unit per token and layer application:
12.9 GB of the paper's v1.5 step at 4 x 4,096 and k=8, measured on fake tensors). With a
low-precision ``x`` (bf16 weights, or autocast) the same arithmetic runs here as one autograd
function that keeps the gate as it comes (a view of the fused qkv projection's output, which the
core attention keeps anyway) and recomputes the sigmoid in backward: the same forward and
backward values as megatron's eager function, bit for bit. fp32 runs megatron's own expression.
On a GPU megatron wraps its function in ``torch.compile``; this one replaces it there too (plain
elementwise kernels, whose step-time cost has not been measured on a GPU).
"""

from __future__ import annotations

import torch
from megatron.core.transformer.attention import SelfAttention


class _LowPrecisionOutputGate(torch.autograd.Function):
    """``(x * sigmoid(gate.float())).to(x.dtype)``, keeping ``x`` and ``gate`` (not the sigmoid)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(x, gate)
        return (x * torch.sigmoid(gate.reshape(x.shape).float())).to(x.dtype)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        x, gate = ctx.saved_tensors
        sig = torch.sigmoid(gate.reshape(x.shape).float())
        grad32 = grad.float()  # autograd's order: the cast's backward, then mul's, then sigmoid's
        grad_x = (grad32 * sig).to(x.dtype)
        grad_gate = torch.ops.aten.sigmoid_backward(grad32 * x, sig).to(gate.dtype)
        return grad_x, grad_gate.view(gate.shape)


def output_gate(x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
    """megatron's output gate; with a low-precision ``x``, without keeping the fp32 sigmoid."""
    if x.dtype == torch.float32:
        return (x * torch.sigmoid(gate.contiguous().view(*x.shape).float())).to(x.dtype)
    return _LowPrecisionOutputGate.apply(x, gate)


class GatedSelfAttention(SelfAttention):
    """megatron's SelfAttention with :func:`output_gate`."""

    def _apply_output_gate(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        return output_gate(x, gate)
