"""`mimir ui`: the MLflow UI on a run's store, bound to 127.0.0.1 by default.

    mimir ui --run-dir runs/demo            # sqlite:///runs/demo/mlflow.db, artifacts beside it
    mimir ui --backend-store-uri sqlite:////abs/path/mlflow.db --port 5001

Open the URL it prints (the latest run's experiment, in the model-training view) and log in with the
user and password of ``~/.config/mimir/ui/login`` (made and printed on first use: ops/ui_login.py);
from a laptop, tunnel first: ``ssh -L 5000:127.0.0.1:5000 HOST``. The server is MLflow's with the
``mimir`` app plugin (ops/ui_app.py): MLflow's login, and the training view as the UI's default.
Without that plugin (its entry point missing) the UI would have no login: `mimir ui` refuses.
"""

from __future__ import annotations

import importlib.util
import logging
import os
import sys
from pathlib import Path

from mimir_megatron.errors import UserError
from mimir_megatron.checkpoint.run_directory import RunDirectory
from mimir_megatron.mlflow_store import check_store_schema
from mimir_megatron.ops.mlflow_server import DEFAULT_HOST, server_command, server_env
from mimir_megatron.ops.ui_app import APP_NAME, TRAINING_VIEW
from mimir_megatron.ops.ui_login import ui_login

log = logging.getLogger("mimir")

_LOOPBACK = {"127.0.0.1", "localhost", "::1"}


def ui_command(
    run_dir: str | None,
    backend_store_uri: str | None,
    artifacts_dir: str | None,
    host: str = DEFAULT_HOST,
    port: int = 5000,
) -> list[str]:
    """The ``mlflow server`` command line for these options (validated, nothing started)."""
    if run_dir is None and backend_store_uri is None:
        raise UserError("give --run-dir (a training run directory) or --backend-store-uri")
    if run_dir is not None:
        store = RunDirectory(Path(run_dir))
        if backend_store_uri is None:
            if not store.mlflow_db.is_file():
                raise UserError(
                    f"no MLflow store in {run_dir} (expected {store.mlflow_db}); "
                    "train first, or pass --backend-store-uri"
                )
            backend_store_uri = store.mlflow_uri
        artifacts_dir = artifacts_dir or str(store.artifacts)
    if artifacts_dir is None:
        raise UserError("--backend-store-uri without --run-dir needs --artifacts-dir")
    check_store_schema(backend_store_uri)  # before a server that would fail on it in its log
    return server_command(backend_store_uri, artifacts_dir, host=host, port=port,
                          app_name=APP_NAME if app_installed() else None)


def app_installed() -> bool:
    """Whether MLflow can find the ``mimir`` server app (the package's ``mlflow.app`` entry point)."""
    from importlib.metadata import entry_points

    return any(e.name == APP_NAME for e in entry_points(group="mlflow.app"))


def start_url(base: str, backend_store_uri: str) -> str:
    """The page to open: the experiment of the store's latest run in the training view (the
    experiment list where the store has no run or cannot be read)."""
    view = f"?workflowType={TRAINING_VIEW}"
    try:
        from mimir_megatron.mlflow_store import mlflow_client

        client = mlflow_client(backend_store_uri, request_timeout_s=5)
        experiments = [e.experiment_id for e in client.search_experiments()]
        runs = client.search_runs(experiments, max_results=1, order_by=["attributes.start_time DESC"])
    except Exception as exc:  # noqa: BLE001 - only the printed link depends on it
        log.debug("no latest run in %s: %s", backend_store_uri, exc)
        runs = []
    if not runs:
        return f"{base}/#/experiments{view}"
    return f"{base}/#/experiments/{runs[0].info.experiment_id}/runs{view}"


def serve(
    run_dir: str | None = None,
    backend_store_uri: str | None = None,
    artifacts_dir: str | None = None,
    host: str = DEFAULT_HOST,
    port: int = 5000,
) -> None:
    """Replace this process with the MLflow server (Ctrl-C stops it)."""
    if importlib.util.find_spec("mlflow") is None or importlib.util.find_spec("flask") is None:
        raise UserError(
            "the MLflow UI needs the full `mlflow` package (mlflow-skinny cannot serve): "
            "pip install mlflow"
        )
    if importlib.util.find_spec("flask_wtf") is None:
        raise UserError("the login of the MLflow UI needs MLflow's auth extra: pip install 'mlflow[auth]' "
                        "(or 'mimir-megatron[ui]')")
    cmd = ui_command(run_dir, backend_store_uri, artifacts_dir, host, port)
    if "--app-name" not in cmd:
        raise UserError("the mimir MLflow app is not installed, and without it the UI has no login: "
                        "reinstall mimir-megatron (pip install 'mimir-megatron[ui]')")
    login, created = ui_login()
    if host not in _LOOPBACK:
        log.warning("binding %s: the UI is reachable from the network (behind its login, over plain HTTP)",
                    host)
    shown = f"[{host}]" if ":" in host else host
    url = start_url(f"http://{'127.0.0.1' if host in ('0.0.0.0', '::') else shown}:{port}", cmd[5])
    log.info("MLflow UI on http://%s:%d (store %s); Ctrl-C stops it", shown, port, cmd[5])
    if created:
        log.info("a login was made for you (printed this once; kept in %s, mode 0600): user %s, password %s",
                 login.login_file, login.username, login.password)
    else:
        log.info("log in as %s (the password is in %s)", login.username, login.login_file)
    log.info("open %s", url)
    for handler in logging.getLogger().handlers:
        handler.flush()
    sys.stdout.flush()
    sys.stderr.flush()
    os.execve(cmd[0], cmd, server_env() | login.server_env())
