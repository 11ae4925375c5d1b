"""Shared fixtures. Tests run on CPU with gloo; every test process has a one-rank group."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

# Shared helpers (tests/helpers/*.py) are imported by module name from every tier and worker.
sys.path.insert(0, str(Path(__file__).resolve().parent / "helpers"))
import cost_report  # noqa: E402
import schedule  # noqa: E402
import skip_policy  # noqa: E402

pytest_plugins = ["pytester"]  # tests/unit/test_skip_policy.py runs pytest on small generated suites

REPO = Path(__file__).resolve().parent.parent
TINY = REPO / "configs" / "model" / "tiny.yaml"
MIMIR = REPO / "configs" / "model" / "mimir.yaml"
ARTIFACTS = Path(os.environ.get("MIMIR_TEST_ARTIFACTS") or REPO / "build" / "test-artifacts")


def pytest_configure(config: pytest.Config) -> None:
    if not hasattr(config, "workerinput"):  # the controller sees every worker's reports
        skip_policy.install(config)  # unexpected skips fail under CI=true
    cost_report.install(config, ARTIFACTS / "cost")  # which modules spend the suite's budget
    from mimir_megatron.process import setup_process

    # The test process is an entry point: set up once, explicitly (pytest keeps its own logging).
    setup_process(megatron=True, configure_logging=False)


DOCKER_BUILD_SUMMARY = ARTIFACTS / "docker" / "build-summary.txt"
"""The last lines of `docker/build.sh` in tests/system/test_docker.py (no network inside, time,
size): the controller prints them after the run, since a worker's output is not shown."""


def pytest_sessionstart(session: pytest.Session) -> None:
    if not hasattr(session.config, "workerinput"):
        DOCKER_BUILD_SUMMARY.unlink(missing_ok=True)  # only this run's build is reported


def pytest_terminal_summary(terminalreporter) -> None:
    if DOCKER_BUILD_SUMMARY.is_file():
        terminalreporter.section("the image's build (tests/system/test_docker.py)")
        for line in DOCKER_BUILD_SUMMARY.read_text().splitlines():
            terminalreporter.write_line(line)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    schedule.order_longest_first(items)  # every worker sorts the same way: xdist checks it


@pytest.fixture(scope="session")
def repo() -> Path:
    return REPO


def tiny_config(*overrides: str):
    from mimir_megatron.config import load_config

    # Small enough for exhaustive gradient checks in seconds.
    base = ["hidden_size=64", "num_attention_heads=4", "ffn_hidden_size=128", "vocab_size=250"]
    return load_config(TINY, [*base, *overrides])


@pytest.fixture(scope="session")
def demo_data(tmp_path_factory) -> Path:
    """A small demo data set, prepared once per session, with its mixture YAML."""
    from mimir_megatron.cli import main

    out = tmp_path_factory.mktemp("demo") / "data"
    assert main(["data", "demo", "--output", str(out), "--train-per-group", "150",
                 "--eval-per-group", "8", "--workers", "1"]) == 0
    names = sorted(p.name for p in out.iterdir() if (p / "manifest.json").is_file() and p.name != "eval")
    lines = ["name: test-demo", "datasets:"]
    lines += [f"  - {{name: {n}, path: {out / n}, category: demo, language: en, repeat: 1}}" for n in names]
    (out / "mixture.yaml").write_text("\n".join(lines) + "\n")
    return out


@pytest.fixture(scope="session")
def reference_run(demo_data, tmp_path_factory):
    """The uninterrupted 6-step run of :func:`train_overrides` (checkpoints at steps 3 and 6),
    trained once per session: ``(run_dir, TrainResult)``. Read it, never write into it (copy it)."""
    from mimir_megatron.train.config import load_train_config
    from mimir_megatron.train.loop import train

    run_dir = tmp_path_factory.mktemp("reference")
    cfg = load_train_config(REPO / "configs" / "train" / "demo.yaml", train_overrides(demo_data, run_dir))
    return run_dir, train(cfg)


def train_overrides(demo_data: Path, run_dir: Path, *extra: str) -> list[str]:
    """A few-second training run: the test-sized model on the small demo data."""
    return [
        f"data.mixture={demo_data / 'mixture.yaml'}", f"data.eval_path={demo_data / 'eval'}",
        "data.seq_len=64", f"run.dir={run_dir}", "model.hidden_size=64", "model.num_attention_heads=4",
        "model.ffn_hidden_size=128", "train.steps=6", "train.global_batch_size=4",
        "train.micro_batch_size=2", "optim.warmup_steps=2", "optim.lr=3e-3", "optim.cooldown=none",
        "optim.ema_decay=0.99",
        "checkpoint.interval=3", "eval.max_samples=0", "window.ramp_fraction=0.5",
        "tracking.system_metrics=false",  # on in tests/integration/test_system_metrics.py
        *extra,
    ]
