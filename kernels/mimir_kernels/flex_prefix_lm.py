"""PrefixLM attention over packed samples with PyTorch FlexAttention.

Layout: megatron's ``query/key/value: [seq, batch, heads, head_dim]`` are permuted (views, no
copy) to FlexAttention's ``[batch, heads, seq, head_dim]``; the output is permuted back and
reshaped to ``[seq, batch, heads * head_dim]``.

Algorithm: the rule of :mod:`mimir_kernels.prefix_lm` is written as a ``mask_mod`` over
``(batch, head, q_idx, kv_idx)`` that looks up the batch's segment ids and prefix flags.
``create_block_mask`` evaluates it once per batch into a ``BlockMask``: ``BLOCK_SIZE`` x
``BLOCK_SIZE`` tiles that are entirely masked are skipped by the kernel, tiles that are entirely
allowed run without calling ``mask_mod``, the rest apply it element-wise. Samples are
contiguous, so a packed row is close to block-diagonal and most tiles are skipped.

On CUDA the kernel is a ``torch.compile``d ``flex_attention`` (compiled once per process, on
first use). On CPU it runs eagerly: forward only (this torch raises on CPU backward), which is
what the tests need.

``value`` reaches the kernel in the layout of ``query`` and ``key`` (RoPE's fresh ``[seq, batch,
heads, head_dim]`` tensors, permuted): compiled FlexAttention was seen to give wrong outputs for
a strided view of megatron's fused-QKV row. The model hands ``v`` over in that layout already
(``mimir_megatron/model/gate.py``); any other ``value`` is copied into it first.

Memory: FlexAttention keeps its inputs, its output and the log-sum-exp for backward. Its output
follows the query's stride order (``[seq, batch, ...]`` in memory), so the permute and reshape
back to megatron's layout are views, and the output gate keeps that same storage: no copy is
kept (``tests/unit/test_saved_activations.py`` counts them against `mimir plan`).
"""

from __future__ import annotations

import functools
import warnings
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch.nn.attention.flex_attention import BlockMask, create_block_mask, flex_attention

BLOCK_SIZE = 128

MaskMod = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


def prefix_lm_mask_mod(segment_ids: torch.Tensor, prefix_mask: torch.Tensor,
                       block_size: int = BLOCK_SIZE) -> MaskMod:
    """``mask_mod(b, h, q_idx, kv_idx) -> allowed`` for ``[batch, seq]`` segment ids and prefix mask.

    The look-up tables are padded (segment 0) to a whole number of blocks: the kernel may
    evaluate ``mask_mod`` on the positions past ``seq`` of the last block, and those must be
    in range.
    """
    pad = -segment_ids.shape[-1] % block_size
    segments = F.pad(segment_ids, (0, pad))
    prefix = F.pad(prefix_mask.bool(), (0, pad))

    def mask_mod(b: torch.Tensor, h: torch.Tensor, q_idx: torch.Tensor, kv_idx: torch.Tensor) -> torch.Tensor:
        q_segment, kv_segment = segments[b, q_idx], segments[b, kv_idx]
        same_sample = (q_segment == kv_segment) & (q_segment != 0)
        visible = (kv_idx <= q_idx) | (prefix[b, q_idx] & prefix[b, kv_idx])
        padding_self = (q_segment == 0) & (q_idx == kv_idx)  # avoids an empty softmax row
        return (same_sample & visible) | padding_self

    return mask_mod


def build_block_mask(segment_ids: torch.Tensor, prefix_mask: torch.Tensor,
                     block_size: int = BLOCK_SIZE) -> BlockMask:
    """The ``BlockMask`` of one batch, shared by all heads (``H=None``), on the batch's device."""
    batch, seq = segment_ids.shape
    mask_mod = prefix_lm_mask_mod(segment_ids, prefix_mask, block_size)
    return create_block_mask(mask_mod, batch, None, seq, seq, device=segment_ids.device,
                             BLOCK_SIZE=block_size)


@functools.cache
def _compiled_flex_attention() -> Callable[..., torch.Tensor]:
    return torch.compile(flex_attention)


def _refuse_cpu_backward(*tensors: torch.Tensor) -> None:
    """FlexAttention has no CPU backward: say so with the settings that train on CPU (torch's own
    message names neither)."""
    if torch.is_grad_enabled() and any(t.requires_grad for t in tensors):
        raise NotImplementedError("FlexAttention has no backward on CPU: train on CPU with "
                                  "attention_backend dense or varlen (flex runs forward only)")


def flex_prefix_lm_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                             block_mask: BlockMask, softmax_scale: float | None = None) -> torch.Tensor:
    """``[seq, batch, heads, head_dim]`` x3 -> ``[seq, batch, heads * head_dim]``."""
    seq, batch, heads, head_dim = query.shape
    # [b, h, s, d] views of [s, b, h, d] tensors; value as query and key are (module docstring)
    q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value.contiguous()))
    if query.is_cuda:
        out = _compiled_flex_attention()(q, k, v, block_mask=block_mask, scale=softmax_scale)
    else:
        _refuse_cpu_backward(q, k, v)
        with warnings.catch_warnings():  # eager is intended here: CPU runs only serve tests
            warnings.filterwarnings("ignore", message="flex_attention called without torch.compile")
            out = flex_attention(q, k, v, block_mask=block_mask, scale=softmax_scale)
    return out.permute(2, 0, 1, 3).reshape(seq, batch, heads * head_dim)
