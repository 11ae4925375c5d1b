"""PrefixLM attention over packed samples as two variable-length attention passes.

Layout: megatron's ``query/key/value: [seq, batch, heads, head_dim]``, output
``[seq, batch, heads * head_dim]``. The ``[seq, batch]`` tokens are flattened seq-major (a free
view of megatron's tensors) into ``[tokens, heads, head_dim]``, the layout of variable-length
("varlen", flash-attention style) kernels, where sequences are concatenated and delimited by
``cu_seqlens`` (cumulative lengths, int32, starting at 0).

Algorithm (the HRM-Text reference trainer's). A sample is ``p`` prefix tokens then ``r``
response tokens (the rule is in :mod:`mimir_kernels.prefix_lm`).

* Pass 1, prefix: queries and keys are the gathered prefix tokens, one sequence per sample,
  bidirectional. Each padding token is given its own 1-token sequence, so it attends to itself
  exactly as in the dense reference.
* Pass 2, response: queries are the gathered response tokens (``cu_seqlens_q`` from ``r``), keys
  are all tokens of the same sample (``cu_seqlens_k`` from ``p + r``), causal with bottom-right
  alignment: response token ``i`` sees keys ``<= i + p``, i.e. the whole prefix and the
  responses up to itself.

Both outputs are concatenated and put back in token order by one gather (out of place, so
autograd sums the key/value gradients of the two passes). Samples without prefix or without
response tokens have no sequence in the pass that would be empty.

All index math is done once per batch by :func:`build_varlen_index`, with vectorised torch ops
and a single host sync (the sizes and maximum lengths the kernels need on the host).

The kernel is pluggable (:class:`VarlenKernel`): ``flash_attn.flash_attn_varlen_func`` or
``torch.nn.attention.varlen.varlen_attn`` on CUDA, :func:`reference_varlen_attention` (a loop of
SDPA calls) on CPU and in tests.
"""

from __future__ import annotations

import functools
import inspect
from dataclasses import dataclass
from typing import Protocol

import torch
import torch.nn.functional as F


class VarlenKernel(Protocol):
    """``[total_q, heads, head_dim]`` queries against ``[total_k, heads, head_dim]`` keys/values.

    ``causal`` means bottom-right aligned: with ``q_len`` queries and ``k_len`` keys in one
    sequence, query ``i`` sees keys ``j <= i + k_len - q_len`` (flash-attention's convention).
    """

    def __call__(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                 cu_seqlens_q: torch.Tensor, cu_seqlens_k: torch.Tensor, max_seqlen_q: int,
                 max_seqlen_k: int, *, causal: bool, softmax_scale: float) -> torch.Tensor: ...


@dataclass
class VarlenPass:
    """One kernel call: which flat tokens are queries and keys, and how they split into sequences."""

    queries: torch.Tensor  # [total_q] int64, seq-major flat token positions
    keys: torch.Tensor  # [total_k] int64
    cu_seqlens_q: torch.Tensor  # [n + 1] int32
    cu_seqlens_k: torch.Tensor  # [n + 1] int32
    max_seqlen_q: int
    max_seqlen_k: int
    causal: bool


@dataclass
class VarlenIndex:
    """The two passes of one batch, and the gather that puts their outputs back in token order."""

    seq: int
    batch: int
    passes: tuple[VarlenPass, ...]  # empty passes are left out
    unpermute: torch.Tensor  # [seq * batch]: output row of each seq-major token in cat(pass outputs)


def _first_true(mask: torch.Tensor, count: int) -> torch.Tensor:
    """Positions of the ``count`` True entries of a 1-d mask, in order, without a host sync."""
    return torch.sort((~mask).to(torch.int8), stable=True).indices[:count]


def _cu_seqlens(lengths: torch.Tensor) -> torch.Tensor:
    return F.pad(lengths.cumsum(0), (1, 0)).to(torch.int32)


