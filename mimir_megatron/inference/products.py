"""The inference step's weight products ``x W^T``: as stored, or on weights prepacked once.

On CPU, ``F.linear`` hands an fp32 product to MKL's sgemm, which packs the weight into its
blocked layout again on every call. oneDNN's product on weights reordered once into its own
layout (``torch.ops.mkldnn._reorder_linear_weight``, what vLLM's CPU backend and Inductor's CPU
freezing use) took 0.36-0.81x of ``F.linear``'s time for the QKV and MLP-up products at 2-32 rows
(0.80-1.21x for the down product; ``bench/bench_linear.py --rotate 16``), and the engine's
decoding steps at batch 8 and 32 ran 1.19x faster (docs/performance.md#serving). One row keeps
``F.linear``: over a step's one-row products oneDNN took ~1.4x its time.

:func:`products_for` picks by the backend (``backend.prepacks_weights``): prepacked on CPU where
torch has oneDNN, as stored elsewhere (cuBLAS reads the weights as they are). A prepacked weight
is a second copy of it (the model's own is kept: training, scoring and checkpoints read it), made
at its first product and made again whenever the weight changed in place since (its version
counter: an optimizer step, ``load_state_dict``). Results equal ``F.linear``'s to float rounding
(oneDNN sums in another order), not bit for bit.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from mimir_megatron import backend


class Products:
    """``x W^T`` and ``hidden + x W^T`` with the weight as stored (``F.linear``, ``addmm``)."""

    def linear(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return F.linear(x, weight)

    def add_linear(self, hidden: torch.Tensor, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return torch.addmm(hidden, x, weight.t())


class PrepackedProducts(Products):
    """Products of two rows or more on fp32 weights prepacked for oneDNN; the rest as stored."""

    MIN_ROWS = 2  # one row: F.linear's matrix-vector product is faster (module docstring)
    ROWS_HINT = 32  # the row count oneDNN's layout is chosen for; any count runs on it

    def __init__(self) -> None:
        self._packed: dict[int, tuple[torch.Tensor, int, torch.Tensor]] = {}

    def _prepacked(self, weight: torch.Tensor) -> torch.Tensor:
        entry = self._packed.get(id(weight))
        if entry is None or entry[0] is not weight or entry[1] != weight._version:
            packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach(), self.ROWS_HINT)
            entry = self._packed[id(weight)] = (weight, weight._version, packed)
        return entry[2]

    def _applies(self, x: torch.Tensor, weight: torch.Tensor) -> bool:
        return x.shape[0] >= self.MIN_ROWS and weight.dtype == torch.float32 and x.dtype == torch.float32

    def _onednn(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(x, self._prepacked(weight), None, "none", [], "")

    def linear(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        if not self._applies(x, weight):
            return super().linear(x, weight)
        return self._onednn(x, weight)

    def add_linear(self, hidden: torch.Tensor, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        if not self._applies(x, weight):
            return super().add_linear(hidden, x, weight)
        return hidden + self._onednn(x, weight)


def products_for(device: torch.device) -> Products:
    """The products the inference step uses on ``device`` (module docstring)."""
    return PrepackedProducts() if backend.prepacks_weights(device) else Products()
