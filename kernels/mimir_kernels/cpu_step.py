"""The inference step's CPU kernels for fp32, each one C call where torch ran several operations.

- :func:`cache_attention` (``csrc/cache_attention.c``): the attention half of a layer for a step's
  decoding rows. For each row's new token: RoPE on its query and key, its key and value written
  into the KV cache at its row and position, its query attending its row's first ``attended``
  positions, the context times the sigmoid of its output gate. In torch the same took ten
  operations per layer and one SDPA call over every row padded to the longest under a mask; on
  2 cores (8 heads of 64, cached lengths 64-127) that half of a layer took 183 / 282 / 866 µs at
  1 / 8 / 32 rows, the C call 19 / 79 / 302 µs. The keys and values it caches are torch's bit for
  bit; its contexts differ from SDPA's by float rounding (another summation order).
- :func:`prompt_attention` (``csrc/prompt_attention.c``): the same half of a layer for the
  joining prompts, each token attending every position of its own prompt, in one call with one
  OpenMP region: blocked products (64 queries of a head against its keys, transposed 64 at a
  time), each score and context element summed in one fixed order without FMA, so its result
  does not depend on the CPU's vector width, the thread count or the prompts sharing the step.
  Where the step ran RoPE and the writes in C, SDPA and the gate in C again (three regions and the
  copies between them), one 64-token prompt of 8 heads of 64 took 182 against 125 µs (2 cores),
  32 such prompts 11.2 against 4.6 ms. SDPA's products are faster on long prompts (1,024 tokens:
  ~17 against ~20.5 ms), so the step takes this kernel up to 128 tokens at a head width of 64, 64
  at 128 (``NativeOps.PROMPT_KERNEL_MAX``).
- :func:`rope_store` and :func:`gate` (``csrc/cache_attention.c``): the longer prompts' share of
  that work around torch's SDPA: RoPE on the queries and keys and the cache's writes in one call,
  the output gate in another, where torch ran six operations.
- Their exponentials (the softmax weights, the output gate's sigmoid) through ``mimir_exp``
  (``csrc/exp.c``): libm's ``expf`` bit for bit, four values at a time where the CPU has AVX2 and
  FMA (0.85 against 3.2 ns a value; the output gate of a 64-token prompt 3x faster).
- :func:`rms_norm` (``csrc/rms_norm.c``): the model's parameterless RMSNorm, where torch's CPU
  ``rms_norm`` ran ~10 operations (~16-23 µs a call at 1-32 rows of 512, almost all dispatch).
  Equal to torch's to float rounding (the squares summed in another order).
- :func:`small_gemm` (``csrc/small_gemm.c``): ``x W^T`` (plus a residual) at a decoding step's
  1-8 rows. A product there reads every weight once and is bound by that read: inside a step
  oneDNN's GEMM on prepacked weights (and MKL's ``F.linear``) read them at 15-17 GB/s, this loop at
  ~25 GB/s (2 cores, the mid512 model's 128 products of a one-row step: 30 against 18 ms; at 8
  rows 41 against 31 ms; the tiny model, whose weights stay in the caches: 2.4 against 1.0 ms).
  Each row's result is summed in one fixed order, whatever the rows beside it (batch-invariant);
  equal to torch's to float rounding.

- :func:`packed_gemm` (``csrc/packed_gemm.c``): ``x W^T`` (plus a residual) from a few rows up, on a
  weight packed once by :func:`pack_weight` into panels of 32 outputs, with AVX-512: 8 rows by 32
  outputs in 16 registers, one fused multiply-add per 16 results.
  On the 2-core AMD EPYC (Zen 4), mid512's 32 products in a row, weights streamed from memory:
  0.90-0.97x oneDNN's time at 64 rows, 0.82-0.94x at 32, 0.55-0.67x at 8, level from 512; each
  result one chain over the inputs in order (batch- and thread-invariant).

``pip install`` builds them (pyproject.toml's optional ``ext-modules``) into this package as
``_cpu_step<EXT_SUFFIX>``, a plain shared library loaded with ctypes: nothing is compiled at run
time. Without a C compiler the install still succeeds and the step runs torch's operations (said
once in the log). ``MIMIR_CPU_KERNELS=torch`` uses torch's operations too.
"""

from __future__ import annotations

import ctypes
import logging
import os
import sysconfig
from functools import lru_cache
from pathlib import Path

import torch

log = logging.getLogger(__name__)

MAX_HEAD_DIM = 512  # csrc/cache_attention.c's query and accumulator arrays
_ERRORS = {
    1: f"a head width over {MAX_HEAD_DIM} or odd",
    2: "a row, position or attended length outside the cache's buffers",
    3: "no memory for the scores' scratch",
}


