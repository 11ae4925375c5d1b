"""MLflow clients: the one place that opens a tracking store (training, evaluation, audits), and
that finds or creates their experiments.

A new sqlite store (the default: ``mlflow.db`` in a run directory) is created by MLflow through
its whole chain of schema migrations, ~2 s of CPU for every new run, sweep or audit. Here a new
sqlite file starts instead as a copy of an empty store that was migrated once for the installed
MLflow version (kept in the user's cache directory); MLflow then opens it as an up-to-date
database. The copy holds no experiment: MLflow creates its Default experiment on first open,
with this store's own artifact location, as it does for a new file. Any problem with the cache
(unwritable, half-written) falls back to MLflow creating the file itself.
"""

from __future__ import annotations

import logging
import os
import shutil
import sqlite3
import tempfile
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

_SQLITE = "sqlite:///"

# MLflow 3's UI sorts experiments into kinds by this experiment tag (it sets it itself when a user
# picks a kind, or after inferring one: runs without traces make "custom_model_development").
# Training, evaluation and audit runs are metrics, tables and files of a model, not traces of a
# GenAI application: their experiments are of the model-training kind.
EXPERIMENT_KIND_TAG = "mlflow.experimentKind"
MODEL_TRAINING = "custom_model_development"


def mlflow_client(uri: str, request_timeout_s: int | None = None) -> Any:
    """An ``MlflowClient`` on ``uri``; a new sqlite store starts from the migrated template.

    ``request_timeout_s`` (training, evaluation): MLflow's defaults for a run that must not stall
    on an unreachable server, unless the environment sets them: that HTTP timeout, no request
    retries (the callers retry on their own schedule), and MLflow's logging at WARNING (no
    migration chatter). Set before MLflow is imported, which reads them then.
    """
    if request_timeout_s is not None:
        os.environ.setdefault("MLFLOW_LOGGING_LEVEL", "WARNING")
        os.environ.setdefault("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
        os.environ.setdefault("MLFLOW_HTTP_REQUEST_TIMEOUT", str(request_timeout_s))
    from mlflow.tracking import MlflowClient

    seed_sqlite_store(uri)
    return MlflowClient(tracking_uri=uri)


def experiment_id(client: Any, name: str, artifact_location: str, kind: str = MODEL_TRAINING) -> str:
    """The id of experiment ``name``, created with ``artifact_location`` when it does not exist,
    and marked as ``kind`` unless it has a kind already (one a user chose in the UI stands)."""
    experiment = client.get_experiment_by_name(name)
    if experiment is None:
        return client.create_experiment(name, artifact_location=artifact_location,
                                        tags={EXPERIMENT_KIND_TAG: kind})
    mark_experiment_kind(client, experiment, kind)
    return experiment.experiment_id


def mark_experiment_kind(client: Any, experiment: Any, kind: str = MODEL_TRAINING) -> None:
    """Tag an existing experiment (an ``Experiment``) as ``kind`` unless it has a kind already."""
    if EXPERIMENT_KIND_TAG not in experiment.tags:
        client.set_experiment_tag(experiment.experiment_id, EXPERIMENT_KIND_TAG, kind)


def seed_sqlite_store(uri: str) -> bool:
    """Create the sqlite file of ``uri`` from the template when it does not exist yet; whether
    it did (False for other stores, existing files, or when the cache cannot be used)."""
    path = sqlite_path(uri)
    if path is None or path.exists():
        return False
    try:
        template = _template()
        path.parent.mkdir(parents=True, exist_ok=True)
        partial = path.with_name(f".{path.name}.{os.getpid()}.partial")
        shutil.copyfile(template, partial)
        try:
            os.link(partial, path)  # fails if another process created the store meanwhile
        finally:
            partial.unlink()
    except (OSError, sqlite3.Error) as exc:
        log.debug("MLflow store %s: no template (%s); MLflow creates it", path, exc)
        return False
    return True


def sqlite_path(uri: str) -> Path | None:
    """The file of a ``sqlite:///`` URI (None for other stores and URIs with options)."""
    if not uri.startswith(_SQLITE) or "?" in uri or uri == _SQLITE + ":memory:":
        return None
    return Path(uri[len(_SQLITE):])


def template_path() -> Path:
    from mlflow.version import VERSION

    cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "mimir-megatron"
    return cache / f"mlflow-{VERSION}-empty-store.db"


def _template() -> Path:
    """The migrated empty store for the installed MLflow, built on first use."""
    template = template_path()
    if template.exists():
        return template
    template.parent.mkdir(parents=True, exist_ok=True)
    from mlflow.store.tracking.sqlalchemy_store import SqlAlchemyStore

    with tempfile.TemporaryDirectory(dir=template.parent) as tmp:
        db = Path(tmp) / "store.db"
        store = SqlAlchemyStore(f"{_SQLITE}{db}", Path(tmp).as_uri())  # runs the migrations
        store.engine.dispose()
        getattr(SqlAlchemyStore, "_engine_map", {}).pop(f"{_SQLITE}{db}", None)
        with sqlite3.connect(db) as conn:  # the Default experiment points into tmp: drop it
            conn.execute("DELETE FROM experiments WHERE experiment_id = 0")
        conn.close()
        os.replace(db, template)  # atomic: a concurrent builder's copy is equally good
    return template
