"""MLflow browsing: a real MLflow server, a short `mimir train` logging to it through an outage
(training goes on and delivers every metric when the server returns), read back over REST; and
`mimir ui` serving a run's sqlite store on 127.0.0.1 only, to its owner only: without the login
(as this user, and as a second Unix user of the machine) nothing is listed, deleted or written.

Skipped when the full `mlflow` package (the server) is not installed.
"""

from __future__ import annotations

import base64
import json
import os
import signal
import stat
import subprocess
import sys
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path

import pytest
from conftest import REPO, train_overrides
from polling import hang_limit, wait_for

pytest.importorskip("mlflow", reason="the MLflow server tests need `pip install mlflow`")
pytest.importorskip("flask", reason="the MLflow server needs the full mlflow, not mlflow-skinny")

from mimir_megatron.ops.mlflow_server import (
    MlflowServer,
    get_json,
    post_json,
    wait_healthy,
)
from mimir_megatron.ports import free_port
from mimir_megatron.train.tracking import metric_name

STEPS = 40  # long enough for the outage to fall inside the run


def history(uri: str, run_id: str, key: str, headers: dict[str, str] | None = None) -> list[tuple[int, float]]:
    query = urllib.parse.urlencode({"run_id": run_id, "metric_key": key})
    metrics = get_json(f"{uri}/api/2.0/mlflow/metrics/get-history?{query}", headers=headers).get("metrics", [])
    return sorted((int(m["step"]), m["value"]) for m in metrics)


def listening_addresses(port: int) -> set[str]:
    """Local addresses (hex, as in /proc/net/tcp*) of the sockets listening on ``port``."""
    found = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        if not os.path.exists(table):
            continue
        for line in Path(table).read_text().splitlines()[1:]:
            local, state = line.split()[1], line.split()[3]
            address, port_hex = local.split(":")
            if state == "0A" and int(port_hex, 16) == port:
                found.add(address)
    return found


def loss_steps(server: MlflowServer) -> list[int]:
    """The steps of the logged losses of the server's one run so far ([] before it exists)."""
    runs = server.api("runs/search", {"experiment_ids": ["0", "1", "2"], "max_results": 5}).get("runs")
    return [s for s, _ in history(server.uri, runs[0]["info"]["run_id"], metric_name("loss"))] if runs else []


def test_training_logs_through_a_server_outage_and_reads_back_over_rest(demo_data, tmp_path):
    """The server is stopped mid-run and started again on its port: training goes on, warns once,
    and delivers every metric when the server returns; the run then reads back over REST."""
    store = tmp_path / "store"
    server = MlflowServer(store, startup_timeout=hang_limit(300)).start()
    log = tmp_path / "train.log"
    cmd = [sys.executable, "-m", "mimir_megatron.cli", "train", "--config", "configs/train/demo.yaml",
           *train_overrides(demo_data, tmp_path / "run", f"train.steps={STEPS}", "checkpoint.interval=1000",
                            f"tracking.uri={server.uri}", "tracking.experiment=server-test",
                            "tracking.retry_seconds=1", "window.schedule=constant", "window.k=2",
                            "train.log_interval=1")]
    with open(log, "w") as out:
        train = subprocess.Popen(cmd, cwd=REPO, stdout=out, stderr=subprocess.STDOUT,
                                 env=dict(os.environ, OMP_NUM_THREADS="1"))
    try:
        wait_for(lambda: len(loss_steps(server)) >= 3, "the first metrics", timeout=240, interval=0.5)
        server.stop()
        wait_for(lambda: "unreachable" in log.read_text() or train.poll() is not None,
                 "the trainer to notice the outage", timeout=120, interval=0.5)
        assert train.poll() is None, "training ended before the outage was noticed:\n" + log.read_text()[-3000:]
        down = log.read_text().index("unreachable")  # steps trained while the server is down:
        wait_for(lambda: log.read_text()[down:].count(" loss ") >= 2 or train.poll() is not None,
                 "two steps trained during the outage", timeout=120, interval=0.2)
        assert train.poll() is None, "training ended during the outage:\n" + log.read_text()[-3000:]
        with MlflowServer(store, port=server.port, startup_timeout=hang_limit(300)) as server:
            assert train.wait(timeout=300) == 0, log.read_text()[-3000:]
            text = log.read_text()
            assert text.count("unreachable") == 1  # warned once
            assert "reachable again" in text

            experiment = server.api("experiments/get-by-name", experiment_name="server-test")
            tags = {t["key"]: t["value"] for t in experiment["experiment"].get("tags", [])}
            assert tags["mlflow.experimentKind"] == "custom_model_development"  # MLflow 3's model-training kind
            runs = post_json(f"{server.uri}/api/2.0/mlflow/runs/search",
                             {"experiment_ids": [experiment["experiment"]["experiment_id"]]}).get("runs", [])
            assert len(runs) == 1
            run = runs[0]
            assert run["info"]["status"] == "FINISHED"
            params = {p["key"]: p["value"] for p in run["data"]["params"]}
            assert params["train.steps"] == str(STEPS)
            assert params["model.hidden_size"] == "64"
            assert params["settings.tracking.experiment"] == "server-test"
            # The run's files arrive too: the config from the start, the lineage of the last checkpoint.
            files = get_json(f"{server.uri}/api/2.0/mlflow/artifacts/list?run_id={run['info']['run_id']}")
            assert {"config.yaml", "data"} <= {f["path"] for f in files.get("files", [])}

            run_id = run["info"]["run_id"]
            steps = list(range(1, STEPS + 1))
            loss = history(server.uri, run_id, metric_name("loss"))
            assert [s for s, _ in loss] == steps  # every step, those of the outage too
            assert all(0 < v < 20 for _, v in loss)
            assert [s for s, _ in history(server.uri, run_id, metric_name("lr/L"))] == steps
            assert history(server.uri, run_id, metric_name("window_k")) == [(s, 2.0) for s in steps]
            # The latest run values (runs/search) agree with the last point of each history.
            latest = {m["key"]: m["value"] for m in run["data"]["metrics"]}
            assert latest[metric_name("loss")] == pytest.approx(loss[-1][1])
        assert server.process is None
    finally:
        if train.poll() is None:
            train.kill()
        server.stop()


