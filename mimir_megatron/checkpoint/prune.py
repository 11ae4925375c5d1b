"""Which checkpoints stay: pruning after a save, and setting an abandoned timeline aside."""

from __future__ import annotations

import logging
import shutil
import time
from pathlib import Path

from .layout import (
    ABANDONED,
    LATEST,
    complete_checkpoints,
    is_checkpoint,
    latest_name,
    step_dir_name,
    step_of,
    write_latest,
)

log = logging.getLogger(__name__)


def prune_checkpoints(checkpoint_dir: Path, keep: int) -> None:
    """Keep the ``keep`` most recently written checkpoints and the one ``latest`` names."""
    complete = complete_checkpoints(checkpoint_dir)
    kept = {p.name for p in complete[-keep:]} | {latest_name(checkpoint_dir)}
    for old in complete:
        if old.name not in kept:
            log.info("pruning checkpoint %s", old.name)
            shutil.rmtree(old, ignore_errors=True)


def set_aside_newer(checkpoint_dir: Path, start_step: int, resumed_from: Path | None) -> Path | None:
    """Move the checkpoints of an abandoned timeline (steps after ``start_step``) aside; rank 0.

    Run at start, before the first save: they would otherwise be pruned in place of the new
    timeline's, or overwritten by it. Incomplete ``*.tmp`` writes are deleted.
    """
    for partial_write in checkpoint_dir.glob("step_*.tmp"):
        log.info("deleting %s (a write that did not finish)", partial_write)
        shutil.rmtree(partial_write, ignore_errors=True)
    newer = [p for p in complete_checkpoints(checkpoint_dir) if step_of(p) > start_step]
    if not newer:
        return None
    stamp = time.strftime("%Y%m%dT%H%M%S", time.gmtime())
    target = checkpoint_dir / ABANDONED / f"after_{step_dir_name(start_step)}_{stamp}"
    target.mkdir(parents=True, exist_ok=True)
    for path in newer:
        path.rename(target / path.name)
    log.warning("starting at step %d: moved %d checkpoint(s) of the abandoned timeline (%s) to %s; "
                "delete them when no longer needed", start_step, len(newer),
                ", ".join(p.name for p in newer), target)
    pointer = latest_name(checkpoint_dir)
    if pointer is not None and not is_checkpoint(checkpoint_dir / pointer):
        if resumed_from is not None and resumed_from.resolve().parent == checkpoint_dir.resolve():
            write_latest(checkpoint_dir, resumed_from.name)
        else:
            (checkpoint_dir / LATEST).unlink()
    return target
