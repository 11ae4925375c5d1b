"""launchers/v1.sh on a real single-node Slurm (tests/slurm_cluster.py starts it).

1. smoke: a trivial 2-task job runs and reports both ranks;
2. the launcher's own mechanics with a stand-in trainer (seconds): rendezvous variables, the
   GPU-less override, SIGUSR1 -> checkpoint -> `scontrol requeue` -> resume -> COMPLETED;
3. the real thing: `sbatch launchers/v1.sh` with the CPU demo config and 2 tasks, checked by
   exit state, checkpoint and MLflow run; then a pre-empted job that is requeued and resumes.

Skipped (with the reason) only when the Slurm/munge binaries are missing or not root.
"""

from __future__ import annotations

import json
import re
import sys
import time
from pathlib import Path

import pytest
from conftest import train_overrides
from slurm_cluster import SlurmCluster, missing, write_fake_trainer

REPO = Path(__file__).resolve().parents[2]
V1 = REPO / "launchers" / "v1.sh"

pytestmark = pytest.mark.skipif(missing() is not None, reason=str(missing()))

# The tests' node has 2 CPUs and no GPUs: override the recipe's allocation on the command line.
CPU_ALLOCATION = ["--nodes=1", "--ntasks-per-node=2", "--cpus-per-task=1", "--gpus-per-node=0",
                  "--time=15:00"]


@pytest.fixture(scope="module")
def cluster():
    c = SlurmCluster.start()
    try:
        yield c
    finally:
        c.stop()


