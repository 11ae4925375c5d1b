"""The batch contract shared by the data loader, the model and the trainer.

A batch is a set of ``[batch, seq]`` tensors describing packed PrefixLM samples:

- ``input_ids``   (int64): token ids.
- ``position_ids`` (int64): restart at 0 for every packed sample (RoPE positions).
- ``segment_ids`` (int64): packed sample number within the row, 1-based; 0 marks padding.
- ``prefix_mask``  (bool): True on prefix (instruction) tokens, which attend bidirectionally
  within their sample's prefix.
- ``labels``       (int64): next-token targets, ``IGNORE_INDEX`` (-100) where no loss is taken.

A batch from the training loader also carries ``sources``, host-side counts per dataset of the
mixture (documents, tokens, response tokens) of the documents packed into it: the trainer adds
them up into the checkpoint's data lineage. They never go to the device.

Attention rule for query q and key k of one row: allowed iff
``segment[q] == segment[k] != 0`` and (``k <= q`` or (``prefix[q]`` and ``prefix[k]``)).
The mask is built from these fields in one place: :func:`mimir_kernels.prefix_lm_mask`.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np
import torch

IGNORE_INDEX = -100

_INT_FIELDS = ("input_ids", "position_ids", "segment_ids", "labels")
_TENSOR_FIELDS = ("input_ids", "position_ids", "segment_ids", "prefix_mask", "labels")


class BatchError(ValueError):
    """A batch that breaks the contract; the message names the offending field."""


@dataclass
class Batch:
    input_ids: torch.Tensor
    position_ids: torch.Tensor
    segment_ids: torch.Tensor
    prefix_mask: torch.Tensor
    labels: torch.Tensor | None = None
    sources: np.ndarray | None = None
    """``[datasets, 3]`` int64 on the host: documents, tokens and response tokens of each
    dataset of the mixture in this batch (the training loader's; None elsewhere)."""

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.input_ids.shape)  # type: ignore[return-value]

    def to(self, device: torch.device | str) -> "Batch":
        return replace(self, **{name: _to(getattr(self, name), device) for name in _TENSOR_FIELDS})

    def pin_memory(self) -> "Batch":
        """A copy in page-locked host memory, so that ``to(cuda)`` copies asynchronously."""
        return replace(self, **{name: _pin(getattr(self, name)) for name in _TENSOR_FIELDS})

    def num_supervised(self) -> torch.Tensor:
        """Number of tokens that carry a loss (labels != IGNORE_INDEX)."""
        if self.labels is None:
            return torch.zeros((), dtype=torch.long)
        return (self.labels != IGNORE_INDEX).sum()

    def validate(self, vocab_size: int | None = None) -> None:
        """Raise :class:`BatchError` naming the first field that breaks the contract."""
        ids = self.input_ids
        if not isinstance(ids, torch.Tensor) or ids.dim() != 2:
            raise BatchError(
                f"input_ids must be a 2-D [batch, seq] tensor, got "
                f"{tuple(ids.shape) if isinstance(ids, torch.Tensor) else type(ids).__name__}"
            )
        for name in _TENSOR_FIELDS:
            value = getattr(self, name)
            if value is None:
                if name == "labels":
                    continue
                raise BatchError(f"{name} is missing")
            if not isinstance(value, torch.Tensor):
                raise BatchError(f"{name} must be a torch.Tensor, got {type(value).__name__}")
            if tuple(value.shape) != tuple(ids.shape):
                raise BatchError(
                    f"{name} has shape {tuple(value.shape)}, expected {tuple(ids.shape)} "
                    "(the shape of input_ids)"
                )
            if value.device != ids.device:
                raise BatchError(f"{name} is on {value.device}, input_ids on {ids.device}")
            if name in _INT_FIELDS and value.dtype != torch.long:
                raise BatchError(f"{name} must be int64 (torch.long), got {value.dtype}")
        if self.prefix_mask.dtype != torch.bool:
            raise BatchError(f"prefix_mask must be bool, got {self.prefix_mask.dtype}")
        if (self.segment_ids < 0).any():
            raise BatchError("segment_ids must be >= 0 (0 marks padding)")
        if (self.position_ids < 0).any():
            raise BatchError("position_ids must be >= 0")
        if vocab_size is not None:
            if ((ids < 0) | (ids >= vocab_size)).any():
                bad = ids[(ids < 0) | (ids >= vocab_size)][0].item()
                raise BatchError(f"input_ids holds {bad}, outside the vocabulary [0, {vocab_size})")
            if self.labels is not None:
                lab = self.labels
                outside = (lab != IGNORE_INDEX) & ((lab < 0) | (lab >= vocab_size))
                if outside.any():
                    raise BatchError(
                        f"labels holds {lab[outside][0].item()}, outside the vocabulary "
                        f"[0, {vocab_size}) and not the ignore index {IGNORE_INDEX}"
                    )


def _to(value: torch.Tensor | None, device: torch.device | str) -> torch.Tensor | None:
    return None if value is None else value.to(device, non_blocking=True)


def _pin(value: torch.Tensor | None) -> torch.Tensor | None:
    return None if value is None else value.pin_memory()


def single_sample_batch(
    prefix: list[list[int]], response: list[list[int]], seq_len: int | None = None
) -> Batch:
    """One sample per row, right-padded: the layout `transformers` can express too.

    Each row holds ``prefix ++ response[:-1]``; labels are ``[-100] * (len(prefix) - 1) ++ response``
    (the last prefix token predicts the first response token).
    """
    if len(prefix) != len(response):
        raise BatchError("prefix and response need one entry per row")
    lengths = [len(p) + len(r) - 1 for p, r in zip(prefix, response)]
    seq_len = seq_len or max(lengths)
    rows = len(prefix)
    input_ids = torch.zeros(rows, seq_len, dtype=torch.long)
    labels = torch.full((rows, seq_len), IGNORE_INDEX, dtype=torch.long)
    segment_ids = torch.zeros(rows, seq_len, dtype=torch.long)
    prefix_mask = torch.zeros(rows, seq_len, dtype=torch.bool)
    position_ids = torch.zeros(rows, seq_len, dtype=torch.long)
    for row, (p, r) in enumerate(zip(prefix, response)):
        if len(p) < 1 or len(r) < 1:
            raise BatchError("every row needs at least one prefix and one response token")
        n = lengths[row]
        if n > seq_len:
            raise BatchError(f"row {row} has {n} tokens, more than seq_len={seq_len}")
        tokens = list(p) + list(r[:-1])
        input_ids[row, :n] = torch.tensor(tokens)
        labels[row, len(p) - 1 : n] = torch.tensor(r)
        segment_ids[row, :n] = 1
        prefix_mask[row, : len(p)] = True
        position_ids[row, :n] = torch.arange(n)
    return Batch(input_ids, position_ids, segment_ids, prefix_mask, labels)
