"""Build the next micro-batches on a background thread while the current step computes.

The loader collates packed contexts from memory-mapped datasets in Python; synchronously, a GPU
would idle for that time after every step's host sync (loss, grad norm). A thread keeps
``depth`` batches ready; on a GPU they are pinned so the copy to the device is asynchronous.
Prefetching changes nothing about which samples a step gets: the stream is deterministic by
sample number, and batches prefetched but unused when a run stops are simply rebuilt on resume.
"""

from __future__ import annotations

import queue
import threading
from typing import Iterator

import torch

from mimir_megatron.batch import Batch

_END = object()


class DevicePrefetcher:
    """Iterate ``batches`` ``depth`` ahead on a daemon thread, yielding them on ``device``."""

    def __init__(self, batches: Iterator[Batch], device: torch.device, depth: int = 2) -> None:
        if depth < 1:
            raise ValueError(f"prefetch depth must be >= 1, got {depth}")
        self._device = device
        self._pin = device.type == "cuda"
        self._queue: queue.Queue = queue.Queue(maxsize=depth)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._fill, args=(batches,), name="batch-prefetch",
                                         daemon=True)
        self._thread.start()

    def _fill(self, batches: Iterator[Batch]) -> None:
        try:
            for batch in batches:
                if self._pin:
                    batch = batch.pin_memory()
                while not self._stop.is_set():
                    try:
                        self._queue.put(batch, timeout=0.1)
                        break
                    except queue.Full:
                        continue
                if self._stop.is_set():
                    return
            self._queue.put(_END)
        except BaseException as exc:  # surfaced to the consumer, with its traceback
            self._queue.put(exc)

    def __iter__(self) -> "DevicePrefetcher":
        return self

    def __next__(self) -> Batch:
        item = self._queue.get()
        if item is _END:
            raise StopIteration
        if isinstance(item, BaseException):
            raise item
        return item.to(self._device)

    def close(self) -> None:
        """Stop the thread (it finishes the batch it is building)."""
        self._stop.set()
        self._thread.join(timeout=10)
