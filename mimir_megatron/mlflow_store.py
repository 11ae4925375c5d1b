"""MLflow clients: the one place that opens a tracking store (training, evaluation, audits), that
finds or creates their experiments, and that creates their runs (recording who made them).

A new sqlite store (the default: ``mlflow.db`` in a run directory) is created by MLflow through
its whole chain of schema migrations, ~2 s of CPU for every new run, sweep or audit. Here a new
sqlite file starts instead as a copy of an empty store that was migrated once for the installed
MLflow version (kept in the user's cache directory); MLflow then opens it as an up-to-date
database. The copy holds no experiment: MLflow creates its Default experiment on first open,
with this store's own artifact location, as it does for a new file. Any problem with the cache
(unwritable, half-written) falls back to MLflow creating the file itself.

A sqlite store moves with its run directory between MLflow versions (the host and the image, two
clusters). MLflow upgrades an older store's schema when it opens it; a store a newer MLflow wrote
it cannot read, and says so in a traceback that suggests a migration. :func:`check_store_schema`
says instead, in one line, which MLflow the store needs.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import re
import shutil
import sqlite3
import tempfile
from pathlib import Path
from typing import Any

from mimir_megatron.errors import UserError

log = logging.getLogger(__name__)

_SQLITE = "sqlite:///"

# MLflow 3's UI sorts experiments into kinds by this experiment tag (it sets it itself when a user
# picks a kind, or after inferring one: runs without traces make "custom_model_development").
# Training, evaluation and audit runs are metrics, tables and files of a model, not traces of a
# GenAI application: their experiments are of the model-training kind.
EXPERIMENT_KIND_TAG = "mlflow.experimentKind"
MODEL_TRAINING = "custom_model_development"
USER_TAG = "mlflow.user"
"""Who made a run: MLflow's fluent API sets it, ``MlflowClient.create_run`` does not (its
``user_id`` then reads ``unknown``)."""


def unix_user() -> str:
    """The name of the user running this process (``uid N`` where the uid has no name, as in a
    container started with ``--user``)."""
    import getpass

    try:
        return getpass.getuser()
    except (KeyError, OSError):
        return f"uid {os.getuid()}"


def create_run(client: Any, experiment: str, run_name: str | None, tags: dict[str, str] | None = None) -> Any:
    """A new run of ``experiment`` that records its maker (:data:`USER_TAG`, also its ``user_id``)."""
    return client.create_run(experiment, run_name=run_name, tags={USER_TAG: unix_user(), **(tags or {})})


def mlflow_client(uri: str, request_timeout_s: int | None = None, artifact_root: str | None = None) -> Any:
    """An ``MlflowClient`` on ``uri``; a new sqlite store starts from the migrated template.

    ``artifact_root``: the run directory's artifact folder when ``uri`` is its own store: a store
    copied or moved from another run directory is first pointed at it (:func:`rebase_moved_store`).

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

    check_store_schema(uri)
    seed_sqlite_store(uri)
    if artifact_root is not None and rebase_moved_store(uri, artifact_root):
        # MLflow keeps each run's artifact folder per run id for the process: a copy of a run
        # opened in the process that ran the original (a notebook, the tests) must not reuse it.
        from mlflow.tracking._tracking_service import utils

        getattr(utils, "_artifact_repos_cache", {}).clear()
    return MlflowClient(tracking_uri=uri)


# Where MLflow records an artifact location (absolute URIs): a table and its column. logged_models
# is MLflow 3's; a store without it is skipped.
_ARTIFACT_COLUMNS = (("experiments", "artifact_location"), ("runs", "artifact_uri"),
                     ("logged_models", "artifact_location"))