def stop_group(process: subprocess.Popen) -> None:
    """End a process started with start_new_session and everything it spawned."""
    for sig, wait_s in ((signal.SIGTERM, 30), (signal.SIGKILL, 30)):
        try:
            os.killpg(process.pid, sig)
        except ProcessLookupError:
            break
        try:
            process.wait(timeout=wait_s)
            break
        except subprocess.TimeoutExpired:
            continue
    process.poll()


def _store_with_one_run(run_dir: Path) -> tuple[str, str]:
    from mlflow import MlflowClient

    run_dir.mkdir(parents=True)
    client = MlflowClient(tracking_uri=f"sqlite:///{run_dir / 'mlflow.db'}")
    experiment_id = client.create_experiment(
        "mimir-demo", artifact_location=(run_dir / "mlartifacts").as_uri())
    run = client.create_run(experiment_id)
    client.log_param(run.info.run_id, "train.steps", "3")
    for step, value in enumerate((3.0, 2.5, 2.25), start=1):
        client.log_metric(run.info.run_id, "loss", value, step=step)
    client.log_text(run.info.run_id, "train:\n  steps: 3\n", "config.yaml")
    client.set_terminated(run.info.run_id)
    return experiment_id, run.info.run_id


def _status(method: str, url: str, body: bytes | None = None, headers: dict[str, str] | None = None) -> int:
    request = urllib.request.Request(url, data=body, method=method,
                                     headers={"Content-Type": "application/json", **(headers or {})})
    try:
        with urllib.request.urlopen(request, timeout=30) as response:
            return response.status
    except urllib.error.HTTPError as error:
        return error.code


def _intrusions(uri: str, experiment_id: str, run_id: str) -> list[tuple[str, str, bytes | None]]:
    """What another user of the node did to an open `mimir ui` (issue 52): read the page, list the
    runs, read a file, delete the run, overwrite its config through the artifact proxy."""
    return [
        ("GET", f"{uri}/", None),
        ("POST", f"{uri}/api/2.0/mlflow/runs/search", json.dumps({"experiment_ids": [experiment_id]}).encode()),
        ("POST", f"{uri}/ajax-api/2.0/mlflow/runs/search", json.dumps({"experiment_ids": [experiment_id]}).encode()),
        ("GET", f"{uri}/api/2.0/mlflow/artifacts/list?run_id={run_id}", None),
        ("GET", f"{uri}/get-artifact?path=config.yaml&run_uuid={run_id}", None),
        ("POST", f"{uri}/api/2.0/mlflow/runs/delete", json.dumps({"run_id": run_id}).encode()),
        ("PUT", f"{uri}/api/2.0/mlflow-artifacts/artifacts/{run_id}/artifacts/config.yaml", b"overwritten"),
    ]