def build_varlen_index(segment_ids: torch.Tensor, prefix_mask: torch.Tensor) -> VarlenIndex:
    """Index tensors of both passes for ``[batch, seq]`` segment ids and prefix mask."""
    batch, seq = segment_ids.shape
    device = segment_ids.device
    segments = segment_ids.reshape(-1)  # batch-major: samples are contiguous runs
    padding = segments == 0
    in_prefix_pass = padding | prefix_mask.reshape(-1).bool()  # padding: 1-token prefix samples
    in_response_pass = ~in_prefix_pass
    position = torch.arange(segments.numel(), device=device)
    starts = (position % seq == 0) | (segments != segments.roll(1)) | padding
    sample = starts.cumsum(0) - 1  # sample number of each token, over the whole batch

    def per_sample(tokens: torch.Tensor) -> torch.Tensor:
        # Sized by tokens (an upper bound on samples) so no sync is needed; extra slots stay 0.
        return torch.zeros_like(segments).index_add_(0, sample, tokens.long())

    prefix_len, response_len = per_sample(in_prefix_pass), per_sample(in_response_pass)
    has_response = response_len > 0
    sample_len_with_response = (prefix_len + response_len) * has_response
    stats = torch.stack([
        in_prefix_pass.sum(), in_response_pass.sum(), (prefix_len > 0).sum(), has_response.sum(),
        prefix_len.max(), response_len.max(), sample_len_with_response.max(),
        sample_len_with_response.sum(),
    ]).tolist()  # the one host sync
    n_prefix, n_response, n_prefix_seqs, n_response_seqs, max_p, max_r, max_k2, n_keys2 = stats

    # Batch-major flat position -> seq-major, the order of megatron's [seq, batch] tensors.
    def seq_major(flat: torch.Tensor) -> torch.Tensor:
        return (flat % seq) * batch + flat // seq

    passes = []
    if n_prefix:
        tokens = seq_major(_first_true(in_prefix_pass, n_prefix))
        cu = _cu_seqlens(prefix_len[_first_true(prefix_len > 0, n_prefix_seqs)])
        passes.append(VarlenPass(tokens, tokens, cu, cu, max_p, max_p, causal=False))
    if n_response:
        with_response = _first_true(has_response, n_response_seqs)
        passes.append(VarlenPass(
            queries=seq_major(_first_true(in_response_pass, n_response)),
            keys=seq_major(_first_true(has_response[sample], n_keys2)),
            cu_seqlens_q=_cu_seqlens(response_len[with_response]),
            cu_seqlens_k=_cu_seqlens(sample_len_with_response[with_response]),
            max_seqlen_q=max_r, max_seqlen_k=max_k2, causal=True,
        ))
    order = torch.cat([p.queries for p in passes])  # every token is a query of exactly one pass
    unpermute = torch.empty_like(order).scatter_(0, order, torch.arange(order.numel(), device=device))
    return VarlenIndex(seq=seq, batch=batch, passes=tuple(passes), unpermute=unpermute)


def varlen_prefix_lm_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                               index: VarlenIndex, softmax_scale: float | None = None,
                               kernel: VarlenKernel | None = None) -> torch.Tensor:
    """``[seq, batch, heads, head_dim]`` x3 -> ``[seq, batch, heads * head_dim]``, two passes."""
    seq, batch, heads, head_dim = query.shape
    if (seq, batch) != (index.seq, index.batch):
        raise ValueError(f"q/k/v have [seq, batch] = {[seq, batch]}, the layout was built for "
                         f"{[index.seq, index.batch]}")
    kernel = kernel or default_varlen_kernel(query)
    scale = head_dim ** -0.5 if softmax_scale is None else softmax_scale
    q, k, v = (t.flatten(0, 1) for t in (query, key, value))  # [seq * batch, heads, head_dim]
    outputs = [
        kernel(q.index_select(0, p.queries), k.index_select(0, p.keys), v.index_select(0, p.keys),
               p.cu_seqlens_q, p.cu_seqlens_k, p.max_seqlen_q, p.max_seqlen_k,
               causal=p.causal, softmax_scale=scale)
        for p in index.passes
    ]
    out = torch.cat(outputs).index_select(0, index.unpermute)
    return out.reshape(seq, batch, heads * head_dim)


# --- kernels ---------------------------------------------------------------------------------


