"""Which model directory is this? One answer for every command that reads a model.

A model comes in three forms: a training checkpoint (:data:`FORMS_HELP`: a ``step_N`` directory,
a run's checkpoints directory or the run directory), project weights (`mimir import` output:
``model.yaml`` + ``model.safetensors``) and a transformers ``hrm_text`` directory
(``config.json`` + safetensors). Every command takes the same flags (:func:`add_model_arguments`):
``--model PATH`` for any form, recognised here, or ``--checkpoint`` / ``--weights`` / ``--hf``
to say which form it is; a path given as the wrong form is refused with the flag that fits.

Recognising a form reads directory entries only (no torch, no omegaconf): `--help` and a mistyped
path stay instant. The :class:`ModelDir` a command resolves is its one model value: it is asked,
without loading weights, for its tokenizer, trained schedule, display and served names, and for
a training checkpoint the run it belongs to and the data lineage it records
(:attr:`ModelDir.record`, read and verified once), and it loads the weights (:meth:`ModelDir.load`).
"""

from __future__ import annotations

import argparse
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from enum import StrEnum
from functools import cached_property
from pathlib import Path
from typing import Any

from mimir_megatron.errors import UserError

from .layout import FORMS_HELP, RUN_CHECKPOINTS, is_checkpoint_source, resolve
from .run_directory import RunDirectory
from .trainer_state import DatasetLineage, TrainerState, read_trainer_state

WEIGHTS_CONFIG = "model.yaml"
"""The model settings file of project weights (beside ``model.safetensors``)."""
HF_CONFIG = "config.json"

MODEL_FORMS_HELP = (f"a training checkpoint ({FORMS_HELP}), project weights (`mimir import` output) or a "
                    "transformers hrm_text directory")


class ModelKind(StrEnum):
    checkpoint = "checkpoint"
    weights = "weights"
    hf = "hf"


@dataclass(frozen=True)
class ModelDir:
    """A model directory, resolved once per command, and what it says about its model: each fact
    is read on first use and kept (a training checkpoint's ``latest`` followed once, its trainer
    state read and its digest checked once), so every part of a command asks this one value."""

    kind: ModelKind
    path: Path

    def check_ema(self, ema: bool) -> None:
        """Refuse ``--ema`` for a form that holds no EMA weights."""
        if ema and self.kind != ModelKind.checkpoint:
            raise UserError(f"--ema needs a training checkpoint; {self.path} is {_describe(self.kind)}, "
                            "which holds no EMA weights")

    @cached_property
    def checkpoint(self) -> Path | None:
        """A training checkpoint's ``step_N`` directory (a run or checkpoints directory resolved
        through ``latest``); None for the other forms."""
        return resolve(self.path) if self.kind == ModelKind.checkpoint else None

    @cached_property
    def record(self) -> TrainingRecord | None:
        """The checkpoint and its trainer state (its digest checked); None for project weights and
        transformers directories, which record no training run."""
        if self.checkpoint is None:
            return None
        return TrainingRecord(self.checkpoint, read_trainer_state(self.checkpoint))

    @property
    def run_directory(self) -> RunDirectory | None:
        """The run directory of a training checkpoint (its MLflow store, contamination reports,
        ...); None for the forms that record no training run."""
        return self.record.run_directory if self.record else None

    @property
    def lineage(self) -> tuple[DatasetLineage, ...] | None:
        """The data lineage a training checkpoint records (:attr:`TrainingRecord.lineage`); None
        where the form records none (project weights, a transformers directory)."""
        return self.record.lineage if self.record else None

    @cached_property
    def settings(self) -> Mapping[str, Any]:
        """The model's recorded settings: a checkpoint's trainer state, a weights directory's
        ``model.yaml`` (h_cycles, l_cycles, tokenizer, ...). Empty for a transformers directory."""
        if self.record is not None:
            return dict(self.record.state.model)
        if self.kind == ModelKind.weights:
            from mimir_megatron.yaml_config import read_yaml

            return dict(read_yaml(self.path / WEIGHTS_CONFIG, "model settings"))
        return {}

    @cached_property
    def trained_schedule(self) -> tuple[int, int] | None:
        """(H_cycles, L_cycles) the weights were trained with, from whatever form this is: the
        checkpoint's trainer state, ``model.yaml`` of project weights, a transformers
        ``config.json``. None when the directory does not say."""
        if self.kind == ModelKind.hf:
            import json

            config = json.loads((self.path / HF_CONFIG).read_text())
            pair = config.get("H_cycles"), config.get("L_cycles")
        else:
            pair = self.settings.get("h_cycles"), self.settings.get("l_cycles")
        return (int(pair[0]), int(pair[1])) if None not in pair else None

    @cached_property
    def tokenizer(self) -> Path | None:
        """The tokenizer that goes with the model: a transformers or weights directory's own
        ``tokenizer.json``, else the one the model's settings name. None: none known (a command's
        ``--tokenizer`` comes first: :meth:`tokenizer_or`)."""
        if self.kind != ModelKind.checkpoint and (self.path / "tokenizer.json").is_file():
            return self.path
        named = self.settings.get("tokenizer")
        return Path(named) if named else None

    def tokenizer_or(self, given: str | Path | None) -> Path | None:
        """``given`` (a command's ``--tokenizer``), else the model's own :attr:`tokenizer`."""
        return Path(given) if given else self.tokenizer

    def display_name(self, *, ema: bool = False) -> str:
        """The model's name in evaluation tables, output folders and MLflow: a training
        checkpoint's ``<run>-step_N`` (a run or checkpoints directory names the step its
        ``latest`` points at), else the directory's name; ``-ema`` for a checkpoint's EMA weights."""
        path = (self.checkpoint or self.path).resolve()
        name = f"{path.parent.parent.name}-{path.name}" if path.parent.name == RUN_CHECKPOINTS else path.name
        return name + ("-ema" if ema else "")

    @property
    def served_name(self) -> str:
        """The model id ``mimir serve`` answers to (and clients send): the directory's name as
        given (the parent's for a ``latest`` link)."""
        return self.path.name if self.path.name not in ("latest", "") else self.path.parent.name

    def load(self, *, ema: bool = False, tensor_parallel_size: int = 1, overrides: Sequence[str] = ()):
        """The model for this process's TP rank: a training checkpoint's trained or (``ema``) EMA
        weights (its files verified against the trainer state read here), project weights or a
        transformers directory (``overrides``: model config ``key=value`` applied to the last
        two, after the loading layout)."""
        self.check_ema(ema)
        if self.record is not None:
            from .load import load_model

            return load_model(self.record.checkpoint, ema=ema, tensor_parallel_size=tensor_parallel_size,
                              state=self.record.state)
        from mimir_megatron import interop

        from .load import execution_overrides

        settings = [*execution_overrides(tensor_parallel_size), *overrides]
        load = interop.load_weights if self.kind == ModelKind.weights else interop.import_hf
        return load(self.path, settings)


