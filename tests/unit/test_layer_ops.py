"""The layer's own ops in the train step's hot path (issue 21) give megatron's numbers bit for bit.

``model/rope.py``'s per-forward RoPE table and ``model/swiglu.py``'s one-node SwiGLU (a
hand-written backward) are compared with megatron's own code (its ``apply_rotary_pos_emb``, its
MLP's unfused ``glu``) with ``torch.equal``, forward and backward, on strided inputs like the
views megatron's fused projections hand them.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from conftest import tiny_config
from models import packed_stack_input, stack_output_and_grads

from mimir_megatron.model import build_model
from mimir_megatron.model.attention import RotaryLayout
from mimir_megatron.model.rope import RotaryTable, rotary_angles
from mimir_megatron.model.swiglu import swiglu


def _value_and_grad(fn, base: torch.Tensor, view, weight: torch.Tensor):
    """``fn`` of a strided view of ``base``; the gradient of a weighted sum back to ``base``."""
    leaf = base.clone().requires_grad_(True)
    out = fn(view(leaf))
    (out * weight).sum().backward()
    return out.detach(), leaf.grad


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rotary_table_equals_megatrons_rope_forward_and_backward(dtype):
    from megatron.core.models.common.embeddings.rope_utils import _apply_rotary_pos_emb_bshd

    g = torch.Generator().manual_seed(0)
    angles = rotary_angles(torch.randint(0, 500, (3, 17), generator=g), 64, 10000.0)
    base = torch.randn(17, 3, 4, 3 * 64, generator=g).to(dtype)  # q of a fused [q | k | v] row
    weight = torch.randn(17, 3, 4, 64, generator=g).to(dtype)

    def view(leaf):
        return leaf[..., 64:128]

    ours = _value_and_grad(RotaryTable(angles).apply, base, view, weight)
    megatron = _value_and_grad(lambda t: _apply_rotary_pos_emb_bshd(t, angles), base, view, weight)
    assert torch.equal(ours[0], megatron[0])
    assert torch.equal(ours[1], megatron[1])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_swiglu_node_equals_megatrons_glu_forward_and_backward(dtype):
    from megatron.core.transformer.mlp import MLP

    config = build_model(tiny_config()).L.config
    glu_module = MLP.__new__(MLP)  # megatron's glu lives inside MLP.forward: call that, not a copy
    g = torch.Generator().manual_seed(0)
    base = torch.randn(9, 3, 2 * 96 + 5, generator=g).to(dtype)
    weight = torch.randn(9, 3, 96, generator=g).to(dtype)

    def view(leaf):
        return leaf[..., 5:]

    ours = _value_and_grad(swiglu, base, view, weight)
    megatron = _value_and_grad(lambda x: _megatron_glu(glu_module, config, x), base, view, weight)
    assert torch.equal(ours[0], megatron[0])
    assert torch.equal(ours[1], megatron[1])


class _Passthrough(torch.nn.Module):
    """A projection slot that returns its input (and no bias)."""

    def forward(self, h: torch.Tensor):
        return h, None


def _megatron_glu(mlp, config, x: torch.Tensor) -> torch.Tensor:
    """megatron's MLP.forward with pass-through projections: its unfused glu on ``x``."""
    torch.nn.Module.__init__(mlp)
    mlp.config = dataclasses.replace(config, use_te_activation_func=False)
    mlp.linear_fc1 = _Passthrough()
    mlp.linear_fc2 = _Passthrough()
    mlp.activation_func = config.activation_func
    out, _ = type(mlp).forward(mlp, x)
    return out


def test_a_stack_with_the_layer_ops_equals_megatrons_unfused_path():
    """One L stack, forward and backward: megatron applying RoPE from the angles and running its
    own glu (the old path) vs our attention slot's RoPE table and the SwiGLU node: identical
    outputs and parameter gradients."""
    model = build_model(tiny_config())
    stack = model.L
    assert all(type(layer.mlp.activation_func).__name__ == "SwiGLU" for layer in stack.layers)
    x, layout, angles = packed_stack_input(model)

    def run(**stack_args):
        return stack_output_and_grads(stack, x, **stack_args)

    new_out, new_grads = run(rotary_pos_emb=None,
                             packed_seq_params=RotaryLayout.of(layout, RotaryTable(angles)))
    unfused = dataclasses.replace(stack.layers[0].mlp.config, use_te_activation_func=False)
    for layer in stack.layers:  # megatron's MLP runs its own glu when the flag is off
        layer.mlp.config = unfused
    old_out, old_grads = run(rotary_pos_emb=angles, packed_seq_params=layout)
    assert torch.equal(old_out, new_out)
    assert old_grads.keys() == new_grads.keys()
    for name in old_grads:
        assert torch.equal(old_grads[name], new_grads[name]), name


def _saved_bytes(fn, x: torch.Tensor) -> int:
    """Bytes of what autograd keeps for backward from ``fn(x)`` (distinct storages not of ``x``'s
    own: the input is the caller's tensor either way)."""
    storages: dict[int, int] = {}

    def pack(t: torch.Tensor):
        if t.untyped_storage().data_ptr() != x.untyped_storage().data_ptr():
            storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn(x)
    return sum(storages.values())


def test_swiglu_keeps_only_its_input_for_backward():
    """silu of the gate half is recomputed in backward: nothing FFN-wide is kept but the input
    (the plan counts 2F for fc1's output, none for the activated half)."""
    x = torch.randn(4, 2 * 64, requires_grad=True)
    assert _saved_bytes(swiglu, x) == 0


def test_a_bf16_norm_keeps_its_input_not_an_fp32_copy():
    from mimir_megatron.model.norm import ParameterlessRMSNorm

    norm = ParameterlessRMSNorm(eps=1e-6)
    g = torch.Generator().manual_seed(0)
    x = (torch.randn(8, 5, 64, generator=g) * 3).to(torch.bfloat16).requires_grad_(True)
    # Kept: the input itself and one fp32 rsqrt per token (autograd's path: an fp32 copy of x too).
    assert _saved_bytes(norm, x) == 8 * 5 * 4

    weight = torch.randn(8, 5, 64, generator=g).to(torch.bfloat16)
    out = norm(x)
    (out * weight).sum().backward()
    # The same forward as the fp32 path's ops; the gradient as autograd's of the same fp32 math.
    ref = x.detach().float().requires_grad_(True)
    ref_out = ref * torch.rsqrt(ref.pow(2).mean(-1, keepdim=True) + 1e-6)
    (ref_out * weight.float()).sum().backward()
    assert torch.equal(out, ref_out.detach().to(torch.bfloat16))
    assert torch.allclose(x.grad.float(), ref.grad, rtol=1e-2, atol=1e-2 * ref.grad.abs().max().item())
    fp32 = x.detach().float().requires_grad_(True)
    assert _saved_bytes(norm, fp32) > 0  # fp32 input: autograd's path (unchanged bits)