def test_mimir_ui_serves_the_run_store_on_loopback_to_its_owner_only(tmp_path):
    run_dir = tmp_path / "runs" / "demo"
    experiment_id, run_id = _store_with_one_run(run_dir)
    config = run_dir / "mlartifacts" / run_id / "artifacts" / "config.yaml"
    original = config.read_bytes()
    port = free_port()
    log_path = tmp_path / "ui.log"
    with open(log_path, "w") as log:
        ui = subprocess.Popen(
            [str(Path(sys.executable).parent / "mimir"), "ui", "--run-dir", str(run_dir),
             "--port", str(port)],
            cwd=tmp_path, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
            env={**os.environ, "XDG_CONFIG_HOME": str(tmp_path / "config")},
        )
    uri = f"http://127.0.0.1:{port}"
    try:
        try:
            wait_healthy(uri, timeout=hang_limit(300), process=ui)
        except RuntimeError as exc:
            raise AssertionError(f"{exc}\n{log_path.read_text()[-4000:]}") from None
        assert listening_addresses(port) == {"0100007F"}  # 127.0.0.1, nothing else
        # The login: made now, printed once, kept where only this user reads it.
        login = tmp_path / "config" / "mimir" / "ui" / "login"
        user, password = login.read_text().strip().split(":", 1)
        assert f"user {user}, password {password}" in log_path.read_text()
        for path, mode in ((login.parent, 0o700), (login, 0o600), (login.parent / "auth.db", 0o600),
                           (login.parent / "auth.ini", 0o600)):
            assert stat.S_IMODE(path.stat().st_mode) == mode, path
        owner = {"Authorization": "Basic " + base64.b64encode(f"{user}:{password}".encode()).decode()}

        # Without the login, or with a wrong one, nothing answers but /health.
        wrong = {"Authorization": "Basic " + base64.b64encode(f"{user}:guess".encode()).decode()}
        for method, url, body in _intrusions(uri, experiment_id, run_id):
            for headers in (None, wrong):
                assert _status(method, url, body, headers) == 401, (method, url)
        _another_user_is_refused(uri, experiment_id, run_id)
        assert config.read_bytes() == original

        runs = post_json(f"{uri}/api/2.0/mlflow/runs/search", {"experiment_ids": [experiment_id]},
                         headers=owner)["runs"]
        assert [(r["info"]["run_id"], r["info"]["lifecycle_stage"]) for r in runs] == [(run_id, "active")]
        assert history(uri, run_id, "loss", owner) == [(1, 3.0), (2, 2.5), (3, 2.25)]
        assert get_json(f"{uri}/api/2.0/mlflow/runs/get?run_id={run_id}", headers=owner)["run"]["data"][
            "params"] == [{"key": "train.steps", "value": "3"}]
        assert _status("GET", f"{uri}/get-artifact?path=config.yaml&run_uuid={run_id}", headers=owner) == 200
        assert "MLflow UI on http://127.0.0.1:" in log_path.read_text()
    finally:
        stop_group(ui)
    assert not (tmp_path / "mlruns").exists() and not (tmp_path / "mlartifacts").exists()
    assert not (tmp_path / "basic_auth.db").exists()  # MLflow's default place for its account store


def _another_user_is_refused(uri: str, experiment_id: str, run_id: str) -> None:
    """The same intrusions with curl as a second Unix user (tests/helpers/other_user.py)."""
    from other_user import curl_as_other

    for method, url, body in _intrusions(uri, experiment_id, run_id):
        args = ["-H", "Content-Type: application/json", "--data-binary", body.decode()] if body else []
        assert curl_as_other(method, url, *args)[0] == 401, (method, url)
    assert curl_as_other("GET", f"{uri}/health")[0] == 200


def test_mimir_ui_without_a_store_is_a_clear_error(tmp_path):
    proc = subprocess.run(
        [str(Path(sys.executable).parent / "mimir"), "ui", "--run-dir", str(tmp_path / "nope")],
        capture_output=True, text=True, timeout=60,
    )
    assert proc.returncode == 2
    assert f"no MLflow store in {tmp_path / 'nope'}" in proc.stderr
    assert "Traceback" not in proc.stderr
