"""The run directory of a training run: where its paths are derived, once.

``run.dir``, else ``runs/<run.name>``, holds::

    checkpoints/       step_N checkpoints and ``latest`` (unless ``checkpoint.dir`` says elsewhere)
    config.yaml        the resolved configuration
    train.lock         one trainer at a time (:mod:`mimir_megatron.train.run_lock`)
    mlflow.db          the local MLflow store (unless ``tracking.uri`` names another)
    mlartifacts/       its artifacts
    contamination/     ``mimir audit contamination`` reports eval, sweep and export look in
    eval_logs/step_N/  in-training evaluations' InspectAI logs

The trainer derives it from its configuration (:meth:`RunDirectory.configured`); evaluation,
export and audits from a checkpoint (:meth:`RunDirectory.of_checkpoint`): its ``checkpoints/``
folder's parent, else the directory its trainer state's configuration names. An output directory
that keeps a local MLflow store of its own (an evaluation's, an audit's, a synthetic pipeline's,
the store `mimir ui` serves) lays it out the same way: ``RunDirectory(output).mlflow_uri``.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from .layout import RUN_CHECKPOINTS

if TYPE_CHECKING:
    from .trainer_state import TrainerState

RUNS_ROOT = Path("runs")
"""Where run directories go when ``run.dir`` is not set (relative to the working directory)."""


@dataclass(frozen=True)
class RunDirectory:
    root: Path

    @classmethod
    def configured(cls, run_dir: str | Path | None, run_name: str) -> RunDirectory:
        """``run.dir``, else ``runs/<run.name>``."""
        return cls(Path(run_dir) if run_dir else RUNS_ROOT / run_name)

    @classmethod
    def of_checkpoint(cls, checkpoint: Path, state: TrainerState) -> RunDirectory:
        """The run directory of the checkpoint ``checkpoint`` (a ``step_N`` directory)."""
        if checkpoint.parent.name == RUN_CHECKPOINTS:
            return cls(checkpoint.parent.parent)
        run = state.recorded_run()
        return cls.configured(run.dir, run.name)

    @property
    def checkpoints(self) -> Path:
        return self.root / RUN_CHECKPOINTS

    @property
    def config_file(self) -> Path:
        return self.root / "config.yaml"

    @property
    def lock_file(self) -> Path:
        """One trainer at a time (:mod:`mimir_megatron.train.run_lock`)."""
        return self.root / "train.lock"

    @property
    def mlflow_db(self) -> Path:
        """The local MLflow store's sqlite file."""
        return self.root / "mlflow.db"

    @property
    def mlflow_uri(self) -> str:
        """The default MLflow store: a sqlite file in the run directory (absolute)."""
        return f"sqlite:///{self.mlflow_db.resolve()}"

    @property
    def artifacts(self) -> Path:
        """The local store's artifacts (absolute)."""
        return (self.root / "mlartifacts").resolve()

    @property
    def artifact_root(self) -> str:
        """:attr:`artifacts` as the URI MLflow records."""
        return self.artifacts.as_uri()

    @property
    def contamination(self) -> Path:
        """Where ``mimir audit contamination`` reports of this run's data are looked for."""
        return self.root / "contamination"

    def eval_logs(self, step: int) -> Path:
        return self.root / "eval_logs" / f"step_{step:07d}"
