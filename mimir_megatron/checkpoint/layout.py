"""The on-disk layout of training checkpoints: names, the ``latest`` pointer, and the resolver.

This module is the only place that knows a checkpoint's file names; everything else asks it.
"""

from __future__ import annotations

import logging
from pathlib import Path

from mimir_megatron.errors import UserError
from mimir_megatron.integrity import write_bytes_atomic

from .trainer_state import STATE_FILE, TrainerState, read_trainer_state

log = logging.getLogger(__name__)

FORMAT = 1
"""Layout version of the sharded state; bumped whenever its keys change."""
LATEST = "latest"
ABANDONED = "abandoned"
RUN_CHECKPOINTS = "checkpoints"
"""A run directory's checkpoints directory (where training writes unless ``checkpoint.dir`` is set)."""
FORMS_HELP = "a step_N directory, a run's checkpoints directory (its latest) or the run directory"
"""The path forms :func:`resolve` takes, as every command's ``--help`` names them."""


def step_dir_name(step: int) -> str:
    return f"step_{step:07d}"


def step_of(path: Path) -> int:
    return int(path.name.removeprefix("step_"))


def rng_file(path: Path, rank: int) -> Path:
    """Where rank ``rank`` keeps its RNG state inside checkpoint ``path``."""
    return path / f"rng_rank{rank}.safetensors"


def is_checkpoint(path: Path) -> bool:
    """Whether ``path`` is one complete checkpoint (a ``step_N`` directory whose state is written)."""
    return (Path(path) / STATE_FILE).is_file()


def complete_checkpoints(checkpoint_dir: Path) -> list[Path]:
    """Complete checkpoints in ``checkpoint_dir``, oldest *written* first (not lowest step)."""
    found = [p for p in checkpoint_dir.glob("step_*") if p.name[5:].isdigit() and is_checkpoint(p)]

    def written(path: Path) -> tuple[float, int]:
        try:
            at = float(read_trainer_state(path).written_at)
        except UserError:
            at = 0.0  # unreadable: oldest, pruned first
        return at, step_of(path)

    return sorted(found, key=written)


def latest_name(checkpoint_dir: Path) -> str | None:
    pointer = checkpoint_dir / LATEST
    return pointer.read_text().strip() if pointer.is_file() else None


def write_latest(checkpoint_dir: Path, name: str) -> None:
    """Point ``latest`` at ``name``, atomically (a reader sees the old or the new name)."""
    write_bytes_atomic(checkpoint_dir / LATEST, (name + "\n").encode())


def latest_checkpoint(checkpoint_dir: Path) -> Path | None:
    """The checkpoint ``latest`` names; None only when the directory holds no checkpoint at all.

    A ``latest`` naming a missing or incomplete checkpoint is an error: starting again from step
    0 would silently throw the run away. Without a ``latest`` (a kill between the rename and the
    pointer update) the newest written checkpoint is taken.
    """
    name = latest_name(checkpoint_dir)
    if name is None:
        complete = complete_checkpoints(checkpoint_dir)
        if complete:
            log.warning("%s has no `latest`; taking the newest written checkpoint, %s",
                        checkpoint_dir, complete[-1].name)
            return complete[-1]
        return None
    path = checkpoint_dir / name
    if not is_checkpoint(path):
        present = ", ".join(p.name for p in complete_checkpoints(checkpoint_dir)) or "none"
        raise UserError(
            f"{checkpoint_dir / LATEST} names {name}, which is not a complete checkpoint; refusing "
            f"to start again from step 0 (complete checkpoints here: {present}). Pass "
            "checkpoint.resume=<checkpoint directory>, or checkpoint.resume=never to start afresh"
        )
    return path


def _holds_checkpoints(path: Path) -> bool:
    """Whether ``path`` looks like a checkpoints directory: a ``latest`` or ``step_N`` entries."""
    return (path / LATEST).is_file() or any(p.name[5:].isdigit() for p in path.glob("step_*"))


def is_checkpoint_source(path: str | Path) -> bool:
    """Whether ``path`` is meant as a training checkpoint: a ``step_N`` directory, a run's
    checkpoints directory, or the run directory holding it (``<run.dir>``, as `mimir ui
    --run-dir` takes it), complete or not."""
    path = Path(path)
    if not path.is_dir():
        return False
    return is_checkpoint(path) or _holds_checkpoints(path) or _holds_checkpoints(path / RUN_CHECKPOINTS)


def resolve(path: str | Path) -> Path:
    """The one checkpoint ``path`` stands for: ``path`` itself when it is a ``step_N`` checkpoint,
    else (a run's checkpoints directory, or the run directory holding it as ``checkpoints/``) the
    one its ``latest`` names, else its newest written.

    Anything else, a dangling ``latest`` included, is a one-line :class:`UserError`.
    """
    path = Path(path)
    if is_checkpoint(path):
        return path
    if not path.is_dir():
        raise UserError(f"checkpoint not found: {path}")
    if not _holds_checkpoints(path) and _holds_checkpoints(path / RUN_CHECKPOINTS):
        path = path / RUN_CHECKPOINTS  # a run directory
    found = latest_checkpoint(path)
    if found is None:
        raise UserError(f"{path} is not a training checkpoint (no {STATE_FILE}, no {LATEST}, "
                        f"no complete step_N checkpoint, no {RUN_CHECKPOINTS}/ holding them)")
    return found


def find(path: str | Path) -> tuple[Path, TrainerState] | None:
    """(checkpoint, its trainer state) when ``path`` is a training checkpoint in either form;
    None when it is something else (project weights, a transformers directory)."""
    if not is_checkpoint_source(path):
        return None
    resolved = resolve(path)
    return resolved, read_trainer_state(resolved)
