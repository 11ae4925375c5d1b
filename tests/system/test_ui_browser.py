"""`mimir ui` as a researcher sees it: a small trained run (with evaluations during training),
the UI started as the README says, and a real browser (Debian's headless `chromium`) opened on
the experiment and the run, its login prompt answered with the login `mimir ui` made, as the
run's owner types it (tests/helpers/browser.py); a browser without it gets no page.

Checked in the rendered page (chromium's DOM after the UI's scripts ran), in a fresh browser
profile as a new user has: the experiment opens in the model-training view (its runs), not
MLflow's GenAI overview; the run's charts start with the `1-train` section and its loss chart;
the run's artifact list holds the resolved config, the data records and the evaluation results.
Screenshots of each page go to ``$MIMIR_TEST_ARTIFACTS/ui`` (default ``build/test-artifacts/ui``),
which CI keeps; docs/operations.md shows one of them.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from browser import Browser
from conftest import REPO, train_overrides

pytest.importorskip("flask", reason="the MLflow UI needs the full mlflow, not mlflow-skinny")

from mimir_megatron.ops.mlflow_server import get_json, wait_healthy  # noqa: E402
from mimir_megatron.ports import free_port  # noqa: E402

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
pytestmark = pytest.mark.skipif(CHROMIUM is None, reason="no chromium (apt-get install chromium; tests/run.sh does)")
SCREENSHOTS = Path(os.environ.get("MIMIR_TEST_ARTIFACTS") or REPO / "build" / "test-artifacts") / "ui"


@pytest.fixture(scope="module")
def trained(demo_data, tmp_path_factory):
    """A 6-step run that evaluates every 3 steps: (run directory, TrainResult)."""
    from mimir_megatron.train.config import load_train_config
    from mimir_megatron.train.loop import train

    run_dir = tmp_path_factory.mktemp("ui-run")
    cfg = load_train_config(REPO / "configs" / "train" / "demo.yaml", train_overrides(
        demo_data, run_dir, "eval.interval=3", "eval.max_samples=4", "eval.max_new_tokens=8"))
    return run_dir, train(cfg)


@pytest.fixture(scope="module")
def ui(trained, tmp_path_factory):
    """`mimir ui --run-dir` on the trained run: (base URL, the URL it says to open, the login's
    ``user:password``)."""
    run_dir, _ = trained
    port = free_port()
    log_path = tmp_path_factory.mktemp("ui-log") / "ui.log"
    config = tmp_path_factory.mktemp("config")  # the login is made here (XDG_CONFIG_HOME)
    with open(log_path, "w") as log:
        process = subprocess.Popen(
            [str(Path(sys.executable).parent / "mimir"), "ui", "--run-dir", str(run_dir), "--port", str(port)],
            cwd=run_dir, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True,
            env={**os.environ, "XDG_CONFIG_HOME": str(config)})
    base = f"http://127.0.0.1:{port}"
    try:
        try:
            wait_healthy(base, timeout=300, process=process)  # a loaded 2-core machine: minutes
        except RuntimeError as exc:
            raise AssertionError(f"{exc}\n{log_path.read_text()[-4000:]}") from None
        said = re.search(r"open (http://\S+)", log_path.read_text())
        assert said, log_path.read_text()[-2000:]
        yield base, said.group(1), (config / "mimir" / "ui" / "login").read_text().strip()
    finally:
        os.killpg(process.pid, 15)
        process.wait(timeout=60)


def title(dom: str) -> str:
    found = re.search(r"<title>([^<]*)</title>", dom)
    return found.group(1) if found else ""


def test_a_new_user_lands_on_the_training_view_the_loss_curve_and_the_runs_files(ui, trained, tmp_path):
    base, said, login = ui
    run_dir, result = trained
    from mlflow.tracking import MlflowClient

    run = MlflowClient(f"sqlite:///{run_dir / 'mlflow.db'}").get_run(result.run_id)
    experiment = run.info.experiment_id
    assert said == f"{base}/#/experiments/{experiment}/runs?workflowType=machine_learning"
    stranger = Browser(CHROMIUM, tmp_path / "stranger", SCREENSHOTS).visit(said, "0-no-login.png")
    assert run.info.run_name not in stranger and not title(stranger)  # the login prompt, no page
    browser = Browser(CHROMIUM, tmp_path / "profile", SCREENSHOTS, login=tuple(login.split(":", 1)))

    # The experiment, without the printed link's query: a first visit opens the training view.
    page = browser.visit(f"{base}/#/experiments/{experiment}", "1-experiment.png")
    assert title(page).startswith("Runs - "), f"opened on {title(page)!r} (GenAI overview: 'Overview - ...')"
    assert run.info.run_name in page and "Detect Issues" not in page
    assert "Ask a question" not in page  # the assistant's panel did not open itself (its button stays)

    # The run's charts: the 1-train section first, with the loss chart.
    page = browser.visit(f"{base}/#/experiments/{experiment}/runs/{result.run_id}/model-metrics",
                         "2-run-charts.png")
    sections = re.findall(r">(\d-[a-z]+)</div>", page)
    assert sections[:5] == ["1-train", "2-schedule", "3-eval", "4-tokens", "5-step"], sections
    first = page.index("1-train")
    assert first < page.index(">loss<") < page.index("2-schedule")
    for chart in (">grad_norm<", ">tokens_per_s<", ">mfu<"):  # later sections render when scrolled to
        assert first < page.index(chart) < page.index("2-schedule"), chart

    # The run's files.
    page = browser.visit(f"{base}/#/experiments/{experiment}/runs/{result.run_id}/artifacts",
                         "3-run-artifacts.png")
    for listed in (">config.yaml<", ">data<", ">eval<"):
        assert listed in page, listed
    import base64

    owner = {"Authorization": "Basic " + base64.b64encode(login.encode()).decode()}
    files = get_json(f"{base}/api/2.0/mlflow/artifacts/list?run_id={result.run_id}&path=data",
                     headers=owner)["files"]
    assert {Path(f["path"]).name for f in files} == {"lineage.json", "policy_decision.json"}
    for screenshot in ("1-experiment.png", "2-run-charts.png", "3-run-artifacts.png"):
        assert (SCREENSHOTS / screenshot).stat().st_size > 10_000
