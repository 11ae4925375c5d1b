"""Checkpointing's helper processes, started so that the job's signals cannot kill them.

Slurm delivers a forwarded signal (``scancel --signal=USR1``, ``--signal=B:USR1@T`` through the
launcher, ``scancel``'s SIGTERM) to every process of the job step. The ranks catch it and stop
with a checkpoint, but a save also runs through helper processes: megatron-core's write-results
queue is served by a multiprocessing Manager (spawned at the first save, then reused), Python's
resource tracker comes with it, and ``checkpoint.async_save`` forks a writer per save. Started
plainly they die of that signal within a second, and the pre-emption save then talks to a dead
Manager (``[Errno 32] Broken pipe``): the job fails instead of checkpointing.

Here every such helper is started inside :func:`~mimir_megatron.stop_signals.shield_children`,
and the Manager is checked before each save and started again if it has died anyway (killed by
hand, out of memory). Synchronous saves (the default) start no helper: their results go through
an in-process queue.
"""

from __future__ import annotations

import logging
import multiprocessing
import os
import queue
from multiprocessing.managers import SyncManager
from typing import Any, Callable

from mimir_megatron.stop_signals import helper_process_init, shield_children

log = logging.getLogger(__name__)

_manager: SyncManager | None = None
_manager_queue: Any = None  # the Manager's queue (a proxy)
_in_process_queue: "queue.Queue[Any]" = queue.Queue()


def write_results_queue(cross_process: bool = True) -> Any:
    """megatron's write-results queue for the next save: for an asynchronous save (written by a
    forked process) one served by a live, signal-shielded Manager; for a synchronous save, whose
    writer threads and reader are all in this process, a plain thread-safe queue.

    megatron creates that queue on first use in ``filesystem_async._results_queue`` and reuses
    it for the life of the process; setting it here before each save makes every save use ours.
    A synchronous save needs no helper process at all: megatron's own Manager would be spawned
    and import torch to pass the write results (~4 s per process), and could be killed by a
    pre-emption signal in the middle of the save.
    """
    from megatron.core.dist_checkpointing.strategies import filesystem_async

    global _manager, _manager_queue
    if not cross_process:
        while not _in_process_queue.empty():  # what a failed save left unread
            _in_process_queue.get_nowait()
        filesystem_async._results_queue = _in_process_queue
        return _in_process_queue
    if _manager is not None and _manager_queue is not None and _alive(_manager):
        filesystem_async._results_queue = _manager_queue  # a synchronous save may have set its own
        return _manager_queue
    if _manager is not None and not _alive(_manager):
        log.warning("the checkpoint writer's helper process (pid %s) has died (exit code %s); "
                    "starting a new one", _manager._process.pid, _manager._process.exitcode)
    with shield_children():
        # The resource tracker first: spawning the Manager starts it otherwise, unshielded if it
        # is not running (a dead one is started again here, with a warning from Python).
        from multiprocessing import resource_tracker

        resource_tracker.ensure_running()
        manager = SyncManager(ctx=multiprocessing.get_context("spawn"))  # as megatron does
        manager.start(initializer=helper_process_init, initargs=(os.getpid(),))
    _manager, _manager_queue = manager, manager.Queue()
    filesystem_async._results_queue = _manager_queue
    return _manager_queue


def start_shielded(start: Callable[[], Any]) -> Any:
    """Run ``start`` (which forks or spawns a helper, e.g. megatron's async writer) shielded."""
    with shield_children():
        return start()


def _alive(manager: SyncManager) -> bool:
    process = manager._process  # multiprocessing keeps no public handle on the server process
    if process is None or not process.is_alive():
        return False
    # is_alive() answers True for a child that something else has already reaped (its waitpid
    # fails); the pid is then gone.
    try:
        os.kill(process.pid, 0)
    except ProcessLookupError:
        return False
    return True
