"""``mlflow_store``: a new sqlite store starts from a migrated template and behaves as one that
MLflow created itself (Default experiment with this store's artifact location, runs, metrics)."""

from __future__ import annotations

import os
import shutil

import pytest

from mimir_megatron import mlflow_store


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    return tmp_path / "cache"


def default_experiment_and_a_run(client):
    exp_id = client.create_experiment("e")
    run = client.create_run(exp_id, run_name="r")
    client.log_metric(run.info.run_id, "loss", 1.5, step=3)
    history = client.get_metric_history(run.info.run_id, "loss")
    assert [(m.step, m.value) for m in history] == [(3, 1.5)]
    return client.get_experiment("0")


def test_a_new_store_from_the_template_runs_no_migration_and_matches_mlflows_own(tmp_path, cache, monkeypatch):
    from mlflow.store.db import utils
    from mlflow.tracking import MlflowClient

    plain = default_experiment_and_a_run(MlflowClient(tracking_uri=f"sqlite:///{tmp_path / 'plain' / 'mlflow.db'}"))
    first = default_experiment_and_a_run(mlflow_store.mlflow_client(f"sqlite:///{tmp_path / 'a' / 'mlflow.db'}"))
    assert mlflow_store.template_path().is_file() and cache in mlflow_store.template_path().parents

    def no_migrations(engine):
        raise AssertionError("a store seeded from the template ran MLflow's migrations")

    monkeypatch.setattr(utils, "_initialize_tables", no_migrations)
    second = default_experiment_and_a_run(mlflow_store.mlflow_client(f"sqlite:///{tmp_path / 'b' / 'mlflow.db'}"))
    for exp, name in ((first, "a"), (second, "b")):  # created by this store, not the template's
        assert exp.name == plain.name == "Default"
        assert exp.artifact_location == plain.artifact_location.replace("/plain/", f"/{name}/") or \
            exp.artifact_location == plain.artifact_location
        assert str(cache) not in exp.artifact_location


def test_experiments_are_of_the_model_training_kind_unless_a_kind_was_chosen(tmp_path):
    """The tag MLflow 3's UI reads for an experiment's kind (and sets itself: "Machine learning"
    is custom_model_development); a kind already set, e.g. chosen in the UI, stays."""
    client = mlflow_store.mlflow_client(f"sqlite:///{tmp_path / 'mlflow.db'}")
    kind = lambda exp_id: client.get_experiment(exp_id).tags.get("mlflow.experimentKind")  # noqa: E731
    new = mlflow_store.experiment_id(client, "training", (tmp_path / "art").as_uri())
    assert kind(new) == "custom_model_development"
    assert client.get_experiment(new).artifact_location == (tmp_path / "art").as_uri()
    older = client.create_experiment("from-before")  # made before experiments were marked
    assert kind(older) is None
    assert mlflow_store.experiment_id(client, "from-before", "unused") == older
    assert kind(older) == "custom_model_development"
    chosen = client.create_experiment("chosen", tags={"mlflow.experimentKind": "genai_development"})
    assert mlflow_store.experiment_id(client, "chosen", "unused") == chosen
    assert kind(chosen) == "genai_development"


def test_only_new_sqlite_files_are_seeded(tmp_path, cache):
    existing = tmp_path / "old.db"
    existing.write_bytes(b"")
    assert not mlflow_store.seed_sqlite_store(f"sqlite:///{existing}")
    assert existing.read_bytes() == b""
    assert not mlflow_store.seed_sqlite_store("http://127.0.0.1:5000")
    assert not mlflow_store.seed_sqlite_store(f"sqlite:///{tmp_path / 'x.db'}?timeout=5")
    assert mlflow_store.sqlite_path(f"sqlite:///{tmp_path / 'x.db'}") == tmp_path / "x.db"
    assert mlflow_store.seed_sqlite_store(f"sqlite:///{tmp_path / 'new' / 'x.db'}")
    assert not list((tmp_path / "new").glob(".*partial"))


def test_request_defaults_are_set_only_when_asked_and_never_over_the_environment(monkeypatch):
    names = ("MLFLOW_LOGGING_LEVEL", "MLFLOW_HTTP_REQUEST_MAX_RETRIES", "MLFLOW_HTTP_REQUEST_TIMEOUT")
    for name in names:  # set, then deleted: monkeypatch restores what was there before
        monkeypatch.setenv(name, "")
        monkeypatch.delenv(name)
    server = "http://127.0.0.1:9"  # never contacted: opening a client sends no request
    mlflow_store.mlflow_client(server)  # audits: MLflow's own defaults
    assert not any(name in os.environ for name in names)
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_TIMEOUT", "60")
    mlflow_store.mlflow_client(server, request_timeout_s=5)
    assert [os.environ[name] for name in names] == ["WARNING", "0", "60"]


def _run_with_an_artifact_and_a_model(root):
    """A run directory's store as training makes it: an experiment whose artifacts go to
    ``root/mlartifacts``, a run with a file, a logged model; the run's id."""
    client = mlflow_store.mlflow_client(f"sqlite:///{root / 'mlflow.db'}", artifact_root=(root / "mlartifacts").as_uri())
    exp_id = mlflow_store.experiment_id(client, "mimir-demo", (root / "mlartifacts").as_uri())
    run_id = client.create_run(exp_id, run_name="demo").info.run_id
    client.log_text(run_id, "original", "data/lineage.json")
    client.create_logged_model(exp_id, name="demo", source_run_id=run_id)
    return run_id


