"""Training goes on while the MLflow server is down and delivers every metric when it returns."""

import os
import subprocess
import sys
import time

import pytest

pytest.importorskip("mlflow.server", reason="the full mlflow package is needed to run a server")

from conftest import REPO, train_overrides  # noqa: E402

from mimir_megatron.ops.mlflow_server import MlflowServer  # noqa: E402

STEPS = 40


def loss_steps(server: MlflowServer) -> list[int]:
    runs = server.api("runs/search", {"experiment_ids": ["0", "1", "2"], "max_results": 5})
    if not runs.get("runs"):
        return []
    run_id = runs["runs"][0]["info"]["run_id"]
    history = server.api("metrics/get-history", run_id=run_id, metric_key="loss")
    return sorted(m["step"] for m in history.get("metrics", []))


def wait_for(predicate, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.5)


@pytest.mark.slow
def test_server_stopped_mid_run(demo_data, tmp_path):
    store = tmp_path / "store"
    server = MlflowServer(store).start()
    port = server.port
    log = tmp_path / "train.log"
    cmd = [sys.executable, "-m", "mimir_megatron.cli", "train", "--config",
           str(REPO / "configs/train/demo.yaml"),
           *train_overrides(demo_data, tmp_path / "run", f"train.steps={STEPS}",
                            "checkpoint.interval=1000", f"tracking.uri={server.uri}",
                            "tracking.experiment=outage", "tracking.retry_seconds=1",
                            "window.schedule=constant", "window.k=2")]
    with open(log, "w") as out:
        train = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT,
                                 env=dict(os.environ, OMP_NUM_THREADS="1"))
    try:
        wait_for(lambda: len(loss_steps(server)) >= 3, 240, "the first metrics")
        server.stop()
        wait_for(lambda: "unreachable" in log.read_text() or train.poll() is not None, 120,
                 "the trainer to notice the outage")
        assert train.poll() is None, "training ended before the outage was noticed:\n" + log.read_text()[-3000:]
        time.sleep(3)  # a few steps while the server is down
        server = MlflowServer(store, port=port).start()
        assert train.wait(timeout=300) == 0, log.read_text()[-3000:]
        assert loss_steps(server) == list(range(1, STEPS + 1))
        text = log.read_text()
        assert text.count("unreachable") == 1  # warned once
        assert "reachable again" in text
    finally:
        if train.poll() is None:
            train.kill()
        server.stop()