def reference_varlen_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                               cu_seqlens_q: torch.Tensor, cu_seqlens_k: torch.Tensor,
                               max_seqlen_q: int, max_seqlen_k: int, *, causal: bool,
                               softmax_scale: float) -> torch.Tensor:
    """Any device, any dtype: one SDPA call per sequence, causal masks aligned bottom-right."""
    outputs = []
    cu_q, cu_k = cu_seqlens_q.tolist(), cu_seqlens_k.tolist()
    for q0, q1, k0, k1 in zip(cu_q[:-1], cu_q[1:], cu_k[:-1], cu_k[1:], strict=True):
        q, k, v = (t.transpose(0, 1) for t in (query[q0:q1], key[k0:k1], value[k0:k1]))  # [h, len, d]
        mask = None
        if causal:
            rows = torch.arange(q1 - q0, device=query.device)[:, None]
            cols = torch.arange(k1 - k0, device=query.device)[None, :]
            mask = cols <= rows + (k1 - k0) - (q1 - q0)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=softmax_scale)
        outputs.append(out.transpose(0, 1))
    return torch.cat(outputs)


def flash_attn_varlen_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                                cu_seqlens_q: torch.Tensor, cu_seqlens_k: torch.Tensor,
                                max_seqlen_q: int, max_seqlen_k: int, *, causal: bool,
                                softmax_scale: float) -> torch.Tensor:
    """The ``flash_attn`` package's kernel (bottom-right causal alignment since flash-attn 2.1)."""
    from flash_attn import flash_attn_varlen_func

    return flash_attn_varlen_func(query, key, value, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                                  max_seqlen_k, dropout_p=0.0, softmax_scale=softmax_scale,
                                  causal=causal)


@functools.cache
def _torch_varlen_parameters() -> frozenset[str]:
    from torch.nn.attention.varlen import varlen_attn

    return frozenset(inspect.signature(varlen_attn).parameters)


def torch_varlen_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                           cu_seqlens_q: torch.Tensor, cu_seqlens_k: torch.Tensor,
                           max_seqlen_q: int, max_seqlen_k: int, *, causal: bool,
                           softmax_scale: float) -> torch.Tensor:
    """``torch.nn.attention.varlen.varlen_attn`` (flash-attention underneath).

    Its keywords changed between torch releases: causal attention is ``is_causal=True`` in some,
    ``window_size=(-1, 0)`` in others, and ``scale`` is not always there; the signature is read
    at run time.
    """
    from torch.nn.attention.varlen import varlen_attn

    params = _torch_varlen_parameters()
    kwargs = {}
    if causal and "is_causal" in params:
        kwargs["is_causal"] = True
    elif causal and "window_size" in params:
        kwargs["window_size"] = (-1, 0)
    elif causal:
        raise RuntimeError(f"varlen_attn accepts neither is_causal nor window_size: {sorted(params)}")
    if "scale" in params:
        kwargs["scale"] = softmax_scale
    else:  # the kernel uses head_dim ** -0.5: fold the requested scale into the queries
        query = query * (softmax_scale * query.shape[-1] ** 0.5)
    return varlen_attn(query, key, value, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                       **kwargs)


@functools.cache
def _cuda_varlen_kernel() -> VarlenKernel:
    try:
        import flash_attn  # noqa: F401

        return flash_attn_varlen_attention
    except ImportError:
        pass
    try:
        _torch_varlen_parameters()
    except ImportError as error:
        raise RuntimeError("the varlen attention backend needs flash_attn or "
                           "torch.nn.attention.varlen (torch >= 2.10)") from error
    return torch_varlen_attention


def default_varlen_kernel(query: torch.Tensor) -> VarlenKernel:
    """Flash kernels on CUDA (``flash_attn`` if installed, else torch's), the reference elsewhere."""
    if query.device.type != "cuda":
        return reference_varlen_attention
    if query.dtype not in (torch.float16, torch.bfloat16):
        raise ValueError(f"the varlen backend on CUDA needs fp16/bf16 inputs, got {query.dtype}; "
                         "use the dense or flex backend for other dtypes")
    return _cuda_varlen_kernel()
