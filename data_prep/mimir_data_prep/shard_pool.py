"""Shards of one or several datasets through worker processes, with one progress line.

Shards are handed out in order (dataset by dataset, shard by shard), a few ahead of the free
workers, so that a dataset that failed is not started further; each result comes back to the
caller as it finishes. One worker runs in this process.
"""

from __future__ import annotations

import multiprocessing as mp
import queue
import time
from dataclasses import dataclass
from typing import Iterator

from .settings import PrepareSettings
from .shard_writer import ShardStats, init_worker, process_shard, set_progress
from .shards import ShardTask

_AHEAD = 2  # shards handed out per worker before one finishes


@dataclass(frozen=True)
class ShardJob:
    """One shard of one dataset (``dataset``: its number in the run, for progress and errors)."""

    dataset: int
    task: ShardTask
    settings: PrepareSettings
    out_dir: str

    def run(self) -> ShardStats:
        return process_shard(self.task, self.settings, self.out_dir, self.dataset)


def _run_job(job: ShardJob) -> ShardStats:
    return job.run()


def run_shards(
    jobs: list[ShardJob], workers: int, *, show: bool = True, skip: set[int] | None = None
) -> Iterator[tuple[ShardJob, ShardStats | BaseException]]:
    """(job, its statistics or the exception it raised) for each job, as they finish. A job of a
    dataset in ``skip`` (the caller adds the datasets that failed) is not started."""
    from tqdm import tqdm

    skip = skip if skip is not None else set()
    datasets = len({job.dataset for job in jobs})
    bar = tqdm(total=None, unit="doc", disable=not show or not jobs, dynamic_ncols=True,
               desc="prepare" if datasets <= 1 else f"prepare ({datasets} datasets)")
    counts = {"docs": 0, "tokens": 0, "rejects": 0}
    start = time.perf_counter()

    def report(dataset: int, docs: int, tokens: int, rejects: int) -> None:
        counts["docs"] += docs
        counts["tokens"] += tokens
        counts["rejects"] += rejects
        elapsed = max(time.perf_counter() - start, 1e-9)
        bar.update(docs + rejects)
        bar.set_postfix(docs_s=f"{counts['docs'] / elapsed:.0f}", tok_s=f"{counts['tokens'] / elapsed:.0f}",
                        rejects=counts["rejects"], refresh=False)

    try:
        if workers == 1:
            set_progress(report)
            for job in jobs:
                if job.dataset in skip:
                    continue
                try:
                    result: ShardStats | BaseException = job.run()
                except Exception as exc:  # the caller decides: re-raise, or fail one dataset
                    result = exc
                yield job, result
            return
        ctx = mp.get_context("spawn")  # fork after torch/tokenizers threads start is unsafe
        progress_queue = ctx.Queue()
        with ctx.Pool(workers, init_worker, (progress_queue,)) as pool:
            waiting = list(reversed(jobs))
            running: list[tuple[ShardJob, mp.pool.AsyncResult]] = []
            while waiting or running:
                while waiting and len(running) < _AHEAD * workers:
                    job = waiting.pop()
                    if job.dataset not in skip:
                        running.append((job, pool.apply_async(_run_job, (job,))))
                try:
                    while True:
                        report(*progress_queue.get(timeout=0.2))
                except queue.Empty:
                    pass
                for entry in [e for e in running if e[1].ready()]:
                    running.remove(entry)
                    job, result = entry
                    try:
                        stats: ShardStats | BaseException = result.get()
                    except Exception as exc:  # a worker's StrictModeError, say
                        stats = exc
                    yield job, stats
            while not progress_queue.empty():
                report(*progress_queue.get())
    finally:
        set_progress(None)
        bar.close()
