"""Setting up a process: the one function every entry point calls.

Importing any module of this package changes nothing in the interpreter (no warning filters, no
import hooks, no logger levels, no patched torch or megatron-core). An entry point (the ``mimir``
CLI, worker and benchmark scripts, the test configuration) calls :func:`setup_process` once, first:

- the import hook that keeps megatron-core's import from loading torch's compiler
  (:mod:`mimir_megatron.megatron_import`; it must precede megatron-core's import);
- the known start-up noise dropped by exact message (:func:`~.logging_setup.quiet_known_noise`);
- logging (rank 0 speaks), unless the caller keeps its own (pytest);
- with ``megatron=True``, the CPU backend for megatron-core (:func:`~.backend.setup`; on a GPU
  it does nothing). Library code that builds a process group gets it from
  :func:`mimir_megatron.parallel.init_distributed` too.

Each step is idempotent: calling it again (a command that needs megatron-core once its input
paths are checked) only adds what was not done.

A long-running service calls :func:`freeze_startup_objects` once it is built.
"""

from __future__ import annotations

import gc


def setup_process(*, verbose: bool = False, megatron: bool = False, configure_logging: bool = True) -> None:
    from mimir_megatron import megatron_import
    from mimir_megatron.logging_setup import quiet_known_noise, setup_logging

    megatron_import.install()
    quiet_known_noise()
    if configure_logging:
        setup_logging(verbose=verbose)
    if megatron:
        from mimir_megatron import backend

        backend.setup()


def freeze_startup_objects() -> int:
    """Move every object alive now (the imported libraries, the model, the app) out of the
    garbage collector's reach, as vLLM's server does; returns how many are frozen. Python's full
    collection scans all of them, and in ``mimir serve`` (~490,000 objects once torch, megatron-
    core and the server are loaded) one took ~220 ms on 2 CPU cores, a stall of every stream it
    hit; after the freeze it scans only what serving made since (<1 ms). The frozen objects are
    never collected: only start-up's, which live as long as the process."""
    gc.collect()  # start-up's garbage goes first, not into the permanent generation
    gc.freeze()
    return gc.get_freeze_count()
