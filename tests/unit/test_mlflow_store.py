"""``mlflow_store``: a new sqlite store starts from a migrated template and behaves as one that
MLflow created itself (Default experiment with this store's artifact location, runs, metrics)."""

from __future__ import annotations

import os

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
