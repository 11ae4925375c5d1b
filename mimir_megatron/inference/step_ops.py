"""The inference step's operations other than the weight products: each layer's attention half
(RoPE, the KV cache's writes, attention and the output gate, from the fused projection's output
to the context the output projection takes) and the RMSNorms.

Two ways, the same arithmetic up to float rounding, picked per model by :func:`ops_for`:

- :class:`TorchOps`: torch's operations. RoPE on q and k together (rotate-half, the pass's table),
  the decoding rows' keys and values written at each row's length and one SDPA call for every row
  over the longest row's positions (a mask when the lengths differ), one SDPA call per run of
  equal-length joining prompts (bidirectional inside each prompt: PrefixLM's prefix), the sigmoid
  gate (fp32 for a bf16 model, cast back); ``torch.rms_norm``. Any device and dtype, and what
  ``torch.compile`` traces for compiled decoding.
- :class:`NativeOps`: fp32 models on the CPU where the install built the C kernels
  (``mimir_kernels.cpu_step``, ``backend.native_cpu_step_ops``): the decoding rows' attention
  half of a layer in one call, each row attending its own positions (no padding, no mask; the
  cached keys and values bit for bit :class:`TorchOps`'s), the joining prompts' in another (up to
  :attr:`NativeOps.PROMPT_KERNEL_MAX`; longer prompts' RoPE, cache writes and gate in C around
  torch's SDPA), and the norms in one call each.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from mimir_kernels import cpu_step

from mimir_megatron import backend
from mimir_megatron.inference.kv_cache import DecodeRows
from mimir_megatron.model.rope import RotaryTable


@dataclass
class Prompts:
    """Joining prompts of one length, in consecutive cache rows and consecutive flat tokens."""

    first_row: int
    count: int
    length: int
    offset: int  # of their first token in the flat sequence


@dataclass
class StepTokens:
    """Where one step's flat tokens sit: the decoding rows first (rows ``0 .. count - 1``, one new
    token each), then the joining prompts; and their RoPE table (``[tokens, head_dim]`` fp32,
    :class:`~mimir_megatron.model.rope.RotaryTable`'s ``cos`` and ``sin_signed``)."""

    decode: DecodeRows | None
    prompts: list[Prompts]
    cos: torch.Tensor
    sin_signed: torch.Tensor
    decode_index: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None
    """The kernel's per decoding row (row, position, attended length), int64, built once a step."""
    prompts_alone: "StepTokens | None" = None
    """The joining prompts as a step of their own (their tokens first), when rows also decode."""
    prompt_index: tuple[torch.Tensor, torch.Tensor] | None = None
    """The kernels' per prompt token (row, position), int64, built once a step."""
    prompt_table: torch.Tensor | None = None
    """The kernel's per prompt (cache row, first token, length), ``[prompts, 3]`` int64."""

    @classmethod
    def of(cls, decode: DecodeRows | None, prompts: list[Prompts], rotary: RotaryTable) -> "StepTokens":
        tokens = rotary.cos.shape[0]
        return cls(decode, prompts, rotary.cos.view(tokens, -1), rotary.sin_signed.view(tokens, -1))

    def __post_init__(self) -> None:
        self._tables: dict[torch.dtype, tuple[torch.Tensor, torch.Tensor]] = {}

    def rope_table(self, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """``(cos, sin_signed)`` in ``dtype`` (a bf16 model's cast once a step, not once a layer)."""
        if dtype not in self._tables:
            self._tables[dtype] = (self.cos.to(dtype), self.sin_signed.to(dtype))
        return self._tables[dtype]


class TorchOps:
    """Torch's operations (module docstring)."""

    def prepare(self, step: StepTokens) -> None:
        """Per-step set-up before the first layer (nothing for torch's operations)."""

    def norm(self, x: torch.Tensor, eps: float) -> torch.Tensor:
        """The model's parameterless RMSNorm of ``[tokens, width]``."""
        return torch.rms_norm(x, (x.shape[-1],), None, eps)

    def attend(self, mixed: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, step: StepTokens,
               scale: float | None, out_dtype: torch.dtype) -> torch.Tensor:
        """``[tokens, heads * head_dim]`` gated contexts from ``mixed`` ``[tokens, heads, 4,
        head_dim]`` (per head q, gate, k, v); the step's keys and values stored in ``keys``,
        ``values`` (``[room rows, heads, room positions, head_dim]``)."""
        tokens, heads, _, head_dim = mixed.shape
        cos, sin_signed = (t.view(tokens, 1, 1, -1) for t in step.rope_table(mixed.dtype))
        qk = mixed[:, :, 0::2]  # q and k: RoPE on both at once
        half = head_dim // 2
        qk = qk * cos + torch.cat((qk[..., half:], qk[..., :half]), dim=-1) * sin_signed
        context = self._attend(keys, values, qk[:, :, 0], qk[:, :, 1], mixed[:, :, 3], step, scale)
        gate = mixed[:, :, 1]
        if gate.dtype == torch.float32:
            return torch.sigmoid(gate).view(tokens, -1).mul_(context)
        # megatron's gate: the sigmoid in fp32, the product cast back
        return (context * torch.sigmoid(gate.float()).view(tokens, -1)).to(out_dtype)

    @staticmethod
    def _attend(keys: torch.Tensor, values: torch.Tensor, query: torch.Tensor, key: torch.Tensor,
                value: torch.Tensor, step: StepTokens, scale: float | None) -> torch.Tensor:
        """Store the step's keys and values; ``[tokens, heads * head_dim]`` attention outputs.
        ``query``, ``key``, ``value``: ``[tokens, heads, head_dim]``."""
        _, heads, head_dim = query.shape
        parts = []
        decode = step.decode
        if decode is not None:
            n = decode.count
            if decode.write_at is not None:
                keys[:n, :, decode.write_at] = key[:n]
                values[:n, :, decode.write_at] = value[:n]
            else:
                keys[decode.row_index, :, decode.positions] = key[:n]
                values[decode.row_index, :, decode.positions] = value[:n]
            out = F.scaled_dot_product_attention(
                query[:n, :, None], keys[:n, :, : decode.key_length], values[:n, :, : decode.key_length],
                attn_mask=decode.mask, scale=scale)  # [rows, heads, 1, head_dim]
            parts.append(out.reshape(n, heads * head_dim))
        for g in step.prompts:
            flat = slice(g.offset, g.offset + g.count * g.length)
            q, k, v = (t[flat].view(g.count, g.length, heads, head_dim).transpose(1, 2)
                       for t in (query, key, value))
            rows = slice(g.first_row, g.first_row + g.count)
            keys[rows, :, : g.length] = k
            values[rows, :, : g.length] = v
            out = F.scaled_dot_product_attention(q, k, v, scale=scale)  # the prefix: bidirectional
            parts.append(out.transpose(1, 2).reshape(g.count * g.length, heads * head_dim))
        return parts[0] if len(parts) == 1 else torch.cat(parts)


class NativeOps(TorchOps):
    """The C kernels for an fp32 model: the norms, and the attention half of a layer in one call
    for the decoding rows' tokens (a token-by-token loop over each row's cache) and in another for
    the joining prompts (blocked products, a prompt's tokens attending each other); long prompts'
    attention through torch's SDPA between RoPE and the cache's writes in C and the gate in C."""

    # The longest prompt times the head width up to which the prompts' kernel attends: 128 tokens
    # of 64 wide, 64 of 128. From about twice that, SDPA's blocked products are faster
    # (mimir_kernels/cpu_step.py).
    PROMPT_KERNEL_MAX = 8_192

    def __init__(self, lib: ctypes.CDLL) -> None:
        self._lib = lib

    def prepare(self, step: StepTokens) -> None:
        prompts = step  # the prompts' tokens first: the step itself, or a step of their own
        if step.decode is not None:
            n = step.decode.count
            lengths = step.decode.positions
            step.decode_index = (torch.arange(n), lengths, lengths + 1)
            if step.prompts:
                moved = [Prompts(g.first_row, g.count, g.length, g.offset - n) for g in step.prompts]
                prompts = step.prompts_alone = StepTokens(None, moved, step.cos[n:], step.sin_signed[n:])
        if step.prompts:
            groups = prompts.prompts
            prompts.prompt_index = (
                torch.cat([torch.arange(g.first_row, g.first_row + g.count).repeat_interleave(g.length)
                           for g in groups]),
                torch.cat([torch.arange(g.length).repeat(g.count) for g in groups]))
            prompts.prompt_table = torch.tensor([(g.first_row + i, g.offset + i * g.length, g.length)
                                                 for g in groups for i in range(g.count)], dtype=torch.int64)

    def norm(self, x: torch.Tensor, eps: float) -> torch.Tensor:
        return cpu_step.rms_norm(self._lib, x.contiguous(), eps)

    def attend(self, mixed: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, step: StepTokens,
               scale: float | None, out_dtype: torch.dtype) -> torch.Tensor:
        if step.decode_index is None:
            return self._prompts(mixed.contiguous(), keys, values, step, scale)
        n = step.decode.count
        context = cpu_step.cache_attention(
            self._lib, mixed[:n].contiguous(), step.cos[:n], step.sin_signed[:n], keys, values,
            *step.decode_index, mixed.shape[-1] ** -0.5 if scale is None else scale)
        if step.prompts_alone is None:
            return context
        prompts = self._prompts(mixed[n:].contiguous(), keys, values, step.prompts_alone, scale)
        return torch.cat((context, prompts))

    def _prompts(self, mixed: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, step: StepTokens,
                 scale: float | None) -> torch.Tensor:
        """The joining prompts' gated contexts, each token attending its own prompt's positions: in
        one C call up to :attr:`PROMPT_KERNEL_MAX` (the longest prompt times the head width), else
        RoPE and the cache's writes in C, SDPA over each run of equal-length prompts (their keys
        and values read back from the cache), the gate in C."""
        heads, head_dim = mixed.shape[1], mixed.shape[3]
        if max(g.length for g in step.prompts) * head_dim <= self.PROMPT_KERNEL_MAX:
            return cpu_step.prompt_attention(self._lib, mixed, step.cos, step.sin_signed, keys, values,
                                             *step.prompt_index, step.prompt_table,
                                             head_dim ** -0.5 if scale is None else scale)
        queries = cpu_step.rope_store(self._lib, mixed, step.cos, step.sin_signed, keys, values,
                                      *step.prompt_index)
        parts = []
        for g in step.prompts:
            q = queries[g.offset:g.offset + g.count * g.length].view(g.count, g.length, heads, head_dim)
            rows = slice(g.first_row, g.first_row + g.count)
            out = F.scaled_dot_product_attention(  # the prefix: bidirectional
                q.transpose(1, 2), keys[rows, :, :g.length], values[rows, :, :g.length], scale=scale)
            parts.append(out.transpose(1, 2).reshape(g.count * g.length, heads * head_dim))
        context = parts[0] if len(parts) == 1 else torch.cat(parts)
        return cpu_step.gate(self._lib, context.contiguous(), mixed)


def ops_for(device: torch.device, dtype: torch.dtype) -> TorchOps:
    """The step's operations for a model of ``dtype`` on ``device`` (module docstring)."""
    if backend.native_cpu_step_ops(device) and dtype == torch.float32:
        lib = cpu_step.library()
        if lib is not None:
            return NativeOps(lib)
    return TorchOps()
