"""A local MLflow tracking server (UI + REST API) on a run store: command line, start, stop.

``mimir ui`` runs :func:`server_command` in the foreground; tests use :class:`MlflowServer`::

    with MlflowServer(tmp_path / "store") as server:
        ...  # log to server.uri, read back through server.uri + "/api/2.0/mlflow/..."

The server binds 127.0.0.1 unless told otherwise, runs one worker, and has MLflow's job
execution turned off (``MLFLOW_SERVER_ENABLE_JOB_EXECUTION=false``): without it the server
starts seven extra job workers (about 2.3 GB and 30 s) that nothing here uses.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path
from typing import Self

from mimir_megatron.checkpoint.run_directory import RunDirectory
from mimir_megatron.ports import free_port

DEFAULT_HOST = "127.0.0.1"


def server_command(
    backend_store_uri: str,
    artifacts_dir: str | os.PathLike,
    host: str = DEFAULT_HOST,
    port: int = 5000,
    python: str = sys.executable,
    app_name: str | None = None,
) -> list[str]:
    """``mlflow server`` on this store; artifacts are served from (and uploaded to) artifacts_dir.

    Runs whose experiment already has an artifact location (the trainer's sqlite default pins
    ``<run.dir>/mlartifacts``) keep it; experiments created through this server get
    ``mlflow-artifacts:/``, proxied to ``artifacts_dir``. Nothing lands in the working directory.
    ``app_name``: an MLflow server app plugin (``--app-name``), e.g. ``mimir`` (ops/ui_app.py).
    """
    return [
        python, "-m", "mlflow", "server",
        "--backend-store-uri", backend_store_uri,
        "--artifacts-destination", str(Path(artifacts_dir).resolve()),
        "--host", host,
        "--port", str(port),
        "--workers", "1",
        *(["--app-name", app_name] if app_name else []),
    ]


def server_env(base: dict[str, str] | None = None) -> dict[str, str]:
    env = dict(os.environ if base is None else base)
    env["MLFLOW_SERVER_ENABLE_JOB_EXECUTION"] = "false"
    return env


def get_json(url: str, timeout: float = 10.0, headers: dict[str, str] | None = None) -> dict:
    """``GET url`` as JSON (``headers``: e.g. a login's ``Authorization``)."""
    request = urllib.request.Request(url, headers=headers or {})
    with urllib.request.urlopen(request, timeout=timeout) as response:
        return json.loads(response.read().decode())


def post_json(url: str, payload: dict, timeout: float = 10.0, headers: dict[str, str] | None = None) -> dict:
    request = urllib.request.Request(
        url, data=json.dumps(payload).encode(), method="POST",
        headers={"Content-Type": "application/json", **(headers or {})},
    )
    with urllib.request.urlopen(request, timeout=timeout) as response:
        return json.loads(response.read().decode())


def healthy(uri: str) -> bool:
    """Whether the server at ``uri`` answers ``/health`` with 200."""
    try:
        with urllib.request.urlopen(uri + "/health", timeout=2) as response:
            return response.status == 200
    except (urllib.error.URLError, ConnectionError, TimeoutError):
        return False


def wait_healthy(uri: str, timeout: float, process: subprocess.Popen | None = None) -> None:
    """Poll ``/health`` until it answers; raises RuntimeError on timeout or if ``process``
    (the server) exits first."""
    deadline = time.monotonic() + timeout
    while not healthy(uri):
        if process is not None and process.poll() is not None:
            raise RuntimeError(f"mlflow server exited with code {process.returncode}")
        if time.monotonic() > deadline:
            raise RuntimeError(f"mlflow server at {uri} not healthy after {timeout:.0f} s")
        time.sleep(0.5)


class MlflowServer:
    """A server process on a store directory (``mlflow.db`` + ``mlartifacts/``) or given URIs.

    ``start()`` returns once ``/health`` answers (or raises with the server's log tail);
    ``stop()`` ends the whole process group and is safe to call twice.
    """

    def __init__(
        self,
        store_dir: str | os.PathLike,
        backend_store_uri: str | None = None,
        host: str = DEFAULT_HOST,
        port: int | None = None,
        startup_timeout: float = 90.0,
        app_name: str | None = None,
    ) -> None:
        self.store_dir = Path(store_dir).resolve()
        store = RunDirectory(self.store_dir)
        self.artifacts_dir = store.artifacts
        self.backend_store_uri = backend_store_uri or store.mlflow_uri
        self.host = host
        self.port = port
        self.startup_timeout = startup_timeout
        self.app_name = app_name
        self.log_path = self.store_dir / "mlflow-server.log"
        self.process: subprocess.Popen | None = None

    @property
    def uri(self) -> str:
        return f"http://{self.host}:{self.port}"

    def start(self) -> MlflowServer:
        self.store_dir.mkdir(parents=True, exist_ok=True)
        self.artifacts_dir.mkdir(parents=True, exist_ok=True)
        if self.port is None:
            self.port = free_port(self.host)
        cmd = server_command(self.backend_store_uri, self.artifacts_dir, self.host, self.port,
                             app_name=self.app_name)
        with open(self.log_path, "ab") as log:
            # Own process group: mlflow spawns uvicorn, which stop() must end as well.
            self.process = subprocess.Popen(
                cmd, cwd=self.store_dir, env=server_env(), stdout=log, stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL, start_new_session=True,
            )
        try:
            wait_healthy(self.uri, self.startup_timeout, self.process)
        except RuntimeError as exc:
            self.stop()
            raise RuntimeError(f"{exc}; log {self.log_path}:\n{self.log_tail()}") from None
        return self

    def api(self, endpoint: str, payload: dict | None = None, **query: str) -> dict:
        """GET (with query parameters) or POST (with a JSON payload) ``/api/2.0/mlflow/...``."""
        url = f"{self.uri}/api/2.0/mlflow/{endpoint}"
        if payload is not None:
            return post_json(url, payload)
        if query:
            url += "?" + urllib.parse.urlencode(query)
        return get_json(url)

    def stop(self, timeout: float = 20.0) -> None:
        """SIGTERM to the server's process group, SIGKILL after ``timeout``; idempotent."""
        process, self.process = self.process, None
        if process is None:
            return
        for sig in (signal.SIGTERM, signal.SIGKILL):
            try:
                os.killpg(process.pid, sig)
            except ProcessLookupError:
                break
            deadline = time.monotonic() + timeout
            while time.monotonic() < deadline:
                process.poll()  # reap the leader so that the group can disappear
                try:
                    os.killpg(process.pid, 0)
                except ProcessLookupError:
                    return
                time.sleep(0.1)
        process.wait(timeout=timeout)

    def log_tail(self, chars: int = 4000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-chars:]
        except OSError:
            return ""

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
