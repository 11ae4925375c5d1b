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
    """megatron's SelfAttention with :func:`output_gate`, whose fused projection is not kept for
    backward.

    megatron splits the fused ``[q, gate, k, v]`` projection into views of one storage. RoPE gives
    fresh q and k (``model/attention.py``), but the attention kernel keeps ``v`` and the output gate
    keeps ``gate`` for backward, and as views they keep the whole storage alive, the pre-RoPE q and
    k with it: 4 hidden widths a token where 2 are needed (q and k held twice). Here ``v`` and
    ``gate`` are copied out of it (the layout RoPE gives q and k, ``[seq, batch, heads,
    head_dim]`` contiguous, which the kernels take as they are), so the storage is freed once RoPE
    has read q and k. The copies change no value. When the core attention is recomputed
    (``selective``), its checkpoint keeps q, k and v before RoPE, all views of that one storage
    anyway: nothing is copied then.
    """

    def get_query_key_value_tensors(self, hidden_states, key_value_states=None, output_gate=False,
                                    split_qkv=True):
        parts = super().get_query_key_value_tensors(hidden_states, key_value_states,
                                                    output_gate=output_gate, split_qkv=split_qkv)
        if not output_gate or (self.checkpoint_core_attention and self.training):
            return parts
        query, key, value, gate = parts
        return query, key, value.contiguous(), gate.contiguous()

    def _apply_output_gate(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        return output_gate(x, gate)