def library_path() -> Path | None:
    """Where the install put the built kernels, if it did."""
    path = Path(__file__).resolve().parent / ("_cpu_step" + sysconfig.get_config_var("EXT_SUFFIX"))
    return path if path.is_file() else None


@lru_cache(maxsize=1)
def library() -> ctypes.CDLL | None:
    """The built kernels, or None (``MIMIR_CPU_KERNELS=torch``, or not built at install time)."""
    if os.environ.get("MIMIR_CPU_KERNELS", "").lower() == "torch":
        return None
    path = library_path()
    try:
        lib = ctypes.CDLL(str(path)) if path else None
        why = "were not built at install time (no C compiler?)"
    except OSError as exc:
        lib, why = None, f"do not load ({exc})"
    if lib is None:
        log.info("inference: the C kernels of the CPU step (mimir_kernels/_cpu_step) %s, so it runs "
                 "torch's operations (decoding steps ~1.2-2.3x slower); reinstall with a C compiler "
                 "(apt-get install gcc) to build them", why)
        return None
    lib.mimir_cache_attention.restype = ctypes.c_int
    lib.mimir_cache_attention.argtypes = [ctypes.c_void_p] * 8 + [ctypes.c_int64] * 5 + [
        ctypes.c_float, ctypes.c_int, ctypes.c_void_p]
    lib.mimir_rope_store.restype = ctypes.c_int
    lib.mimir_rope_store.argtypes = [ctypes.c_void_p] * 7 + [ctypes.c_int64] * 5 + [
        ctypes.c_int, ctypes.c_void_p]
    lib.mimir_prompt_attention.restype = ctypes.c_int
    lib.mimir_prompt_attention.argtypes = [ctypes.c_void_p] * 7 + [ctypes.c_int64] * 5 + [
        ctypes.c_void_p, ctypes.c_int64, ctypes.c_float, ctypes.c_int, ctypes.c_void_p]
    lib.mimir_gate.restype = None
    lib.mimir_gate.argtypes = [ctypes.c_void_p, ctypes.c_void_p] + [ctypes.c_int64] * 3 + [ctypes.c_int]
    lib.mimir_small_gemm.restype = None
    lib.mimir_small_gemm.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p,
                                     ctypes.c_int64, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int]
    for name in ("mimir_exp", "mimir_exp_libm"):  # csrc/exp.c: in place over n floats
        getattr(lib, name).restype = None
        getattr(lib, name).argtypes = [ctypes.c_void_p, ctypes.c_int64]
    lib.mimir_exp_uses_lanes.restype = ctypes.c_int
    lib.mimir_exp_uses_lanes.argtypes = []
    lib.mimir_rms_norm.restype = None
    lib.mimir_rms_norm.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64,
                                   ctypes.c_float, ctypes.c_int]
    lib.mimir_pack_weight.restype = None
    lib.mimir_pack_weight.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p,
                                      ctypes.c_int]
    lib.mimir_packed_gemm.restype = ctypes.c_int
    lib.mimir_packed_gemm.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_int64,
                                      ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p, ctypes.c_void_p,
                                      ctypes.c_int]
    lib.mimir_packed_gemm_available.restype = ctypes.c_int
    lib.mimir_packed_gemm_available.argtypes = []
    return lib


def _floats(*tensors: torch.Tensor) -> bool:
    return all(t.dtype == torch.float32 and t.is_contiguous() and t.device.type == "cpu" for t in tensors)


def _check_attention(name: str, mixed: torch.Tensor, cos: torch.Tensor, sin_signed: torch.Tensor,
                     keys: torch.Tensor, values: torch.Tensor, indices: tuple[torch.Tensor, ...]) -> None:
    """The attention kernels' inputs as :func:`cache_attention` documents them, or a one-line
    ValueError (the kernels take raw pointers: a wrong shape would read or write elsewhere)."""
    tokens, heads, four, head_dim = mixed.shape
    if (four != 4 or not _floats(mixed, cos, sin_signed, keys, values)
            or any(t.dtype != torch.int64 or not t.is_contiguous() or t.shape != (tokens,) for t in indices)
            or cos.shape != (tokens, head_dim) or sin_signed.shape != cos.shape
            or keys.shape != values.shape or keys.shape[1] != heads or keys.shape[3] != head_dim):
        raise ValueError(f"{name}: fp32 contiguous CPU tensors of the documented shapes, int64 indices")


