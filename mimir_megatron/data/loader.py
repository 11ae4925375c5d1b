"""From a mixture to ``Batch`` objects: the packed sample stream, sharded and resumable.

Sample numbering. The stream is an endless sequence of packed contexts ("samples"): epoch 0's
contexts, then epoch 1's, and so on, each epoch planned and packed from the seed alone. Global
sample ``g`` is therefore the same context for every world size.

Sharding. Micro-batch ``k`` of rank ``r`` holds the contiguous samples
``[k * M * D + r * M, k * M * D + (r + 1) * M)`` for micro-batch size ``M`` and data-parallel size
``D``. A global batch of ``G`` samples (any multiple of ``M * D``, gradient accumulation included)
is samples ``[b * G, (b + 1) * G)``, so DP=1 with M=4 and DP=2 with M=2 train on the same global
batches. ``consumed_samples`` counts global samples (all ranks) and must be a multiple of
``M * D``; resuming from it continues exactly where the stream stopped.
"""

from __future__ import annotations

import logging
import os
import time
from pathlib import Path
from typing import Iterator

import numpy as np
import torch

from mimir_megatron.batch import IGNORE_INDEX, Batch
from mimir_megatron.errors import UserError, write_error
from mimir_megatron.integrity import Fingerprint, atomic_files

from .config import DataConfig
from .mixture import Mixture, load_mixture, mixture_digest
from .packing import PACKING_VERSION, EpochIndex, build_epoch_index, padding_fraction
from .prepared import PreparedDataset

log = logging.getLogger(__name__)

Sample = tuple[np.ndarray, np.ndarray]  # (prefix ids, response ids)


def mixture_fingerprint(cfg: DataConfig, mixture: Mixture | None = None) -> Fingerprint:
    """Hash of everything that decides the sample stream: the datasets' manifests (their output
    sha256s), repeat factors, seq_len, seed and packing algorithm. A checkpoint stores it so that
    a resume on changed data is refused instead of silently replaying a different stream.
    ``mixture`` is ``cfg.mixture`` already loaded (read here when not given)."""
    return mixture_digest(
        mixture if mixture is not None else load_mixture(cfg.mixture),
        {
            "seq_len": cfg.seq_len,
            "seed": cfg.seed,
            "pack_window": cfg.pack_window,
            "packing": PACKING_VERSION,
        },
    )


