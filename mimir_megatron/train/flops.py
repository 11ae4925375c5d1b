"""FLOPs of one training token, for TFLOP/s and MFU.

Matmul FLOPs: a weight matrix with P entries costs 2P per token forward and 4P backward (input
and weight gradients). Forward runs all H_cycles * (L_cycles + 1) module applications; backward
only the k applications of the window; the head runs once forward and once backward. The
embedding is a lookup (no FLOPs). With the Mimir shape this gives 20.1 GFLOP/token at k=5 and
26.0 at k=8, the paper's numbers.

Attention adds, per layer application and token, 2 * 2 * s_attended * D forward (QK^T and AV),
twice that backward; we count s_attended = seq_len / 2, the causal average (prefix tokens see a
bit more, padding less).
"""

from __future__ import annotations

from mimir_megatron.config import ModelConfig


def layer_params(cfg: ModelConfig) -> int:
    d, f = cfg.hidden_size, cfg.ffn_hidden_size
    return 5 * d * d + 3 * d * f  # q, gate, k, v, o + SwiGLU gate/up/down


def flops_per_token(cfg: ModelConfig, k_L: int, k_H: int, seq_len: int,
                    include_attention: bool = True) -> float:
    apps_L, apps_H = cfg.h_cycles * cfg.l_cycles, cfg.h_cycles
    per_layer = 2 * layer_params(cfg)
    if include_attention:
        per_layer += 2 * 2 * (seq_len / 2) * cfg.hidden_size
    stack_L, stack_H = per_layer * cfg.num_layers_L, per_layer * cfg.num_layers_H
    head = 2 * cfg.hidden_size * cfg.vocab_size
    forward = apps_L * stack_L + apps_H * stack_H + head
    backward = 2 * (k_L * stack_L + k_H * stack_H + head)
    return float(forward + backward)
