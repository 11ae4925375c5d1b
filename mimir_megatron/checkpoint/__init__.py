"""Training checkpoints: the one owner of their on-disk layout.

Layout of a run's checkpoints directory (``<run.dir>/checkpoints``)::

    step_0000200/            one checkpoint, visible only once complete
        (dist_checkpointing files: model, optimizer moments, EMA; resharding-capable)
        trainer_state.json   the typed TrainerState: step, consumed samples, window, group
                             steps, data fingerprint and lineage, model shape, MLflow run id,
                             layout version, the size and sha256 of every other file; the
                             digest of its own content
        rng_rank<r>.safetensors  each rank's RNG state
    latest                   name of the newest complete checkpoint (replaced atomically)
    abandoned/               checkpoints of a timeline given up by resuming from an older one

Every command that takes a checkpoint accepts three forms: a ``step_N`` directory, a checkpoints
directory (its ``latest`` is followed; a ``latest`` naming a missing checkpoint is an error, never
a silent fresh start), or the run directory that holds it as ``checkpoints/``. The modules, each
with one job:

- :mod:`.layout`: names, ``latest``, the resolver (:func:`resolve`).
- :mod:`.trainer_state`: :class:`TrainerState`, its one reader and one writer.
- :mod:`.run_directory`: the paths of a run, derived in one place (:class:`~.run_directory.RunDirectory`).
- :mod:`.model_dir`: which form a model directory has, and the model value a command resolves
  once (:class:`~.model_dir.ModelDir`: tokenizer, trained schedule, display and served names,
  training record, run directory and lineage, the weights).
- :mod:`.compat`: layout version and model-shape checks (whether training may go on from a
  checkpoint is the trainer's policy: ``mimir_megatron.train.resume``).
- :mod:`.state`: the sharded model/optimizer/EMA state and the per-rank RNG state.
- :mod:`.digests`: the files' sha256, recorded where each rank writes, verified before any load.
- :mod:`.load`: :func:`load_checkpoint` (training state into a built model) and
  :func:`load_model` (a model on its own: export, generate, serve, eval, audits); both verify.
- :mod:`.write`: :class:`CheckpointWriter` (synchronous or asynchronous); :mod:`.prune`.

This package imports the model, never the trainer: inference, evaluation and audits use it.
The compatibility checks (omegaconf), writer and loaders (megatron-core) are imported on first
use, so reading the layout is cheap.
"""

from __future__ import annotations

from mimir_megatron.lazy import lazy_exports

from .layout import (
    FORMAT,
    FORMS_HELP,
    RUN_CHECKPOINTS,
    find,
    is_checkpoint,
    is_checkpoint_source,
    latest_checkpoint,
    resolve,
    step_dir_name,
)
from .model_dir import (
    MODEL_FORMS_HELP,
    ModelDir,
    ModelKind,
    TrainingRecord,
    add_model_arguments,
    detect_model_dir,
    model_dir_from_args,
    resolve_model_dir,
)
from .trainer_state import BaseModel, DatasetLineage, TrainerState, read_trainer_state

# Imported on first use: the layout alone is what a command's --help needs (no omegaconf, no torch).
_LAZY = {
    "check_compatible": ".compat", "check_format": ".compat",
    "load_checkpoint": ".load", "load_model": ".load", "execution_overrides": ".load",
    "CheckpointWriter": ".write", "CheckpointWriteError": ".write", "check_writable": ".write",
    "optimizer_group_steps": ".state", "prune_checkpoints": ".prune", "set_aside_newer": ".prune",
}
__getattr__ = lazy_exports(__name__, _LAZY)

__all__ = [
    "FORMAT", "FORMS_HELP", "MODEL_FORMS_HELP", "RUN_CHECKPOINTS", "BaseModel", "ModelDir", "ModelKind",
    "add_model_arguments", "detect_model_dir", "model_dir_from_args", "resolve_model_dir",
    "DatasetLineage", "TrainerState", "TrainingRecord", "find",
    "is_checkpoint", "is_checkpoint_source", "latest_checkpoint", "read_trainer_state", "resolve",
    "step_dir_name", *_LAZY,
]