def detect_model_dir(path: str | Path, flag: str = "--model") -> ModelDir:
    """The form of the model directory at ``path``; one line naming the forms when it is none."""
    path = Path(path)
    if not path.is_dir():
        raise UserError(f"{flag} {path}: model directory not found")
    if is_checkpoint_source(path):
        return ModelDir(ModelKind.checkpoint, path)
    if (path / HF_CONFIG).is_file():
        return ModelDir(ModelKind.hf, path)
    if (path / WEIGHTS_CONFIG).is_file():
        return ModelDir(ModelKind.weights, path)
    raise UserError(f"{flag} {path}: not a model directory; expected {MODEL_FORMS_HELP}")


def resolve_model_dir(*, model: str | Path | None = None, checkpoint: str | Path | None = None,
                      weights: str | Path | None = None, hf: str | Path | None = None) -> ModelDir:
    """The model directory of exactly one of ``model`` (any form, recognised) or the form named
    by ``checkpoint``, ``weights`` or ``hf``. A named form is loaded as that form (its loader
    reports a damaged or incomplete directory), unless the directory is plainly another form:
    then the refusal names the flag that fits."""
    named = (("model", model), ("checkpoint", checkpoint), ("weights", weights), ("hf", hf))
    given = {name: value for name, value in named if value is not None}
    if len(given) != 1:
        raise UserError("give exactly one model: --model (any form), --checkpoint, --weights or --hf")
    (name, value), = given.items()
    if name == "model":
        return detect_model_dir(value)
    path, kind = Path(value), ModelKind(name)
    if not path.is_dir():
        raise UserError(f"--{name} {path}: model directory not found")
    try:
        found = detect_model_dir(path, f"--{name}").kind
    except UserError:
        found = kind  # nothing recognisable: the named form's loader says what is missing
    if found != kind:
        raise UserError(f"--{name} {path}: this is {_describe(found)}; pass it as --{found} (or --model)")
    return ModelDir(kind, path)


def _describe(kind: ModelKind) -> str:
    return {ModelKind.checkpoint: "a training checkpoint", ModelKind.weights: "project weights",
            ModelKind.hf: "a transformers directory"}[kind]


# -- what a model directory says about its model (no weights are loaded) ----------------------------


@dataclass(frozen=True)
class TrainingRecord:
    """What a training checkpoint records of the run that wrote it."""

    checkpoint: Path
    """The ``step_N`` directory (a run or checkpoints directory resolved through ``latest``)."""
    state: TrainerState

    @property
    def run_directory(self) -> RunDirectory:
        """The run the checkpoint belongs to (:meth:`RunDirectory.of_checkpoint`)."""
        return RunDirectory.of_checkpoint(self.checkpoint, self.state)

    @property
    def lineage(self) -> tuple[DatasetLineage, ...]:
        """Per dataset of the run's mixture: its provenance, the digest its manifest had, and
        what of it went into the weights up to this step."""
        return self.state.lineage


def add_model_arguments(parser: argparse.ArgumentParser, *, required: bool = True,
                        ema: bool = True) -> argparse._MutuallyExclusiveGroup:
    """``--model`` / ``--checkpoint`` / ``--weights`` / ``--hf`` (one of them) and ``--ema``;
    the group is returned so a command can add another source (eval's ``--base-url``)."""
    source = parser.add_mutually_exclusive_group(required=required)
    source.add_argument("--model", help=f"model directory of any form: {MODEL_FORMS_HELP}")
    source.add_argument("--checkpoint", help=f"training checkpoint: {FORMS_HELP}")
    source.add_argument("--weights", help="project weights directory (`mimir import` output)")
    source.add_argument("--hf", help="transformers hrm_text directory")
    if ema:
        parser.add_argument("--ema", action="store_true", help="with a training checkpoint: its EMA weights")
    return source


def model_dir_from_args(args: argparse.Namespace) -> ModelDir:
    """The model directory the flags of :func:`add_model_arguments` name."""
    return resolve_model_dir(model=args.model, checkpoint=args.checkpoint, weights=args.weights, hf=args.hf)
