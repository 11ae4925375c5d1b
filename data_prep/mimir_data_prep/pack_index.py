"""Build and cache a mixture's packing index ahead of training (`mimir data pack`).

The trainer builds the same index on its first step when it is missing; building it here, on a
CPU node before the job, keeps that time off the GPUs. The index is the same for any ``workers``.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class EpochPacking:
    epoch: int
    contexts: int
    padding: float
    """Share of the epoch's context tokens that are padding, 0 to 1."""


@dataclass(frozen=True)
class PackingIndex:
    index_dir: Path
    epochs: list[EpochPacking]


def build_packing_index(
    mixture: str | Path, *, seq_len: int = 4096, seed: int = 1234, pack_window: int = 16384,
    index_dir: str | Path | None = None, epochs: int = 1, workers: int | None = None,
) -> PackingIndex:
    """Pack epochs ``0 .. epochs-1`` of ``mixture`` as training will and cache their index
    (default directory: ``_index`` beside the mixture's first dataset); ``workers`` defaults to
    the cores this process may use."""
    from mimir_megatron.data import DataConfig, PackedMixture, padding_fraction

    cfg = DataConfig(mixture=str(mixture), seq_len=seq_len, seed=seed, pack_window=pack_window,
                     index_dir=str(index_dir) if index_dir is not None else None)
    stream = PackedMixture(cfg)
    workers = workers or len(os.sched_getaffinity(0))
    packed = []
    for epoch in range(epochs):
        index = stream.epoch(epoch, workers)
        packed.append(EpochPacking(epoch, index.num_contexts,
                                   padding_fraction(index, stream.sample_lengths, cfg.seq_len)))
    return PackingIndex(Path(stream.index_dir), packed)
