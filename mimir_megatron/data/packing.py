"""The epoch plan and best-fit packing of whole samples into fixed-length contexts.

Everything here is a pure function of (document lengths, repeat factors, seed, epoch, seq_len,
window): no world size, no rank. The loader slices the result per data-parallel rank.

Packing is best-fit-decreasing inside windows of consecutive samples of the shuffled plan: a
window's samples are sorted longest first and each goes into the open context whose free space
fits it most tightly. Windows keep memory and the sort local; the contexts of the whole epoch are
shuffled at the end so that a batch does not see only the long-sample contexts of a window.
"""

from __future__ import annotations

import logging
from bisect import bisect_left
from dataclasses import dataclass
from typing import Sequence

import numpy as np

from . import bestfit

log = logging.getLogger(__name__)

PACKING_VERSION = 1  # bump when the algorithm changes: it is part of the cache key
NATIVE_PER_WORKER = 4_000_000  # samples worth a packing process of their own, in C


@dataclass(frozen=True)
class EpochIndex:
    """Contexts of one epoch: context c holds documents ``docs[offsets[c]:offsets[c + 1]]``
    (global document ids, i.e. dataset offset + document number)."""

    docs: np.ndarray  # int32 (int64 beyond 2**31 documents)
    offsets: np.ndarray  # int64, len = contexts + 1

    @property
    def num_contexts(self) -> int:
        return len(self.offsets) - 1


def epoch_plan(
    doc_counts: Sequence[int], repeats: Sequence[float], seed: int, epoch: int
) -> np.ndarray:
    """Shuffled global document ids of one epoch.

    A repeat factor r contributes floor(r) full copies of the dataset plus a seeded random
    subset of round(frac(r) * documents) documents, drawn afresh every epoch.
    """
    counts = np.asarray(doc_counts, dtype=np.int64)
    starts = np.concatenate([[0], np.cumsum(counts)])
    dtype = _id_dtype(int(starts[-1]))
    subsets = [int(round((r - int(r)) * n)) for n, r in zip(doc_counts, repeats)]
    total = sum(int(r) * n + k for n, r, k in zip(doc_counts, repeats, subsets))
    plan = np.empty(total, dtype=dtype)  # filled in place: no list of parts to concatenate
    pos = 0
    for i, (count, repeat) in enumerate(zip(doc_counts, repeats)):
        for _ in range(int(repeat)):
            plan[pos : pos + count] = np.arange(starts[i], starts[i] + count, dtype=dtype)
            pos += count
        if subsets[i]:
            rng = np.random.default_rng([seed, epoch, i, 1])
            chosen = np.sort(rng.choice(count, subsets[i], replace=False))
            plan[pos : pos + subsets[i]] = starts[i] + chosen
            pos += subsets[i]
    np.random.default_rng([seed, epoch, 0]).shuffle(plan)
    return plan


def _id_dtype(count: int) -> type:
    """int32 ids while they fit: halves the index of a 100M-sample epoch."""
    return np.int32 if count < 2**31 else np.int64


def _best_fit(lengths: list[int], seq_len: int) -> list[list[int]]:
    """Best-fit-decreasing of one window; returns contexts as lists of window positions."""
    order = sorted(range(len(lengths)), key=lengths.__getitem__, reverse=True)
    smallest = min(lengths)
    caps: list[int] = []  # free space of open contexts, ascending
    owners: list[int] = []  # context number for each entry of caps
    bins: list[list[int]] = []
    for i in order:
        n = lengths[i]
        j = bisect_left(caps, n)
        if j == len(caps):
            b = len(bins)
            bins.append([i])
            free = seq_len - n
        else:
            free = caps.pop(j) - n
            b = owners.pop(j)
            bins[b].append(i)
        if free >= smallest:  # nothing in this window could ever fill less
            k = bisect_left(caps, free)
            caps.insert(k, free)
            owners.insert(k, b)
    return bins


def _pack_windows(
    lengths: np.ndarray, seq_len: int, window: int, native: bool = False
) -> tuple[np.ndarray, np.ndarray]:
    """Best fit of consecutive windows of ``lengths``: (window positions of every context's
    items, context after context; items per context). ``native``: through the C loop
    (:mod:`.bestfit`, the same result) when the install built it."""
    lib = bestfit.library() if native else None
    if lib is not None:
        return bestfit.pack_windows_native(lib, lengths, seq_len, window)
    dtype = _id_dtype(len(lengths))
    items: list[np.ndarray] = []
    sizes: list[np.ndarray] = []
    for w0 in range(0, len(lengths), window):
        chunk = lengths[w0 : w0 + window].tolist()
        bins = _best_fit(chunk, seq_len)
        window_items = np.fromiter((i for b in bins for i in b), dtype, sum(map(len, bins)))
        window_items += w0
        items.append(window_items)
        sizes.append(np.fromiter(map(len, bins), np.int64, len(bins)))
    if not items:
        return np.zeros(0, dtype), np.zeros(0, np.int64)
    return np.concatenate(items), np.concatenate(sizes)