def wait_for_text(path: Path, pattern: str, timeout: float, cluster: SlurmCluster,
                  job: str) -> re.Match:
    """Poll a job's output file until the regex matches (fails early if the job ends)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        text = path.read_text(errors="replace") if path.exists() else ""
        if m := re.search(pattern, text, re.MULTILINE):
            return m
        state = cluster.job(job)["JobState"]
        if state not in ("PENDING", "RUNNING", "CONFIGURING", "REQUEUED", "COMPLETING"):
            break
        time.sleep(0.3)
    raise AssertionError(f"{pattern!r} not in {path} after {timeout} s "
                         f"(job {cluster.job(job)['JobState']}):\n{text[-4000:]}")


def test_two_task_job_runs(cluster, tmp_path):
    out = tmp_path / "smoke.out"
    script = tmp_path / "smoke.sh"
    script.write_text('#!/bin/bash\nsrun bash -c \'echo "task $SLURM_PROCID of $SLURM_NTASKS"\'\n')
    job = cluster.sbatch(["--ntasks=2", f"--output={out}", str(script)])
    info = cluster.wait(job, timeout=60)
    assert (info["JobState"], info["ExitCode"]) == ("COMPLETED", "0:0")
    assert sorted(out.read_text().split("\n")[:2]) == ["task 0 of 2", "task 1 of 2"]


def submit_stand_in(cluster, tmp_path, steps: int):
    """`sbatch launchers/v1.sh` with the stand-in trainer; returns (job, run dir, output file)."""
    python = write_fake_trainer(tmp_path / "fake", sys.executable)
    run_dir = tmp_path / "run"
    out = tmp_path / "job.out"
    job = cluster.sbatch(
        [*CPU_ALLOCATION, f"--output={out}", str(V1)],
        env={"PYTHON": str(python), "CONFIG": "configs/train/demo.yaml", "RUN_DIR": str(run_dir),
             "EXTRA_ARGS": f"train.steps={steps}", "FAKE_STEP_SECONDS": "0.2"},
        cwd=REPO,
    )
    return job, run_dir, out


def preempt_until_complete(cluster, job, out, started: str, start_timeout: float,
                           timeout: float) -> tuple[str, int]:
    """Once ``started`` is logged, send USR1 to the batch script; the job must checkpoint,
    requeue once and complete. Returns the log and the step the checkpoint was saved at."""
    wait_for_text(out, started, start_timeout, cluster, job)
    cluster.scancel("--batch", "--signal=USR1", job)
    info = cluster.wait(job, timeout=timeout, until=lambda f: f["JobState"] == "COMPLETED"
                        or (f["JobState"] in ("FAILED", "CANCELLED", "TIMEOUT")))
    log = out.read_text()
    assert (info["JobState"], info["ExitCode"], info["Restarts"]) == ("COMPLETED", "0:0", "1"), log
    return log, int(re.search(r"pre-empted: checkpoint saved at step (\d+)", log).group(1))


def test_v1_requeues_and_resumes_with_a_stand_in_trainer(cluster, tmp_path):
    job, run_dir, out = submit_stand_in(cluster, tmp_path, 25)
    log, saved = preempt_until_complete(cluster, job, out, r"step 3/25", start_timeout=60, timeout=90)
    assert 3 <= saved < 25
    assert f"requeueing job {job}" in log
    assert f"resumed from {run_dir}/checkpoints/step_{saved:07d} at step {saved}" in log
    assert "training done at step 25" in log
    assert (run_dir / "checkpoints" / "latest").read_text().strip() == "step_0000025"

    # Both attempts: two ranks each, one rendezvous point, Slurm's ranks, threads per CPU.
    for attempt in ("0", "1"):
        ranks = [json.loads((run_dir / f"env-rank{r}-{attempt}.json").read_text()) for r in (0, 1)]
        assert [(e["rank"], e["world"], e["local_rank"]) for e in ranks] == [(0, 2, 0), (1, 2, 1)]
        assert {e["MASTER_ADDR"] for e in ranks} == {cluster.host}
        assert {e["MASTER_PORT"] for e in ranks} == {str(20000 + int(job) % 20000)}
        assert {e["OMP_NUM_THREADS"] for e in ranks} == {"1"}
        assert {e["CUDA_DEVICE_MAX_CONNECTIONS"] for e in ranks} == {"1"}
        assert ranks[0]["argv"] == ["train", "--config", "configs/train/demo.yaml",
                                    f"run.dir={run_dir}", "train.steps=25"]


def test_v1_scancel_saves_but_does_not_requeue(cluster, tmp_path):
    job, run_dir, out = submit_stand_in(cluster, tmp_path, 1000)
    wait_for_text(out, r"step 2/1000", 60, cluster, job)
    cluster.scancel(job)  # SIGTERM to the batch shell and the tasks
    info = cluster.wait(job, timeout=60)
    log = out.read_text()
    assert (info["JobState"], info["Restarts"]) == ("CANCELLED", "0"), log
    assert "pre-empted: checkpoint saved at step" in log
    assert "requeueing" not in log
    assert (run_dir / "checkpoints" / "latest").is_file()


# ---------------------------------------------------------------- with the real trainer

DEMO_STEPS = 12


def submit_demo(cluster: SlurmCluster, demo_data: Path, run_dir: Path, out: Path,
                *extra: str) -> str:
    """sbatch launchers/v1.sh: configs/train/demo.yaml with the tests' small model and data
    (conftest.train_overrides), 2 tasks on the CPU node."""
    overrides = [o for o in train_overrides(demo_data, run_dir, *extra)
                 if not o.startswith("run.dir=")]  # RUN_DIR sets it
    return cluster.sbatch(
        [*CPU_ALLOCATION, f"--output={out}", str(V1)],
        env={"PYTHON": sys.executable, "CONFIG": "configs/train/demo.yaml",
             "RUN_DIR": str(run_dir), "EXTRA_ARGS": " ".join(overrides)},
        cwd=REPO,
    )


def mlflow_runs(run_dir: Path) -> tuple:
    from mlflow import MlflowClient

    client = MlflowClient(tracking_uri=f"sqlite:///{run_dir / 'mlflow.db'}")
    experiment = client.get_experiment_by_name("mimir-demo")
    assert experiment is not None, "no MLflow experiment mimir-demo"
    return client, client.search_runs([experiment.experiment_id])


@pytest.mark.slow
def test_v1_trains_the_demo_on_two_tasks(cluster, demo_data, tmp_path):
    pytest.importorskip("mlflow", reason="the MLflow check reads the run with mlflow")
    run_dir, out = tmp_path / "run", tmp_path / "job.out"
    job = submit_demo(cluster, demo_data, run_dir, out, f"train.steps={DEMO_STEPS}",
                      f"checkpoint.interval={DEMO_STEPS}")
    info = cluster.wait(job, timeout=600)
    log = out.read_text()
    assert (info["JobState"], info["ExitCode"], info["Restarts"]) == ("COMPLETED", "0:0", "0"), log
    latest = (run_dir / "checkpoints" / "latest").read_text().strip()
    assert latest == f"step_{DEMO_STEPS:07d}"
    assert (run_dir / "checkpoints" / latest).is_dir()
    client, runs = mlflow_runs(run_dir)
    assert len(runs) == 1 and runs[0].info.status == "FINISHED"
    history = client.get_metric_history(runs[0].info.run_id, "loss")
    assert history and max(m.step for m in history) == DEMO_STEPS
    assert runs[0].data.params["train.steps"] == str(DEMO_STEPS)


@pytest.mark.slow
def test_v1_demo_is_preempted_requeued_and_resumes(cluster, demo_data, tmp_path):
    pytest.importorskip("mlflow", reason="the MLflow check reads the run with mlflow")
    run_dir, out = tmp_path / "run", tmp_path / "job.out"
    steps = 40
    job = submit_demo(cluster, demo_data, run_dir, out, f"train.steps={steps}",
                      "checkpoint.interval=1000", "train.log_interval=1")
    # Pre-empt once training is under way (a step has been logged).
    log, saved = preempt_until_complete(cluster, job, out, rf"step 2/{steps} loss",
                                       start_timeout=600, timeout=600)
    assert 2 <= saved < steps, log
    assert f"requeueing job {job}" in log
    resumed = re.search(r"resumed from (\S+) at step (\d+)", log)
    assert resumed, log
    assert (Path(resumed.group(1)).name, int(resumed.group(2))) == (f"step_{saved:07d}", saved)
    assert (run_dir / "checkpoints" / "latest").read_text().strip() == f"step_{steps:07d}"
    # One MLflow run, continued across the requeue: its loss history covers both attempts.
    client, runs = mlflow_runs(run_dir)
    assert len(runs) == 1 and runs[0].info.status == "FINISHED"
    steps_logged = {m.step for m in client.get_metric_history(runs[0].info.run_id, "loss")}
    assert min(steps_logged) <= saved < max(steps_logged) == steps
