"""MLflow for evaluations: one run per evaluation (metrics per task, tables and InspectAI logs as
artifacts), nested under the training run when a training checkpoint is evaluated.

A training checkpoint's trainer state names its MLflow run and config; the evaluation
then goes to the same store and experiment as a child run. Otherwise the store is
``--tracking-uri``, else ``$MLFLOW_TRACKING_URI``, else a sqlite file in the output directory.
Tables are written to disk before MLflow is touched, so an unreachable server loses nothing.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from mimir_megatron.checkpoint.model_dir import TrainingRecord
from mimir_megatron.checkpoint.run_directory import RunDirectory

log = logging.getLogger(__name__)

DEFAULT_EXPERIMENT = "mimir-eval"


@dataclass
class TrackingTarget:
    uri: str
    experiment: str
    artifact_root: str
    parent_run_id: str | None = None
    checkpoint_step: int | None = None


def tracking_target(output: Path, uri: str | None = None, record: TrainingRecord | None = None,
                    experiment: str | None = None) -> TrackingTarget:
    """Where an evaluation's MLflow run goes (see the module docstring). ``record``: the
    evaluated model's training record (:attr:`ModelDir.record
    <mimir_megatron.checkpoint.model_dir.ModelDir.record>`; None: the model records no run)."""
    if record is not None and not uri:
        run_dir, recorded = record.run_directory, record.state.recorded_run()
        return TrackingTarget(
            uri=recorded.tracking_uri or run_dir.mlflow_uri,
            experiment=experiment or recorded.experiment or DEFAULT_EXPERIMENT,
            artifact_root=run_dir.artifact_root,
            parent_run_id=record.state.mlflow_run_id, checkpoint_step=record.state.step)
    store = RunDirectory(output)
    uri = uri or os.environ.get("MLFLOW_TRACKING_URI") or store.mlflow_uri
    return TrackingTarget(uri, experiment or DEFAULT_EXPERIMENT, store.artifact_root,
                          checkpoint_step=record.state.step if record else None)


class EvalRun:
    """One MLflow run; every call warns instead of raising when the store fails."""

    def __init__(self, target: TrackingTarget, run_name: str, params: dict[str, Any],
                 parent_run_id: str | None = None, tags: dict[str, str] | None = None):
        self.run_id: str | None = None
        self.target = target
        try:
            from mimir_megatron.mlflow_store import create_run, experiment_id, mlflow_client

            self.client = mlflow_client(target.uri, request_timeout_s=10, artifact_root=target.artifact_root)
            exp_id = experiment_id(self.client, target.experiment, target.artifact_root)
            all_tags = dict(tags or {})
            parent = parent_run_id or target.parent_run_id
            if parent:
                all_tags["mlflow.parentRunId"] = parent
            self.run_id = create_run(self.client, exp_id, run_name, all_tags).info.run_id
            for key, value in params.items():
                self.client.log_param(self.run_id, key, str(value)[:6000])
        except Exception as exc:  # noqa: BLE001 (tracking never costs the results)
            log.warning("MLflow at %s unavailable, results are on disk only: %s", target.uri, exc)

    def log_metrics(self, metrics: dict[str, float], step: int = 0) -> None:
        self._call(lambda: [self.client.log_metric(self.run_id, k, float(v), step=step)
                            for k, v in metrics.items()])

    def log_artifacts(self, directory: Path, artifact_path: str | None = None) -> None:
        self._call(lambda: self.client.log_artifacts(self.run_id, str(directory), artifact_path))

    def log_artifact(self, path: Path, artifact_path: str | None = None) -> None:
        self._call(lambda: self.client.log_artifact(self.run_id, str(path), artifact_path))

    def set_tag(self, key: str, value: str) -> None:
        self._call(lambda: self.client.set_tag(self.run_id, key, value))

    def end(self, status: str = "FINISHED") -> None:
        self._call(lambda: self.client.set_terminated(self.run_id, status))

    def _call(self, fn) -> None:  # noqa: ANN001
        if self.run_id is None:
            return
        try:
            fn()
        except Exception as exc:  # noqa: BLE001
            log.warning("MLflow call failed (results are on disk): %s", exc)