class PackedMixture:
    """The global, world-size independent stream of packed contexts of one mixture."""

    def __init__(self, cfg: DataConfig, mixture: Mixture | None = None) -> None:
        """``mixture`` is ``cfg.mixture`` already loaded (read here when not given)."""
        cfg.validate()
        self.cfg = cfg
        self.mixture: Mixture = mixture if mixture is not None else load_mixture(cfg.mixture)
        self.datasets = [PreparedDataset(e.path) for e in self.mixture.entries]
        counts = [d.num_documents for d in self.datasets]
        self.doc_counts = counts
        self.doc_starts = np.concatenate([[0], np.cumsum(np.asarray(counts, dtype=np.int64))])
        self.repeats = [e.repeat for e in self.mixture.entries]
        self.fingerprint = mixture_fingerprint(cfg, self.mixture)
        self.index_dir = cfg.index_directory(self.mixture.entries[0].path)
        self._lengths: dict[str, np.ndarray] = {}
        self._epochs: list[EpochIndex] = []
        self._ends: list[int] = []  # cumulative contexts at the end of each epoch located so far
        self.built_epochs: list[int] = []
        """Epochs this process packed (not read from the cache), in order: start-up builds them
        ahead of the step loop (:meth:`build_ahead`); a test checks no rank does inside it."""

    @property
    def sample_lengths(self) -> np.ndarray:
        """Packed length (prefix + response - 1) of every global document, int32, memory-mapped
        from the index directory (written once from the shards' ``.idx`` files): the ranks of a
        node share its pages instead of each holding its own copy."""
        return self._cached_lengths("sample")

    @property
    def _response_lengths(self) -> np.ndarray:
        return self._cached_lengths("response")

    def _cached_lengths(self, kind: str) -> np.ndarray:
        if kind not in self._lengths:
            path = self.index_dir / f"{self.mixture.name}-{self.fingerprint[:16]}.{kind}-lengths.npy"
            if not path.is_file():
                self._write_lengths()
            self._lengths[kind] = np.load(path, mmap_mode="r")
        return self._lengths[kind]

    def _write_lengths(self) -> None:
        """Both length files, one shard at a time (memory: one shard's lengths)."""
        total = int(self.doc_starts[-1])
        stem = f"{self.mixture.name}-{self.fingerprint[:16]}"
        paths = {k: self.index_dir / f"{stem}.{k}-lengths.npy" for k in ("sample", "response")}

        def write(tmp: dict[str, Path]) -> None:
            out = {k: np.lib.format.open_memmap(p, mode="w+", dtype=np.int32, shape=(total,))
                   for k, p in tmp.items()}
            pos = 0
            for ds in self.datasets:
                for shard in range(len(ds.shard_prefixes)):
                    lengths = ds.shard_lengths(shard)
                    n = len(lengths)
                    out["sample"][pos : pos + n] = lengths[:, 0] + lengths[:, 1] - 1
                    out["response"][pos : pos + n] = lengths[:, 1]
                    pos += n
            for array in out.values():
                array.flush()
            del out

        self._save(paths, write, needed=8 * total)

    def _save(self, paths: dict[str, Path], write, needed: int) -> None:
        """Write cache files under temporary names, then rename them: ranks racing to write the
        same files write identical ones harmlessly, and a reader never sees half a file. A cache
        (made again when missing): not fsynced."""
        try:
            self.index_dir.mkdir(parents=True, exist_ok=True)
            with atomic_files(*paths.values(), suffix=".npy", fsync=False) as staged:
                write(dict(zip(paths, staged)))
        except OSError as exc:
            raise write_error(exc, self.index_dir, "set data.index_dir to a writable directory (the packing "
                              "index is cached there)", needed=needed) from None

    def source_counts(self, docs: np.ndarray) -> np.ndarray:
        """``[datasets, 3]`` int64: documents, tokens (prefix + response) and response tokens of
        each dataset among the global document ids ``docs`` (the data lineage of a batch)."""
        n = len(self.datasets)
        dataset = np.searchsorted(self.doc_starts, docs, side="right") - 1
        tokens = self.sample_lengths[docs].astype(np.int64) + 1
        counts = np.zeros((n, 3), dtype=np.int64)
        np.add.at(counts[:, 0], dataset, 1)
        np.add.at(counts[:, 1], dataset, tokens)
        np.add.at(counts[:, 2], dataset, self._response_lengths[docs].astype(np.int64))
        return counts

    def _cache_paths(self, epoch: int) -> dict[str, Path]:
        stem = f"{self.mixture.name}-{self.fingerprint[:16]}-e{epoch:04d}"
        return {kind: self.index_dir / f"{stem}.{kind}.npy" for kind in ("docs", "offsets")}

    def epoch(self, epoch: int, workers: int = 1) -> EpochIndex:
        """Load the cached index of ``epoch`` (memory-mapped) or build and cache it. ``workers``:
        processes that pack its windows (the result does not depend on it)."""
        paths = self._cache_paths(epoch)
        if all(p.is_file() for p in paths.values()):
            return EpochIndex(np.load(paths["docs"], mmap_mode="r"), np.load(paths["offsets"], mmap_mode="r"))
        started = time.perf_counter()
        index = build_epoch_index(
            self.sample_lengths,
            self.doc_counts,
            self.repeats,
            seq_len=self.cfg.seq_len,
            seed=self.cfg.seed,
            epoch=epoch,
            window=self.cfg.pack_window,
            workers=workers,
        )
        self.built_epochs.append(epoch)
        log.info(
            "epoch %d: %d contexts of %d tokens, padding %.2f %% (packed in %.1f s)",
            epoch,
            index.num_contexts,
            self.cfg.seq_len,
            100 * padding_fraction(index, self.sample_lengths, self.cfg.seq_len),
            time.perf_counter() - started,
        )

        def write(tmp: dict[str, Path]) -> None:
            for key, array in (("docs", index.docs), ("offsets", index.offsets)):
                with tmp[key].open("wb") as f:
                    np.save(f, array)

        self._save(paths, write, needed=index.docs.nbytes + index.offsets.nbytes)
        # Read back memory-mapped: epochs built ahead do not stay in this process's memory.
        return EpochIndex(np.load(paths["docs"], mmap_mode="r"), np.load(paths["offsets"], mmap_mode="r"))

    def build_ahead(self, samples: int, workers: int | None = None) -> int:
        """Pack and cache every epoch that global samples ``[0, samples)`` reach (the cached ones
        are only opened), so that no rank packs one at an epoch boundary of the step loop: the
        trainer's rank 0 calls this at start-up with the run's planned end while the other ranks
        wait, then they all read the cache. ``workers``: packing processes (default: the cores
        this process may use). Returns the number of epochs."""
        if workers is None:
            workers = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
            workers = workers or 1
        self._locate(0, workers)
        while self._ends[-1] < samples:  # every epoch the run reaches, however many
            self._locate(self._ends[-1], workers)
        if self.built_epochs:
            log.info("packing index: %d epoch(s) ready, %d packed now", len(self._ends),
                     len(self.built_epochs))
        return len(self._ends)

    def locate(self, sample: int) -> tuple[int, int]:
        """(epoch, context within the epoch) of global sample ``sample``."""
        return self._locate(sample, 1)

    def _locate(self, sample: int, workers: int) -> tuple[int, int]:
        if sample < 0:
            raise IndexError(f"sample {sample} < 0")
        while not self._ends or self._ends[-1] <= sample:
            index = self.epoch(len(self._epochs), workers)
            if index.num_contexts == 0:
                raise UserError(f"{self.mixture.source}: the mixture yields no samples")
            self._epochs.append(index)
            self._ends.append((self._ends[-1] if self._ends else 0) + index.num_contexts)
        epoch = int(np.searchsorted(self._ends, sample, side="right"))
        start = self._ends[epoch - 1] if epoch else 0
        return epoch, sample - start

    def document(self, doc: int) -> Sample:
        ds = int(np.searchsorted(self.doc_starts, doc, side="right") - 1)
        return self.datasets[ds].document(doc - int(self.doc_starts[ds]))

    def context_documents(self, sample: int) -> np.ndarray:
        """Global document ids packed into global sample ``sample``."""
        epoch, ctx = self.locate(sample)
        index = self._epochs[epoch]
        return np.asarray(index.docs[index.offsets[ctx] : index.offsets[ctx + 1]])

    def context(self, sample: int) -> list[Sample]:
        return [self.document(int(d)) for d in self.context_documents(sample)]