def rebase_moved_store(uri: str, artifact_root: str) -> int:
    """Point a run directory's own store, copied or moved from another run directory, at its own
    artifact folder; how many recorded locations changed.

    MLflow records artifact locations absolute, so ``<copy>/mlflow.db`` still names
    ``<original>/mlartifacts``: a copy resumed, evaluated or exported would write its artifacts
    into the original's folder. Applies only where ``uri`` is ``sqlite:///<dir>/mlflow.db``,
    ``artifact_root`` is ``<dir>/mlartifacts`` (the run directory's layout) and every experiment
    made with such a folder names the same other one (the store as a whole came from elsewhere); a
    store shared by several run directories (``tracking.uri``) is left alone."""
    from mimir_megatron.checkpoint.run_directory import RunDirectory

    path = sqlite_path(uri)
    store = RunDirectory(path.parent) if path is not None else None
    if store is None or path != store.mlflow_db or not path.is_file():
        return 0
    if store.artifact_root != artifact_root:
        return 0
    suffix = "/" + store.artifacts.name
    with contextlib.closing(sqlite3.connect(path, timeout=30)) as conn, conn:
        try:
            recorded = {row[0] for row in conn.execute("SELECT artifact_location FROM experiments")}
        except sqlite3.Error:
            return 0  # not an MLflow store yet: MLflow makes it
        moved = {loc for loc in recorded if loc and loc.endswith(suffix)}
        if len(moved) != 1 or artifact_root in moved:
            return 0
        (old,) = moved
        changed = 0
        for table, column in _ARTIFACT_COLUMNS:
            try:  # the old folder itself or a path below it, never a sibling that shares its prefix
                sql = (f"UPDATE {table} SET {column} = ? || substr({column}, ?) "
                       f"WHERE substr({column}, 1, ?) = ? "
                       f"AND (length({column}) = ? OR substr({column}, ?, 1) = '/')")
                changed += conn.execute(
                    sql, (artifact_root, len(old) + 1, len(old), old, len(old), len(old) + 1)).rowcount
            except sqlite3.OperationalError:  # no such table in this MLflow's schema
                continue
    log.warning("MLflow store %s was made in another run directory: %d artifact location(s) moved from "
                "%s to %s (MLflow records them absolute)", path, changed, old, artifact_root)
    return changed


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


def check_store_schema(uri: str) -> None:
    """Raise a :class:`UserError` when ``uri``'s sqlite file was written by a newer MLflow than
    the installed one: its schema revision is not among this MLflow's migrations. Other stores,
    missing files and files that are not MLflow stores yet pass (MLflow makes or refuses them)."""
    path = sqlite_path(uri)
    if path is None or not path.is_file():
        return
    try:
        read_only = f"{path.resolve().as_uri()}?mode=ro"
        with contextlib.closing(sqlite3.connect(read_only, uri=True, timeout=30)) as conn:
            row = conn.execute("SELECT version_num FROM alembic_version").fetchone()
    except sqlite3.Error:
        return
    known = schema_revisions()
    if row is None or not known or row[0] in known:
        return
    from mlflow.version import VERSION

    raise UserError(
        f"MLflow store {path} was written by a newer MLflow than the installed {VERSION} (schema "
        f"revision {row[0]} is not one of its migrations): open it with that MLflow or a later one "
        "(launchers/setup_env.sh installs the image's, docker/requirements.txt)")


@functools.cache
def schema_revisions() -> frozenset[str]:
    """The schema revisions the installed MLflow knows: those of its migration scripts (empty
    where they cannot be found, which turns the check off)."""
    from importlib.util import find_spec

    spec = find_spec("mlflow.store.db_migrations")
    if spec is None or not spec.submodule_search_locations:
        return frozenset()
    versions = Path(next(iter(spec.submodule_search_locations))) / "versions"
    found = (_REVISION.search(script.read_text(encoding="utf-8")) for script in versions.glob("*.py"))
    return frozenset(match.group(1) for match in found if match)


_REVISION = re.compile(r"""^revision\s*=\s*["']([0-9a-f]+)["']""", re.MULTILINE)


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