def _locations(root, run_id):
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=f"sqlite:///{root / 'mlflow.db'}")
    run = client.get_run(run_id)
    models = client.search_logged_models(experiment_ids=[run.info.experiment_id])
    return [client.get_experiment(run.info.experiment_id).artifact_location, run.info.artifact_uri,
            *(m.artifact_location for m in models)]


def test_a_copied_run_directory_writes_its_artifacts_into_its_own_folder(tmp_path, cache):
    """MLflow records artifact locations absolute: a copy of a run directory, opened as a run
    directory's store, is pointed at its own mlartifacts (the original's store untouched), once."""

    original, copy = tmp_path / "runs" / "demo", tmp_path / "elsewhere" / "demo_copy"
    run_id = _run_with_an_artifact_and_a_model(original)
    shutil.copytree(original, copy)
    before = _locations(original, run_id)
    assert len(before) == 3 and all(loc.startswith((original / "mlartifacts").as_uri()) for loc in before)

    # In this process MLflow remembers the original run's artifact folder by run id: the copy
    # must not write there all the same.
    client = mlflow_store.mlflow_client(f"sqlite:///{copy / 'mlflow.db'}", artifact_root=(copy / "mlartifacts").as_uri())
    after = _locations(copy, run_id)
    assert after == [loc.replace(original.as_uri(), copy.as_uri()) for loc in before]
    client.log_text(run_id, "resumed copy", "data/lineage.json")
    written = list((copy / "mlartifacts").rglob("lineage.json"))
    assert [p.read_text() for p in written] == ["resumed copy"]
    assert [p.read_text() for p in (original / "mlartifacts").rglob("lineage.json")] == ["original"]
    assert _locations(original, run_id) == before
    assert mlflow_store.rebase_moved_store(f"sqlite:///{copy / 'mlflow.db'}", (copy / "mlartifacts").as_uri()) == 0


def test_a_store_shared_by_run_directories_is_left_alone(tmp_path, cache):
    """tracking.uri naming one store for several run directories: each run's artifacts stay where
    its own run directory put them, whichever directory opens the store."""
    shared, other = tmp_path / "shared", tmp_path / "runs" / "b"
    run_id = _run_with_an_artifact_and_a_model(shared)
    before = _locations(shared, run_id)
    uri = f"sqlite:///{shared / 'mlflow.db'}"
    assert mlflow_store.rebase_moved_store(uri, (other / "mlartifacts").as_uri()) == 0  # not this store's folder
    # a store not named as a run directory's own (mlflow.db) is never rewritten
    renamed = tmp_path / "copy" / "tracking.db"
    renamed.parent.mkdir()
    shutil.copyfile(shared / "mlflow.db", renamed)
    assert mlflow_store.rebase_moved_store(f"sqlite:///{renamed}", (renamed.parent / "mlartifacts").as_uri()) == 0
    assert _locations(shared, run_id) == before


def from_a_newer_mlflow(path) -> str:
    """A store as the next MLflow leaves it: its schema at a revision this MLflow has no migration
    for (the one after the installed head, as a release that adds a migration writes it)."""
    import sqlite3

    assert mlflow_store.seed_sqlite_store(f"sqlite:///{path}")  # not opened here: MLflow caches what it opened
    with sqlite3.connect(path) as conn:
        conn.execute("UPDATE alembic_version SET version_num = 'f00dfeedbeef'")
    conn.close()
    return f"sqlite:///{path}"


def test_a_store_from_a_newer_mlflow_is_refused_in_one_line(tmp_path, cache):
    """MLflow itself refuses such a store with a traceback that suggests `mlflow db upgrade` (which
    cannot help: this MLflow has no way to the newer schema); every opener here says instead, in
    one line, which MLflow the store needs: the trainer's tracker, evaluation's and `mimir ui`."""
    from mlflow.exceptions import MlflowException
    from mlflow.tracking import MlflowClient
    from mlflow.version import VERSION

    from mimir_megatron.checkpoint.run_directory import RunDirectory
    from mimir_megatron.errors import UserError
    from mimir_megatron.ops.ui import ui_command
    from mimir_megatron.train.tracking import Tracker

    run_dir = tmp_path / "run"
    uri = from_a_newer_mlflow(RunDirectory(run_dir).mlflow_db)
    with pytest.raises(MlflowException, match="out-of-date database schema"):
        MlflowClient(tracking_uri=uri).search_experiments()
    with pytest.raises(UserError) as refused:
        mlflow_store.mlflow_client(uri)
    message = str(refused.value)
    assert "\n" not in message
    assert f"{run_dir / 'mlflow.db'} was written by a newer MLflow than the installed {VERSION}" in message
    assert "f00dfeedbeef" in message
    with pytest.raises(UserError, match="newer MLflow"):
        Tracker(None, run_dir, "e", enabled=True, retry_seconds=0.0)
    with pytest.raises(UserError, match="newer MLflow"):
        ui_command(str(run_dir), None, None)


def test_stores_this_mlflow_can_open_pass_the_schema_check(tmp_path, cache):
    """Its own store, a file that is no MLflow store yet (MLflow makes its tables), other URIs."""
    import sqlite3

    assert "f00dfeedbeef" not in mlflow_store.schema_revisions() and len(mlflow_store.schema_revisions()) > 50
    own = f"sqlite:///{tmp_path / 'own.db'}"
    mlflow_store.mlflow_client(own).search_experiments()
    mlflow_store.check_store_schema(own)
    sqlite3.connect(tmp_path / "empty.db").close()
    mlflow_store.mlflow_client(f"sqlite:///{tmp_path / 'empty.db'}").search_experiments()
    for other in ("http://127.0.0.1:1", "file:///nowhere", f"sqlite:///{tmp_path / 'missing.db'}"):
        mlflow_store.check_store_schema(other)