def collate(rows: list[list[Sample]], seq_len: int, pad_token_id: int = 0) -> Batch:
    """Lay out packed rows: per sample, input = prefix ++ response[:-1], labels =
    [-100] * (len(prefix) - 1) ++ response, positions restart at 0, segments count from 1."""
    shape = (len(rows), seq_len)
    input_ids = np.full(shape, pad_token_id, dtype=np.int64)
    labels = np.full(shape, IGNORE_INDEX, dtype=np.int64)
    position_ids = np.zeros(shape, dtype=np.int64)
    segment_ids = np.zeros(shape, dtype=np.int64)
    prefix_mask = np.zeros(shape, dtype=bool)
    for r, samples in enumerate(rows):
        pos = 0
        for seg, (prefix, response) in enumerate(samples, start=1):
            p, n = len(prefix), len(prefix) + len(response) - 1
            if pos + n > seq_len:
                raise ValueError(f"row {r}: samples need more than seq_len={seq_len} positions")
            input_ids[r, pos : pos + p] = prefix
            input_ids[r, pos + p : pos + n] = response[:-1]
            labels[r, pos + p - 1 : pos + n] = response
            position_ids[r, pos : pos + n] = np.arange(n)
            segment_ids[r, pos : pos + n] = seg
            prefix_mask[r, pos : pos + p] = True
            pos += n
    return Batch(
        input_ids=torch.from_numpy(input_ids),
        position_ids=torch.from_numpy(position_ids),
        segment_ids=torch.from_numpy(segment_ids),
        prefix_mask=torch.from_numpy(prefix_mask),
        labels=torch.from_numpy(labels),
    )


def build_train_loader(
    cfg: DataConfig,
    *,
    micro_batch_size: int,
    dp_rank: int,
    dp_size: int,
    consumed_samples: int = 0,
    stream: PackedMixture | None = None,
) -> Iterator[Batch]:
    """Endless micro-batches of ``[micro_batch_size, cfg.seq_len]`` for one data-parallel rank.

    See the module docstring for which global samples each rank gets. The mixture is opened and
    validated here, before the first batch is requested, unless the caller passes the ``stream``
    it already opened.
    """
    if micro_batch_size < 1:
        raise ValueError(f"micro_batch_size must be >= 1, got {micro_batch_size}")
    if not 0 <= dp_rank < dp_size:
        raise ValueError(f"dp_rank={dp_rank} outside [0, dp_size={dp_size})")
    step = micro_batch_size * dp_size
    if consumed_samples < 0 or consumed_samples % step:
        raise ValueError(
            f"consumed_samples={consumed_samples} is not a multiple of micro_batch_size * dp_size "
            f"= {step}"
        )
    stream = stream if stream is not None else PackedMixture(cfg)
    return _iterate(stream, micro_batch_size, consumed_samples + dp_rank * micro_batch_size, step)


def _iterate(stream: PackedMixture, mbs: int, first: int, step: int) -> Iterator[Batch]:
    sample = first
    while True:
        docs = [stream.context_documents(sample + i) for i in range(mbs)]
        rows = [[stream.document(int(d)) for d in row] for row in docs]
        batch = collate(rows, stream.cfg.seq_len, stream.cfg.pad_token_id)
        batch.sources = stream.source_counts(np.concatenate(docs))
        yield batch
        sample += step
