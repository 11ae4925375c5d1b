"""An exported model in MLflow: a LoggedModel of the training run it came from.

`mimir export` from a training checkpoint writes a transformers directory with its model card
(README.md) and training-data summary. Here that directory becomes a LoggedModel in the training
run's store and experiment: its files are the model's artifacts (MLflow's "Models" page lists it
with its card), its source run is the training run, which outputs it at the checkpoint's step;
the run's metrics at that step are linked to it (the same points, now also the model's); its
params and tags name the checkpoint, the step and the lineage. The card and the summary are also
artifacts of the training run (``export/<name>/``). With ``register``, a version of that
registered model is created from it, the card as the description of both.

Like all tracking here, a store that cannot be reached or refuses costs a warning, never the
export on disk.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from mimir_megatron.checkpoint.model_dir import TrainingRecord

log = logging.getLogger(__name__)

CARD = "README.md"
RELEASE_FILES = (CARD, "training_data_summary.md", "training_data_summary.json")


def log_exported_model(output: Path, record: TrainingRecord, name: str, register: str | None = None,
                       reports: list[Path] = ()) -> str | None:
    """Log ``output`` (an export of the checkpoint of ``record``, whose trainer state names its
    MLflow run) as described above, and the contamination ``reports`` its summary used into the run
    (``contamination/``); the LoggedModel's id, or None with a warning."""
    from mimir_megatron.evaluation.tracking import tracking_target
    from mimir_megatron.mlflow_store import experiment_id, mlflow_client

    checkpoint, state = record.checkpoint, record.state
    if not state.mlflow_run_id:
        log.warning("%s names no MLflow run: the export is not logged to MLflow", checkpoint)
        return None
    target = tracking_target(output, record=record)
    try:
        client = mlflow_client(target.uri, request_timeout_s=10, artifact_root=target.artifact_root)
        run = client.get_run(state.mlflow_run_id)
        exp_id = run.info.experiment_id or experiment_id(client, target.experiment, target.artifact_root)
        for report in reports:
            client.log_artifact(run.info.run_id, str(report), "contamination")
        return _log(client, exp_id, run, output, checkpoint, state, name, register)
    except Exception as exc:  # noqa: BLE001 - the export on disk is what counts
        log.warning("MLflow at %s: the export is not logged (%s: %s); it is complete in %s",
                    target.uri, type(exc).__name__, exc, output)
        return None


def _log(client: Any, exp_id: str, run: Any, output: Path, checkpoint: Path, state: Any, name: str,
         register: str | None) -> str:
    from mlflow.entities import LoggedModelOutput

    run_id = run.info.run_id
    card = (output / CARD).read_text(encoding="utf-8") if (output / CARD).is_file() else ""
    model = client.create_logged_model(
        exp_id, name=name, source_run_id=run_id, model_type="hrm-text-transformers",
        params={"checkpoint_step": str(state.step), "consumed_samples": str(state.consumed_samples),
                "data_fingerprint": str(state.data_fingerprint)},
        tags={"mimir.checkpoint": str(checkpoint.resolve()), "mimir.export_dir": str(output.resolve()),
              "mimir.lineage": f"runs:/{run_id}/data/lineage.json",
              "mimir.training_data_summary": "training_data_summary.md", "mlflow.note.content": card})
    client.log_model_artifacts(model.model_id, str(output))
    for file in RELEASE_FILES:
        if (output / file).is_file():
            client.log_artifact(run_id, str(output / file), f"export/{name}")
    linked = _link_metrics(client, run, model.model_id, state.step)
    client.log_outputs(run_id, [LoggedModelOutput(model.model_id, step=state.step)])
    client.finalize_logged_model(model.model_id, "READY")
    log.info("MLflow: exported model %s (%s) logged from run %s at step %d, %d metrics linked",
             name, model.model_id, run_id, state.step, linked)
    if register:
        if not client.search_registered_models(filter_string=f"name = '{register}'"):
            client.create_registered_model(register, description=card)
        version = _register(client, register, model.model_id, run_id, card)
        log.info("MLflow: registered %s version %s", register, version.version)
    return model.model_id


def _register(client: Any, name: str, model_id: str, run_id: str, card: str) -> Any:
    """A version of registered model ``name`` from LoggedModel ``model_id`` (``models:/<id>``, which
    links the version to the model). MLflow 3.17's sqlite registry resolves that URI on the
    process's global tracking URI, not on the client's: it is this store's while registering."""
    from mlflow.tracking._tracking_service import utils

    before = utils._tracking_uri
    utils._tracking_uri = client._tracking_client.tracking_uri
    try:
        return client.create_model_version(name, f"models:/{model_id}", run_id=run_id, description=card,
                                           model_id=model_id)
    finally:
        utils._tracking_uri = before


def _link_metrics(client: Any, run: Any, model_id: str, step: int) -> int:
    """Link the run's value of each metric at ``step`` (its last one up to it) to the model,
    logging the very same point (timestamp, step, value), so the run's history gains nothing."""
    from mlflow.entities import Metric

    linked = []
    for key in run.data.metrics:
        if key.startswith("system/"):
            continue
        points = [m for m in client.get_metric_history(run.info.run_id, key) if m.step <= step]
        if points:
            last = max(points, key=lambda m: (m.step, m.timestamp))
            linked.append(Metric(key, last.value, last.timestamp, last.step, model_id=model_id))
    for i in range(0, len(linked), 900):
        client.log_batch(run.info.run_id, metrics=linked[i:i + 900])
    return len(linked)
