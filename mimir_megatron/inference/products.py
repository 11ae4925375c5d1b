"""The inference step's weight products ``x W^T``: as stored, or on weights prepacked once.

On CPU, ``F.linear`` hands an fp32 product to MKL's sgemm, which packs the weight into its
blocked layout again on every call. oneDNN's product on weights reordered once into its own
layout (``torch.ops.mkldnn._reorder_linear_weight``, what vLLM's CPU backend and Inductor's CPU
freezing use) took 0.36-0.81x of ``F.linear``'s time for the QKV and MLP-up products at 2-32 rows
(0.80-1.21x for the down product; ``bench/bench_linear.py --rotate 16``), and the engine's
decoding steps at batch 8 and 32 ran 1.19x faster (docs/performance.md#serving). One row is a
matrix-vector product bound by reading the weight: a weight of 2 MiB or more streams from memory,
and oneDNN's blocked layout streams faster (the mid512 model's one-row decoding step: 37.7 against
48.4 ms); a smaller one stays in the caches, where MKL's product on the weight as stored is faster
(the tiny model: 10.5 against 12.1 ms a step with oneDNN), so it keeps ``F.linear``. The
residual ``hidden + x W^T`` is added in oneDNN's epilogue (its binary post-op), bit for bit the
separate sum, 2-8 % faster a product at 1-64 rows.

:func:`products_for` picks by the backend (``backend.prepacks_weights``): prepacked on CPU where
torch has oneDNN, as stored elsewhere (cuBLAS reads the weights as they are). On CPU a decoding
step's products at 1-:attr:`FewRowProducts.MAX_ROWS` rows go to a kernel made for few rows, picked
by the CPU's vendor (``backend.few_row_products``):

- on Intel CPUs, MKL's sgemm on the weights as stored (:class:`MklProducts`; its decoding steps
  took 0.70-0.92x the C loop's at mid512 there): a weight under 2 MiB at every row count, a larger
  one at 1-3 rows (oneDNN's GEMM from 4);
- on others, where the install built the step's C kernels, ``mimir_kernels.cpu_step.small_gemm``
  (:class:`NativeProducts`): a loop that streams each weight once for every row, 1.3-1.6x faster
  than oneDNN's GEMM at mid512, 1.8-3.5x at tiny on the AMD EPYC (AVX2), where MKL takes slower
  paths (``bench/bench_linear.py``; docs/performance.md#serving). From 12-16 rows on oneDNN's
  GEMM is faster; with AVX-512, where oneDNN's instructions are twice as wide as the loop's,
  already from 5 rows for a weight of 2 MiB or more (mid512's), which then takes the loop at 1-4
  rows only.

On CPUs other than Intel's with AVX-512 (``backend.native_gemm``), every product from two rows up
goes instead to a GEMM of our own on weights packed for it, ``mimir_kernels.cpu_step.packed_gemm``
(:class:`NativeGemmProducts`; one row keeps the C loop): on the 2-core AMD EPYC (Zen 4) oneDNN's
GEMM ran mid512's 64-row products at 180-191 GFLOP/s inside a prefill, of the FMA units' ~234,
and spent ~10 µs a call in torch's bookkeeping; the packed GEMM ran them at 198-205, a prefill
took 0.93x (mid512) and 0.87x (tiny), decoding steps of 2-32 rows 0.67-0.86x oneDNN's
(0.79-0.89x the C loop's at 2-4 rows).

A prepacked weight is a second copy of it (the model's own is kept: training, scoring and
checkpoints read it), made at its first product and made again whenever the weight changed in
place since (its version counter: an optimizer step, ``load_state_dict``). Results equal
``F.linear``'s to float rounding (oneDNN and the C kernels sum in other orders), not bit for bit.
"""

from __future__ import annotations

import ctypes

import torch
import torch.nn.functional as F
from mimir_kernels import cpu_step

from mimir_megatron import backend


