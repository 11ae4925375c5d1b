"""The GPU tests' model shape, a second model holding a reference model's weights, and one
stack's packed input with its forward-and-backward (the RoPE and SwiGLU equality tests)."""

from __future__ import annotations

import torch
from conftest import tiny_config
from mimir_kernels import build_layout

from mimir_megatron.model import build_model
from mimir_megatron.model.rope import rotary_angles

SHAPE = ("hidden_size=256", "num_attention_heads=4", "ffn_hidden_size=512", "vocab_size=1024")


def like(ref_model, *overrides: str, strict: bool = True):
    """A model of SHAPE with ``overrides``, holding the reference model's weights: a second
    model, not a copy (``copy.deepcopy`` of a megatron model raises: its modules hold process
    groups, which cannot be pickled). Checked on CPU in tests/integration/test_fast_path.py."""
    model = build_model(tiny_config(*SHAPE, *overrides))
    model.load_state_dict(ref_model.state_dict(), strict=strict)
    return model


def packed_stack_input(model) -> tuple[torch.Tensor, object, torch.Tensor]:
    """``(hidden states, PrefixLM layout, rotary angles)`` for one of ``model``'s stacks: two rows
    of 16 tokens, the first packing two documents (each with its own positions and prefix)."""
    g = torch.Generator().manual_seed(1)
    seq, batch = 16, 2
    segments = torch.tensor([[1] * 9 + [2] * 7, [1] * 16])
    prefix = torch.tensor([[True] * 4 + [False] * 5 + [True] * 3 + [False] * 4, [True] * 8 + [False] * 8])
    positions = torch.cat([torch.arange(9), torch.arange(7)]).expand(batch, seq).clone()
    positions[1] = torch.arange(16)
    layout = build_layout(model.attention_backend, segments, prefix)
    angles = rotary_angles(positions, model.cfg.head_dim, model.cfg.rope_theta)
    return torch.randn(seq, batch, model.cfg.hidden_size, generator=g), layout, angles


def stack_output_and_grads(stack, x: torch.Tensor, **stack_args) -> tuple[torch.Tensor, dict]:
    """``stack(x)`` and its parameters' gradients of a position-weighted sum of the output."""
    stack.zero_grad(set_to_none=True)
    out = stack(x, attention_mask=None, **stack_args)
    (out * torch.linspace(-1, 1, out.numel()).view_as(out)).sum().backward()
    return out.detach(), {n: p.grad.clone() for n, p in stack.named_parameters()}
