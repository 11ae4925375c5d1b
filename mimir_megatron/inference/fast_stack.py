"""The model's two transformer stacks for inference, without megatron's per-call machinery.

At inference nothing needs gradients, yet every megatron layer call goes through the parallel
linears' autograd ``Function``s, the bias-dropout-add wrappers, viewless-tensor helpers and
``nn.Module`` hooks: at the tiny shape that overhead, not the matmuls, set the decoding speed.
:class:`FastStack` runs one :class:`~megatron.core.transformer.transformer_block.TransformerBlock`
on the same parameter tensors (read from the modules at each call: no copy) with
``F.linear``, and calls the model's own modules for everything that is not a linear: its
parameterless RMSNorms and its PrefixLM core attention (RoPE from the pass's table, the KV cache,
the attention kernel). The arithmetic is megatron's, in its order:

    x = norm1(h); q, gate, k, v = split(x W_qkv^T)       (per query group: q, gate, k, v)
    h = h + (attention(q, k, v) * sigmoid(gate)) W_proj^T  (the gate in fp32, cast back)
    x = norm2(h); a, b = chunk(x W_fc1^T, 2)
    h = h + (silu(a) * b) W_fc2^T
    ... every layer, then the stack's exit norm.

Prefill, decoding and scoring all use it (``InferenceEngine``); training uses megatron's
modules. ``tests/integration/test_inference.py`` checks it against them.
Tensor parallelism: the row-parallel outputs are all-reduced over the TP group, as megatron's
``RowParallelLinear`` does. Not covered (:func:`fast_stacks` returns None, the engine then uses
megatron's modules): sequence parallelism, Transformer Engine layers, FP8, query groups split
across TP ranks.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from megatron.core import parallel_state


class FastStack:
    """Callable with a TransformerBlock's arguments; returns what the block would."""

    def __init__(self, block) -> None:
        self.block = block
        self._group = parallel_state.get_tensor_model_parallel_group()
        self._reduce = parallel_state.get_tensor_model_parallel_world_size() > 1
        self._layers = []
        for layer in block.layers:
            attn, mlp = layer.self_attention, layer.mlp
            groups = attn.num_query_groups_per_partition
            head_dim = attn.hidden_size_per_attention_head
            q_per_group = attn.num_attention_heads_per_partition // groups
            split = [q_per_group * head_dim, q_per_group * head_dim, head_dim, head_dim]
            self._layers.append((
                layer.input_layernorm.forward, attn.linear_qkv, attn.core_attention.forward,
                attn.linear_proj, layer.pre_mlp_layernorm.forward, mlp.linear_fc1, mlp.linear_fc2,
                groups, head_dim, split,
            ))
        self._exit_norm = block.final_layernorm.forward

    def _row_reduce(self, out: torch.Tensor) -> torch.Tensor:
        if self._reduce:
            torch.distributed.all_reduce(out, group=self._group)
        return out

    def __call__(self, hidden: torch.Tensor, attention_mask=None, rotary_pos_emb=None,
                 packed_seq_params=None) -> torch.Tensor:
        if attention_mask is not None or rotary_pos_emb is not None:
            raise ValueError("FastStack takes the PrefixLM layout (packed_seq_params) only")
        for norm1, qkv, core_attention, proj, norm2, fc1, fc2, groups, head_dim, split in self._layers:
            seq, batch = hidden.shape[:2]
            mixed = F.linear(norm1(hidden), qkv.weight).view(seq, batch, groups, -1)
            query, gate, key, value = torch.split(mixed, split, dim=3)
            query = query.reshape(seq, batch, -1, head_dim)
            context = core_attention(query, key, value, None, packed_seq_params=packed_seq_params)
            gate = gate.reshape(context.shape)
            context = (context * torch.sigmoid(gate.float())).to(context.dtype)
            hidden = hidden + self._row_reduce(F.linear(context, proj.weight))
            up_gate, up = torch.chunk(F.linear(norm2(hidden), fc1.weight), 2, dim=-1)
            hidden = hidden + self._row_reduce(F.linear(F.silu(up_gate) * up, fc2.weight))
        return self._exit_norm(hidden)


def fast_stacks(model) -> tuple[FastStack, FastStack] | None:
    """``(L, H)`` fast stacks for ``model.recurrence(stacks=...)``, or None where they do not
    apply (see the module docstring); the model must be in eval mode."""
    cfg = model.cfg
    if (
        model.training
        or model.layer_backend != "local"
        or cfg.uses_sequence_parallel
        or cfg.execution.fp8 != "none"
        or cfg.num_attention_heads < cfg.parallel.tensor_parallel_size
    ):
        return None
    return FastStack(model.L), FastStack(model.H)