def cache_attention(lib: ctypes.CDLL, mixed: torch.Tensor, cos: torch.Tensor, sin_signed: torch.Tensor,
                    keys: torch.Tensor, values: torch.Tensor, row: torch.Tensor, position: torch.Tensor,
                    attended: torch.Tensor, scale: float) -> torch.Tensor:
    """``[tokens, heads * head_dim]``: each token's gated attention context (module docstring).

    ``mixed``: ``[tokens, heads, 4, head_dim]`` (per head q, gate, k, v); ``cos``, ``sin_signed``:
    ``[tokens, head_dim]``; ``keys``, ``values``: ``[rows, heads, positions, head_dim]``, written
    at ``(row[t], position[t])``; ``row``, ``position``, ``attended``: ``[tokens]`` int64. All fp32
    (the indices int64), contiguous and on the CPU."""
    _check_attention("cache_attention", mixed, cos, sin_signed, keys, values, (row, position, attended))
    tokens, heads, _, head_dim = mixed.shape
    rows_room, _, positions_room, _ = keys.shape
    out = torch.empty(tokens, heads * head_dim)
    failed = lib.mimir_cache_attention(
        mixed.data_ptr(), cos.data_ptr(), sin_signed.data_ptr(), keys.data_ptr(), values.data_ptr(),
        row.data_ptr(), position.data_ptr(), attended.data_ptr(), tokens, heads, head_dim, rows_room,
        positions_room, scale, torch.get_num_threads(), out.data_ptr())
    if failed:
        raise ValueError(f"cache_attention: {_ERRORS.get(failed, f'error {failed}')}")
    return out


def rope_store(lib: ctypes.CDLL, mixed: torch.Tensor, cos: torch.Tensor, sin_signed: torch.Tensor,
               keys: torch.Tensor, values: torch.Tensor, row: torch.Tensor,
               position: torch.Tensor) -> torch.Tensor:
    """``[tokens, heads, head_dim]``: each token's query after RoPE; its key (after RoPE) and value
    written into ``keys``, ``values`` at ``(row[t], position[t])``. Arguments as
    :func:`cache_attention`'s."""
    _check_attention("rope_store", mixed, cos, sin_signed, keys, values, (row, position))
    tokens, heads, _, head_dim = mixed.shape
    rows_room, _, positions_room, _ = keys.shape
    queries = torch.empty(tokens, heads, head_dim)
    failed = lib.mimir_rope_store(
        mixed.data_ptr(), cos.data_ptr(), sin_signed.data_ptr(), keys.data_ptr(), values.data_ptr(),
        row.data_ptr(), position.data_ptr(), tokens, heads, head_dim, rows_room, positions_room,
        torch.get_num_threads(), queries.data_ptr())
    if failed:
        raise ValueError(f"rope_store: {_ERRORS.get(failed, f'error {failed}')}")
    return queries


def prompt_attention(lib: ctypes.CDLL, mixed: torch.Tensor, cos: torch.Tensor, sin_signed: torch.Tensor,
                     keys: torch.Tensor, values: torch.Tensor, row: torch.Tensor, position: torch.Tensor,
                     prompts: torch.Tensor, scale: float) -> torch.Tensor:
    """``[tokens, heads * head_dim]``: the joining prompts' gated contexts, each token attending
    every position of its own prompt. ``prompts``: ``[count, 3]`` int64, each prompt's (cache row,
    first token, length); the rest as :func:`cache_attention`'s (``row``, ``position``: where each
    token's key and value are written)."""
    _check_attention("prompt_attention", mixed, cos, sin_signed, keys, values, (row, position))
    if (prompts.dtype != torch.int64 or prompts.dim() != 2 or prompts.shape[1] != 3
            or not prompts.is_contiguous()):
        raise ValueError("prompt_attention: prompts is a contiguous [count, 3] int64 tensor")
    tokens, heads, _, head_dim = mixed.shape
    rows_room, _, positions_room, _ = keys.shape
    out = torch.empty(tokens, heads * head_dim)
    failed = lib.mimir_prompt_attention(
        mixed.data_ptr(), cos.data_ptr(), sin_signed.data_ptr(), keys.data_ptr(), values.data_ptr(),
        row.data_ptr(), position.data_ptr(), tokens, heads, head_dim, rows_room, positions_room,
        prompts.data_ptr(), prompts.shape[0], scale, torch.get_num_threads(), out.data_ptr())
    if failed:
        raise ValueError(f"prompt_attention: {_ERRORS.get(failed, f'error {failed}')}")
    return out


def gate(lib: ctypes.CDLL, context: torch.Tensor, mixed: torch.Tensor) -> torch.Tensor:
    """``context`` (``[tokens, heads * head_dim]``) times the sigmoid of each head's output gate
    (``mixed[:, :, 1]``), in place; returned."""
    tokens, heads, four, head_dim = mixed.shape
    if four != 4 or context.shape != (tokens, heads * head_dim) or not _floats(context, mixed):
        raise ValueError("gate: fp32 contiguous CPU tensors context [tokens, heads * head_dim], "
                         "mixed [tokens, heads, 4, head_dim]")
    lib.mimir_gate(context.data_ptr(), mixed.data_ptr(), tokens, heads, head_dim, torch.get_num_threads())
    return context


