"""The order in which pytest-xdist hands test modules to its workers (``--dist loadscope``).

`tests/run.sh` runs the suite on several workers, a module at a time (its module-scoped trained
fixtures are then built once). A worker that picks up a module of several minutes near the end
leaves the others idle, so the modules that take minutes go first, longest first (the numbers
are their totals in `--durations` on the 2-core development machine); every other module keeps
its collection order. A stale list costs time, never correctness.
"""

from __future__ import annotations

import pytest

LONGEST_FIRST = (
    # builds the image (~1 min from Docker's cache; a cold machine: base, wheelhouse, ~10 min),
    # then waits mostly on containers: first, so that it overlaps the demo's training
    "tests/system/test_docker.py",
    "tests/system/test_readme_results.py",  # trains the demo (~4 min alone), then `mimir sweep`
    "tests/system/test_slurm.py",  # one- and two-node clusters, ~4 min
    "tests/system/test_ui_browser.py",  # a 6-step run, `mimir ui`, three chromium pages, ~3 min
    "tests/integration/test_data_epochs.py",  # a 2-rank run across epoch boundaries, resumes, ~2 min
    "tests/integration/test_train_parallel.py",  # four 2-rank gloo runs, ~1 min
    "tests/integration/test_train_distributed_optimizer.py",  # two 2-rank runs, six 1-rank, a kill -9
    "tests/integration/test_plan_memory.py",  # 27 measured train steps, 1 and 2 ranks, ~40 s
    "tests/integration/test_checkpoint_reliability.py",
    "tests/integration/test_checkpoint_signals.py",
    "tests/integration/test_integrity_checkpoints.py",  # a second trainer's start, three resumes
    "tests/integration/test_audit_canaries.py",
    "tests/integration/test_checkpoint_commands.py",
    "tests/integration/test_serve.py",
    "tests/system/test_launchers.py",
    "tests/integration/test_mlflow_server.py",
    "tests/integration/test_cli.py",
)


def order_longest_first(items: list[pytest.Item]) -> None:
    """Sort ``items`` in place: the modules of :data:`LONGEST_FIRST` in that order, then the rest."""
    rank = {path: i for i, path in enumerate(LONGEST_FIRST)}
    position = {id(item): i for i, item in enumerate(items)}
    items.sort(key=lambda item: (rank.get(item.nodeid.split("::")[0], len(rank)), position[id(item)]))
