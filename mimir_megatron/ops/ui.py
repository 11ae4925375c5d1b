"""`mimir ui`: the MLflow UI on a run's store, bound to 127.0.0.1 by default.

    mimir ui --run-dir runs/demo            # sqlite:///runs/demo/mlflow.db, artifacts beside it
    mimir ui --backend-store-uri sqlite:////abs/path/mlflow.db --port 5001

Open http://127.0.0.1:5000; from a laptop, tunnel first: ``ssh -L 5000:127.0.0.1:5000 HOST``.
"""

from __future__ import annotations

import importlib.util
import logging
import os
import sys
from pathlib import Path

from mimir_megatron.errors import UserError
from mimir_megatron.ops.mlflow_server import DEFAULT_HOST, run_store, server_command, server_env

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
        store_uri, default_artifacts = run_store(run_dir)
        if backend_store_uri is None:
            if not (Path(run_dir) / "mlflow.db").is_file():
                raise UserError(
                    f"no MLflow store in {run_dir} (expected {Path(run_dir) / 'mlflow.db'}); "
                    "train first, or pass --backend-store-uri"
                )
            backend_store_uri = store_uri
        artifacts_dir = artifacts_dir or str(default_artifacts)
    if artifacts_dir is None:
        raise UserError("--backend-store-uri without --run-dir needs --artifacts-dir")
    return server_command(backend_store_uri, artifacts_dir, host=host, port=port)


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
    cmd = ui_command(run_dir, backend_store_uri, artifacts_dir, host, port)
    if host not in _LOOPBACK:
        log.warning("binding %s: the MLflow UI has no authentication", host)
    log.info("MLflow UI on http://%s:%d (store %s); Ctrl-C stops it", host, port, cmd[5])
    for handler in logging.getLogger().handlers:
        handler.flush()
    sys.stdout.flush()
    sys.stderr.flush()
    os.execve(cmd[0], cmd, server_env())
