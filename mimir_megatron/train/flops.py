"""FLOPs of one training token, for TFLOP/s and MFU.

Matmul FLOPs: a weight matrix with P entries costs 2P per token forward and 4P backward (input
and weight gradients). Forward runs all H_cycles * (L_cycles + 1) module applications; backward
only the k applications of the window; the head runs once forward and once backward. The
embedding is a lookup (no FLOPs). With the Mimir shape this gives 20.1 GFLOP/token at k=5 and
26.0 at k=8, the paper's numbers.

Attention adds, per layer application and token, 2 * 2 * s_attended * D forward (QK^T and AV),
twice that backward. s_attended is the mean number of keys a position attends to under the
PrefixLM rule, counted from the batch by :func:`attended_keys_per_token` (a prefix token sees its
sample's prefix, a response token everything before it in its sample, padding itself); without a
batch, seq_len / 2, the causal average of one sample per context. Packed contexts of many short
samples attend to far fewer keys, and counting seq_len / 2 for them would overstate MFU.
"""

from __future__ import annotations

import torch

from mimir_megatron.config import ModelConfig


def layer_params(cfg: ModelConfig) -> int:
    d, f = cfg.hidden_size, cfg.ffn_hidden_size
    return 5 * d * d + 3 * d * f  # q, gate, k, v, o + SwiGLU gate/up/down


def attended_keys_per_token(segment_ids: torch.Tensor, prefix_mask: torch.Tensor) -> torch.Tensor:
    """Mean keys attended per position of ``[batch, seq]`` packed rows (a 0-dim tensor on their
    device, so a trainer can fetch it with the step's other scalars)."""
    batch, seq = segment_ids.shape
    positions = torch.arange(seq, device=segment_ids.device).expand(batch, seq)
    starts = torch.ones_like(segment_ids, dtype=torch.bool)
    starts[:, 1:] = segment_ids[:, 1:] != segment_ids[:, :-1]
    run_start = torch.where(starts, positions, 0).cummax(dim=1).values
    position_in_sample = positions - run_start
    run = starts.long().cumsum(dim=1) - 1 + torch.arange(batch, device=segment_ids.device)[:, None] * seq
    prefix_len = torch.zeros(batch * seq, dtype=torch.long, device=segment_ids.device)
    prefix_len.index_add_(0, run.reshape(-1), prefix_mask.reshape(-1).long())
    keys = torch.where(prefix_mask, prefix_len[run], position_in_sample + 1)
    keys = torch.where(segment_ids == 0, 1, keys)
    return keys.double().mean()


def flops_per_token(cfg: ModelConfig, k_L: int, k_H: int, seq_len: int,
                    include_attention: bool = True, attended_keys: float | None = None) -> float:
    """Training FLOPs per token position (see the module docstring); ``attended_keys`` defaults
    to ``seq_len / 2``."""
    apps_L, apps_H = cfg.h_cycles * cfg.l_cycles, cfg.h_cycles
    per_layer = 2 * layer_params(cfg)
    if include_attention:
        per_layer += 2 * 2 * (seq_len / 2 if attended_keys is None else attended_keys) * cfg.hidden_size
    stack_L, stack_H = per_layer * cfg.num_layers_L, per_layer * cfg.num_layers_H
    head = 2 * cfg.hidden_size * cfg.vocab_size
    forward = apps_L * stack_L + apps_H * stack_H + head
    backward = 2 * (k_L * stack_L + k_H * stack_H + head)
    return float(forward + backward)