def _packed_windows(
    lengths: np.ndarray, seq_len: int, window: int, workers: int, native: bool = False
) -> tuple[np.ndarray, np.ndarray]:
    """:func:`_pack_windows` of all of ``lengths``, its windows spread over ``workers`` processes
    (windows are independent: the result is the same for any number of workers)."""
    windows = -(-len(lengths) // window)
    native = native and bestfit.library() is not None  # looked up here once, not in every process
    # a few windows are not worth a process; in C, a process packs ~10M samples a second
    workers = max(1, min(workers, windows // 4, -(-len(lengths) // NATIVE_PER_WORKER) if native else workers))
    if workers == 1:
        return _pack_windows(lengths, seq_len, window, native)
    import multiprocessing as mp
    from concurrent.futures import ProcessPoolExecutor

    per_task = window * max(1, -(-windows // (4 * workers)))  # 4 tasks per worker: even finish
    bounds = range(0, len(lengths), per_task)
    dtype = _id_dtype(len(lengths))
    # spawn: the caller (a trainer) has torch threads running, which fork would copy mid-state.
    with ProcessPoolExecutor(workers, mp_context=mp.get_context("spawn")) as pool:
        parts = list(pool.map(_pack_windows, (lengths[b : b + per_task] for b in bounds),
                              [seq_len] * len(bounds), [window] * len(bounds), [native] * len(bounds)))
    flat = np.concatenate([items.astype(dtype) + b for b, (items, _) in zip(bounds, parts)])
    return flat, np.concatenate([size for _, size in parts])


def pack(
    lengths: np.ndarray, seq_len: int, window: int, seed: int, epoch: int, workers: int = 1,
    native: bool = True,
) -> EpochIndex:
    """Pack samples (``lengths[i]`` positions each, all <= seq_len) into contexts.

    Returns an EpochIndex whose ``docs`` are *positions into lengths*; the caller maps them.
    ``workers`` > 1 packs windows in that many processes, with the same result. ``native``: the
    best fit in C (:mod:`.bestfit`; the same result) when the install built it; False: in Python.
    """
    if len(lengths) and int(lengths.max()) > seq_len:
        raise ValueError(f"a sample of {int(lengths.max())} tokens exceeds seq_len={seq_len}")
    dtype = _id_dtype(len(lengths))
    flat, size = _packed_windows(np.asarray(lengths), seq_len, window, workers, native)
    if not len(size):
        return EpochIndex(np.zeros(0, dtype), np.zeros(1, np.int64))
    starts = np.concatenate([[0], np.cumsum(size)[:-1]])
    # Shuffle whole contexts, then gather their items in the new order.
    perm = np.random.default_rng([seed, epoch, 2]).permutation(len(size))
    new_size = size[perm]
    offsets = np.concatenate([[0], np.cumsum(new_size)])
    gather = np.repeat((starts[perm] - offsets[:-1]).astype(dtype), new_size)
    gather += np.arange(len(flat), dtype=dtype)
    return EpochIndex(flat[gather], offsets)


def build_epoch_index(
    sample_lengths: np.ndarray,
    doc_counts: Sequence[int],
    repeats: Sequence[float],
    *,
    seq_len: int,
    seed: int,
    epoch: int,
    window: int,
    workers: int = 1,
) -> EpochIndex:
    """Plan and pack one epoch; ``sample_lengths[g]`` is the packed length of global doc g.
    ``workers``: processes packing its windows (the result does not depend on it)."""
    plan = epoch_plan(doc_counts, repeats, seed, epoch)
    lengths = sample_lengths[plan]
    too_long = lengths > seq_len
    if too_long.any():  # rare: only when data was prepared for a longer context
        log.warning(
            "epoch %d: skipping %d sample(s) longer than seq_len=%d (prepared with a larger "
            "--seq-len?)",
            epoch,
            int(too_long.sum()),
            seq_len,
        )
        plan, lengths = plan[~too_long], lengths[~too_long]
    packed = pack(lengths, seq_len, window, seed, epoch, workers)
    del lengths
    return EpochIndex(plan[packed.docs], packed.offsets)


def padding_fraction(index: EpochIndex, sample_lengths: np.ndarray, seq_len: int) -> float:
    """Share of context positions that hold padding."""
    if index.num_contexts == 0:
        return 0.0
    used = int(sample_lengths[index.docs].sum())
    return 1.0 - used / (index.num_contexts * seq_len)