class Products:
    """``x W^T`` and ``hidden + x W^T`` with the weight as stored (``F.linear``, ``addmm``)."""

    def linear(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return F.linear(x, weight)

    def add_linear(self, hidden: torch.Tensor, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return torch.addmm(hidden, x, weight.t())


class PrepackedProducts(Products):
    """Products on fp32 weights prepacked for oneDNN (two rows or more, or one row and a weight of
    at least :attr:`ONE_ROW_MIN_BYTES`); the rest as stored."""

    ONE_ROW_MIN_BYTES = 2 * 2**20  # below it one row is faster on the weight as stored (module docstring)
    ROWS_HINT = 32  # the row count oneDNN's layout is chosen for; any count runs on it

    def __init__(self) -> None:
        self._packed: dict[int, tuple[torch.Tensor, int, torch.Tensor]] = {}

    def _prepacked(self, weight: torch.Tensor) -> torch.Tensor:
        entry = self._packed.get(id(weight))
        if entry is None or entry[0] is not weight or entry[1] != weight._version:
            entry = self._packed[id(weight)] = (weight, weight._version, self._pack(weight.detach()))
        return entry[2]

    def _pack(self, weight: torch.Tensor) -> torch.Tensor:
        """The weight's packed copy (:meth:`_prepacked` keeps it)."""
        return torch.ops.mkldnn._reorder_linear_weight(weight, self.ROWS_HINT)

    def _product(self, x: torch.Tensor, weight: torch.Tensor,
                 add: torch.Tensor | None = None) -> torch.Tensor:
        """``x W^T`` (``add +`` it) on the packed weight."""
        if add is None:
            return torch.ops.mkldnn._linear_pointwise(x, self._prepacked(weight), None, "none", [], "")
        # The residual added in the product's epilogue (oneDNN's binary post-op): the same sum,
        # rounded once as ``add + product`` is, without a second pass over the rows.
        return torch.ops.mkldnn._linear_pointwise.binary(x, add, self._prepacked(weight), None, "add")

    def _applies(self, x: torch.Tensor, weight: torch.Tensor) -> bool:
        if weight.dtype != torch.float32 or x.dtype != torch.float32:
            return False
        return x.shape[0] >= 2 or self._streams(weight)

    def _streams(self, weight: torch.Tensor) -> bool:
        """Whether the weight is large enough to stream from memory (:attr:`ONE_ROW_MIN_BYTES`)."""
        return weight.numel() * weight.element_size() >= self.ONE_ROW_MIN_BYTES

    def linear(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        if not self._applies(x, weight):
            return super().linear(x, weight)
        return self._product(x, weight)

    def add_linear(self, hidden: torch.Tensor, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        if not self._applies(x, weight):
            return super().add_linear(hidden, x, weight)
        return self._product(x, weight, hidden)


class FewRowProducts(PrepackedProducts):
    """fp32 products of 1-:attr:`MAX_ROWS` contiguous rows through a kernel made for a decoding
    step's few rows (:meth:`_few`): every such product of a weight under
    :attr:`~PrepackedProducts.ONE_ROW_MIN_BYTES`, which stays in the caches, and of a larger one,
    which streams from memory, at 1-``streamed_max_rows`` rows (``backend.FewRowKernel``); the rest
    prepacked as above."""

    MAX_ROWS = 8  # mid512's products against oneDNN's from 16 rows on: 1.3x (C loop, AMD), 1.27x (MKL, Intel)

    def __init__(self, streamed_max_rows: int) -> None:
        super().__init__()
        self.streamed_max_rows = streamed_max_rows

    def _applies_few(self, x: torch.Tensor, weight: torch.Tensor) -> bool:
        return (x.dim() == 2 and 0 < x.shape[0] <= self.MAX_ROWS and x.dtype == torch.float32
                and weight.dtype == torch.float32 and x.is_contiguous() and weight.is_contiguous()
                and (x.shape[0] <= self.streamed_max_rows or not self._streams(weight)))

    def _few(self, x: torch.Tensor, weight: torch.Tensor, add: torch.Tensor | None = None) -> torch.Tensor:
        raise NotImplementedError

    def linear(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        if not self._applies_few(x, weight):
            return super().linear(x, weight)
        return self._few(x, weight)

    def add_linear(self, hidden: torch.Tensor, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        if not (self._applies_few(x, weight) and hidden.is_contiguous() and hidden.dtype == torch.float32):
            return super().add_linear(hidden, x, weight)
        return self._few(x, weight, hidden)


class NativeProducts(FewRowProducts):
    """A decoding step's few rows through the C loop (``mimir_kernels.cpu_step.small_gemm``):
    each row's result independent of the rows beside it and of the thread count."""

    def __init__(self, lib: ctypes.CDLL, streamed_max_rows: int) -> None:
        super().__init__(streamed_max_rows)
        self._lib = lib

    def _few(self, x: torch.Tensor, weight: torch.Tensor, add: torch.Tensor | None = None) -> torch.Tensor:
        return cpu_step.small_gemm(self._lib, x, weight, add)


class MklProducts(FewRowProducts):
    """A decoding step's few rows through MKL's sgemm on the weights as stored (Intel CPUs), and
    every product of a weight under :attr:`ONE_ROW_MIN_BYTES`, which stays in the caches: there
    MKL's is faster at any row count too (the tiny model's prompt of 64 tokens: 0.80x oneDNN's
    prefill; 16 and 32 decoding rows 0.90-0.96x; 32 prompts at once 0.89-1.07x, within the noise)."""

    def _applies(self, x: torch.Tensor, weight: torch.Tensor) -> bool:
        return super()._applies(x, weight) and self._streams(weight)

    def _few(self, x: torch.Tensor, weight: torch.Tensor, add: torch.Tensor | None = None) -> torch.Tensor:
        return Products.linear(self, x, weight) if add is None else Products.add_linear(self, add, x, weight)


class NativeGemmProducts(NativeProducts):
    """fp32 products from two rows up through the C GEMM on weights packed for it
    (``mimir_kernels.cpu_step.packed_gemm``, AVX-512), one row through the few-row C loop: each
    result one chain of fused multiply-adds in input order, whatever the rows beside it and the
    thread count. On the 2-core AMD EPYC (Zen 4), against oneDNN's GEMM and the C loop it replaces
    there (docs/performance.md#serving): a 64-token prompt's prefill 0.93x (mid512) and 0.87x
    (tiny); a decoding step of 2 / 4 / 8 rows 0.89 / 0.79 / 0.73x (mid512), 4 / 8 rows 0.92 /
    0.82x (tiny); of one row it was 1.01-1.09x the C loop's, which keeps it."""

    MAX_ROWS = 1

    def __init__(self, lib: ctypes.CDLL) -> None:
        super().__init__(lib, streamed_max_rows=1)

    def _applies(self, x: torch.Tensor, weight: torch.Tensor) -> bool:
        return weight.dtype == torch.float32 and x.dtype == torch.float32

    def _pack(self, weight: torch.Tensor) -> torch.Tensor:
        return cpu_step.pack_weight(self._lib, weight.contiguous())

    def _product(self, x: torch.Tensor, weight: torch.Tensor,
                 add: torch.Tensor | None = None) -> torch.Tensor:
        rows = x.reshape(-1, x.shape[-1])
        if not cpu_step.packed_gemm_reads(rows):
            rows = rows.contiguous()
        add = None if add is None else add.reshape(rows.shape[0], -1).contiguous()
        out = cpu_step.packed_gemm(self._lib, rows, self._prepacked(weight), weight.shape[0], add)
        return out.view(*x.shape[:-1], weight.shape[0])


def products_for(device: torch.device) -> Products:
    """The products the inference step uses on ``device`` (module docstring)."""
    if not backend.prepacks_weights(device):
        return Products()
    kernel = backend.few_row_products(device)
    if kernel is None:
        return PrepackedProducts()
    if kernel.name == "mkl":
        return MklProducts(kernel.streamed_max_rows)
    lib = cpu_step.library()
    if lib is None:
        return PrepackedProducts()
    if backend.native_gemm(device) and cpu_step.packed_gemm_available(lib):
        return NativeGemmProducts(lib)
    return NativeProducts(lib, kernel.streamed_max_rows)