def rms_norm(lib: ctypes.CDLL, x: torch.Tensor, eps: float) -> torch.Tensor:
    """``torch.rms_norm(x, (width,), None, eps)`` of a ``[rows, width]`` fp32 contiguous CPU tensor."""
    if x.dim() != 2 or not _floats(x):
        raise ValueError("rms_norm: a [rows, width] fp32 contiguous CPU tensor")
    out = torch.empty_like(x)
    lib.mimir_rms_norm(x.data_ptr(), out.data_ptr(), x.shape[0], x.shape[1], eps, torch.get_num_threads())
    return out


def small_gemm(lib: ctypes.CDLL, x: torch.Tensor, weight: torch.Tensor,
               add: torch.Tensor | None = None) -> torch.Tensor:
    """``x @ weight.T`` (``+ add``, rounded as ``add + product``) of a ``[rows, in]`` x and an
    ``[out, in]`` weight; ``add``: ``[rows, out]``. All fp32, contiguous and on the CPU."""
    if (x.dim() != 2 or weight.dim() != 2 or x.shape[1] != weight.shape[1] or not _floats(x, weight)
            or (add is not None and (add.shape != (x.shape[0], weight.shape[0]) or not _floats(add)))):
        raise ValueError("small_gemm: fp32 contiguous CPU tensors x [rows, in], weight [out, in], "
                         "add [rows, out]")
    out = torch.empty(x.shape[0], weight.shape[0])
    lib.mimir_small_gemm(x.data_ptr(), x.shape[0], x.shape[1], weight.data_ptr(), weight.shape[0],
                         None if add is None else add.data_ptr(), out.data_ptr(), torch.get_num_threads())
    return out


PACK_PANEL = 32  # csrc/packed_gemm.c's outputs per panel


def packed_gemm_available(lib: ctypes.CDLL) -> bool:
    """Whether :func:`packed_gemm` runs here: the CPU has AVX-512 (and the build its kernel)."""
    return bool(lib.mimir_packed_gemm_available())


def packed_gemm_reads(x: torch.Tensor) -> bool:
    """Whether :func:`packed_gemm` reads ``x``'s rows as they are: fp32 on the CPU, ``[rows, in]``,
    each row's values contiguous and the rows apart (strided rows are fine, overlapping ones not)."""
    return (x.dim() == 2 and x.dtype == torch.float32 and x.device.type == "cpu" and x.stride(1) == 1
            and (x.shape[0] < 2 or x.stride(0) >= x.shape[1]))


def pack_weight(lib: ctypes.CDLL, weight: torch.Tensor) -> torch.Tensor:
    """An ``[out, in]`` fp32 weight packed for :func:`packed_gemm`: panels of 32 outputs, each its
    inputs one after another, zero beyond ``out`` (a copy; the weight itself is untouched)."""
    if weight.dim() != 2 or not _floats(weight):
        raise ValueError("pack_weight: an fp32 contiguous CPU weight [out, in]")
    out, width = weight.shape
    packed = torch.empty(-(-out // PACK_PANEL) * PACK_PANEL * width)
    lib.mimir_pack_weight(weight.data_ptr(), out, width, packed.data_ptr(), torch.get_num_threads())
    return packed


def packed_gemm(lib: ctypes.CDLL, x: torch.Tensor, packed: torch.Tensor, out_features: int,
                add: torch.Tensor | None = None) -> torch.Tensor:
    """``x @ weight.T`` (``+ add``, rounded as ``add + product``) of a ``[rows, in]`` fp32 x whose
    rows may be strided (its columns not) and a weight packed by :func:`pack_weight`; ``add``:
    ``[rows, out_features]``, contiguous. Each result one chain of fused multiply-adds in input
    order: independent of the rows beside it and of the thread count."""
    rows, width = x.shape if x.dim() == 2 else (0, 0)
    if (not packed_gemm_reads(x) or not _floats(packed)
            or packed.numel() != -(-out_features // PACK_PANEL) * PACK_PANEL * width
            or (add is not None and (add.shape != (rows, out_features) or not _floats(add)))):
        raise ValueError("packed_gemm: fp32 CPU x [rows, in] (columns contiguous), a weight packed for "
                         "[out_features, in], add [rows, out_features] contiguous")
    out = torch.empty(rows, out_features)
    if rows and lib.mimir_packed_gemm(x.data_ptr(), rows, width, x.stride(0), packed.data_ptr(), out_features,
                                      None if add is None else add.data_ptr(), out.data_ptr(),
                                      torch.get_num_threads()):
        raise RuntimeError("packed_gemm: this CPU has no AVX-512 (check packed_gemm_available first)")
    return out
