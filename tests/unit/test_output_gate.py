"""The output gate of model/gate.py against megatron's expression (``Attention._apply_output_gate``):
the same forward and gradients bit for bit, and, in bf16, no fp32 tensor kept for backward."""

from __future__ import annotations

import pytest
import torch

from mimir_megatron.model.gate import output_gate


def megatron_gate(x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
    x_dtype = x.dtype
    gate = gate.contiguous().view(*x.shape)
    return (x * torch.sigmoid(gate.float())).to(x_dtype)


def inputs(dtype: torch.dtype):
    g = torch.Generator().manual_seed(0)
    s, b, heads, d = 6, 2, 3, 8
    fused = (torch.randn(s, b, heads, 2 * d, generator=g) * 3).to(dtype).requires_grad_()
    x = torch.randn(s, b, heads * d, generator=g).to(dtype).requires_grad_()
    return x, fused, lambda f: f[..., d:]  # the gate: a strided view of the fused projection


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_the_gate_equals_megatrons_bit_for_bit(dtype):
    grad = torch.randn(6, 2, 24, generator=torch.Generator().manual_seed(1)).to(dtype)
    results = []
    for gate_fn in (megatron_gate, output_gate):
        x, fused, gate_of = inputs(dtype)
        out = gate_fn(x, gate_of(fused))
        out.backward(grad)
        results.append((out.detach(), x.grad, fused.grad))
    for ours, theirs in zip(results[1], results[0]):
        assert ours.dtype == theirs.dtype and torch.equal(ours, theirs)


def test_bf16_keeps_no_fp32_tensor_for_backward():
    kept = []
    x, fused, gate_of = inputs(torch.bfloat16)
    with torch.autograd.graph.saved_tensors_hooks(lambda t: kept.append(t.dtype) or t, lambda t: t):
        output_gate(x, gate_of(fused))
    assert kept == [torch.bfloat16, torch.bfloat16]
