"""launchers/v1.sh on a real Slurm (tests/slurm_cluster.py starts it): one node, and two nodes
simulated on this machine (one network namespace each).

One node:
1. smoke: a trivial 2-task job runs and reports both ranks;
2. the launcher's own mechanics with a stand-in trainer (seconds): rendezvous variables, the
   GPU-less override, SIGUSR1 -> checkpoint -> `scontrol requeue` -> resume -> COMPLETED;
3. the real thing: `sbatch launchers/v1.sh` with the CPU demo config and 2 tasks, pre-empted
   after a periodic checkpoint, requeued, resumed to the end; exit state, checkpoint, MLflow run
   and losses checked.

Two nodes (`sbatch -N 2 --ntasks-per-node=1`, one rank per node, gloo across the link):
4. an uninterrupted run: losses equal a one-rank run's, both ranks' shards in the checkpoint;
5. pre-emption (SIGUSR1) after a periodic checkpoint: requeued, resumed, the uninterrupted
   run's losses; `scancel` (SIGTERM): cancelled, with a checkpoint;
6. a node crash mid-run (link down, every process of the node killed): Slurm requeues the job,
   it resumes from `latest` once the node is back, every logged loss equals the uninterrupted
   run's, one MLflow run.

Every real run is the tests' small model on the demo data, 30 steps, a checkpoint every 5.
Skipped (with the reason) only when the Slurm/munge binaries are missing or not root, and the
two-node tests also without iproute2/util-linux or the right to create namespaces.
"""

from __future__ import annotations

import json
import re
import sys
import time
from pathlib import Path

import pytest
from conftest import train_overrides
from slurm_cluster import (
    SlurmCluster,
    missing,
    namespace_pids,
    namespaces,
    processes_of,
    write_fake_trainer,
)
from mimir_megatron.train.tracking import metric_name

REPO = Path(__file__).resolve().parents[2]
V1 = REPO / "launchers" / "v1.sh"
RTOL = 2e-5  # 1 vs 2 data-parallel ranks: fp32 reductions in another order (test_train_parallel)

pytestmark = [pytest.mark.system, pytest.mark.skipif(missing() is not None, reason=str(missing()))]
needs_two_nodes = pytest.mark.skipif(missing(2) is not None, reason=str(missing(2)))

# The tests' nodes have no GPUs and few CPUs: override the recipe's allocation on the command line.
CPU_ALLOCATION = ["--cpus-per-task=1", "--gpus-per-node=0", "--time=15:00"]
ONE_NODE = ["--nodes=1", "--ntasks-per-node=2", *CPU_ALLOCATION]
TWO_NODES = ["--nodes=2", "--ntasks-per-node=1", *CPU_ALLOCATION]
# Pre-emption is sent once step INTERVAL's checkpoint is logged: the steps after it are the
# margin for the signal to arrive before the run ends (seconds even on a fast machine).
STEPS, INTERVAL = 30, 5
RUN = (f"train.steps={STEPS}", f"checkpoint.interval={INTERVAL}", "train.log_interval=1")


@pytest.fixture(scope="module")
def cluster():
    c = SlurmCluster.start()
    try:
        yield c
    finally:
        c.stop()
    assert leftovers(c) == [], "the one-node cluster left things behind"


@pytest.fixture(scope="module")
def two_nodes():
    c = SlurmCluster.start(nodes=2)
    try:
        yield c
    finally:
        c.stop()
    assert leftovers(c) == [], "the two-node cluster left things behind"


def leftovers(c: SlurmCluster) -> list[str]:
    """Namespaces and processes of ``c`` still there after ``stop()``."""
    ours = {n.netns for n in c.nodes if n.netns} | ({c.switch} if c.switch else set())
    return ([f"namespace {ns}" for ns in namespaces() if ns in ours]
            + [f"process {pid}" for pid in processes_of(c)])


def wait_for_text(path: Path, pattern: str, timeout: float, cluster: SlurmCluster,
                  job: str) -> re.Match:
    """Poll a job's output file until the regex matches (fails early if the job ends)."""
    deadline = time.monotonic() + timeout
    text = ""
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
        [*ONE_NODE, f"--output={out}", str(V1)],
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


def submit_demo(cluster: SlurmCluster, demo_data: Path, run_dir: Path, out: Path,
                allocation: list[str], *extra: str) -> str:
    """sbatch launchers/v1.sh: configs/train/demo.yaml with the tests' small model and data
    (conftest.train_overrides) and :data:`RUN`."""
    overrides = [o for o in train_overrides(demo_data, run_dir, *RUN, *extra)
                 if not o.startswith("run.dir=")]  # RUN_DIR sets it
    return cluster.sbatch(
        [*allocation, f"--output={out}", str(V1)],
        env={"PYTHON": sys.executable, "CONFIG": "configs/train/demo.yaml",
             "RUN_DIR": str(run_dir), "EXTRA_ARGS": " ".join(overrides)},
        cwd=REPO,
    )


def mlflow_losses(run_dir: Path) -> dict[int, list[float]]:
    """{step: every loss logged for it} of the run's only MLflow run, which must be FINISHED
    (steps re-run after a crash are logged twice)."""
    from mlflow import MlflowClient

    client = MlflowClient(tracking_uri=f"sqlite:///{run_dir / 'mlflow.db'}")
    experiment = client.get_experiment_by_name("mimir-demo")
    assert experiment is not None, "no MLflow experiment mimir-demo"
    runs = client.search_runs([experiment.experiment_id])
    assert [r.info.status for r in runs] == ["FINISHED"], "not one finished MLflow run"
    assert runs[0].data.params["train.steps"] == str(STEPS)
    losses: dict[int, list[float]] = {}
    for metric in client.get_metric_history(runs[0].info.run_id, metric_name("loss")):
        losses.setdefault(metric.step, []).append(metric.value)
    assert sorted(losses) == list(range(1, STEPS + 1)), "steps missing from the MLflow run"
    return losses


def assert_losses(logged: dict[int, list[float]], expected: list[float], rel: float = 0.0) -> None:
    """Every logged loss (all attempts') equals the step's expected loss (exactly, by default)."""
    differ = {step: values for step, values in logged.items()
              if any(v != pytest.approx(expected[step - 1], rel=rel, abs=0) for v in values)}
    assert differ == {}, f"losses differ from {expected}"


def assert_preempted_and_resumed(log: str, job: str, run_dir: Path, saved: int) -> None:
    """The pre-emption checkpoint came after a periodic one, every rank saved it, and the
    requeued job resumed from it and finished."""
    assert saved > INTERVAL, f"pre-empted at step {saved}, before a periodic checkpoint:\n{log}"
    assert "could not write checkpoint" not in log and "Traceback" not in log, log[-4000:]
    assert f"requeueing job {job}" in log
    assert f"resumed from {run_dir}/checkpoints/step_{saved:07d} at step {saved}" in log, log[-4000:]
    assert (run_dir / "checkpoints" / "latest").read_text().strip() == f"step_{STEPS:07d}"


@pytest.fixture(scope="module")
def one_rank_losses(demo_data, tmp_path_factory) -> list[float]:
    """The losses of the same training in this process, one rank."""
    from mimir_megatron.train.config import load_train_config
    from mimir_megatron.train.loop import train

    run_dir = tmp_path_factory.mktemp("one-rank")
    cfg = load_train_config(REPO / "configs/train/demo.yaml", train_overrides(demo_data, run_dir, *RUN))
    return train(cfg).losses


@pytest.mark.slow
def test_v1_demo_is_preempted_after_a_checkpoint_requeued_and_resumes(cluster, demo_data, tmp_path,
                                                                      one_rank_losses):
    pytest.importorskip("mlflow", reason="the MLflow check reads the run with mlflow")
    run_dir, out = tmp_path / "run", tmp_path / "job.out"
    job = submit_demo(cluster, demo_data, run_dir, out, ONE_NODE)
    # Pre-empt once a periodic checkpoint exists: its save started the checkpoint helpers,
    # which the signal reaches too.
    log, saved = preempt_until_complete(cluster, job, out, rf"checkpoint saved: \S+/step_{INTERVAL:07d}$",
                                        start_timeout=600, timeout=600)
    assert_preempted_and_resumed(log, job, run_dir, saved)
    assert "TP=1 DP=2" in log
    assert_losses(mlflow_losses(run_dir), one_rank_losses, rel=RTOL)


# ---------------------------------------------------------------- two nodes


def assert_both_ranks_wrote(checkpoint: Path) -> None:
    for name in ("__0_0.distcp", "__1_0.distcp", "rng_rank0.safetensors", "rng_rank1.safetensors"):
        assert (checkpoint / name).is_file() and (checkpoint / name).stat().st_size, name


@pytest.fixture(scope="module")
def two_node_run(two_nodes, demo_data, tmp_path_factory):
    """One uninterrupted two-node run: (job, its fields, run dir, log, losses by step)."""
    pytest.importorskip("mlflow", reason="the MLflow check reads the run with mlflow")
    run_dir = tmp_path_factory.mktemp("two-nodes") / "run"
    out = run_dir.parent / "job.out"
    job = submit_demo(two_nodes, demo_data, run_dir, out, TWO_NODES)
    info = two_nodes.wait(job, timeout=600)
    log = out.read_text()
    assert (info["JobState"], info["ExitCode"], info["Restarts"]) == ("COMPLETED", "0:0", "0"), log
    return job, info, run_dir, log, mlflow_losses(run_dir)


@needs_two_nodes
@pytest.mark.slow
def test_two_nodes_train_one_rank_each_like_one_rank(two_nodes, two_node_run, one_rank_losses):
    job, info, run_dir, log, losses = two_node_run
    assert info["NodeList"] == "node[1-2]" and info["NumTasks"] == "2", info
    assert "on node[1-2]: 2 x 1 tasks, master node1:" in log and "TP=1 DP=2" in log
    for node in ("node1", "node2"):  # each node's slurmd started one task of the step
        slurmd_log = (two_nodes.logs / f"slurmd-{node}.log").read_text()
        assert re.search(rf"launch task StepId={job}\.0 ", slurmd_log), f"{node} ran no task"
    assert_losses(losses, one_rank_losses, rel=RTOL)
    latest = (run_dir / "checkpoints" / "latest").read_text().strip()
    assert latest == f"step_{STEPS:07d}"
    assert_both_ranks_wrote(run_dir / "checkpoints" / latest)


@needs_two_nodes
@pytest.mark.slow
def test_two_nodes_preempted_after_a_checkpoint_requeue_and_resume(two_nodes, two_node_run, demo_data,
                                                                   tmp_path):
    run_dir, out = tmp_path / "run", tmp_path / "job.out"
    job = submit_demo(two_nodes, demo_data, run_dir, out, TWO_NODES)
    log, saved = preempt_until_complete(two_nodes, job, out, rf"checkpoint saved: \S+/step_{INTERVAL:07d}$",
                                        start_timeout=600, timeout=600)
    assert_preempted_and_resumed(log, job, run_dir, saved)
    assert len(re.findall(rf"pre-empted: checkpoint saved at step {saved}$", log, re.M)) == 2  # both ranks
    assert_losses(mlflow_losses(run_dir), [v[0] for _, v in sorted(two_node_run[4].items())])
    assert_both_ranks_wrote(run_dir / "checkpoints" / f"step_{STEPS:07d}")


@needs_two_nodes
@pytest.mark.slow
def test_two_nodes_scancel_ends_the_job_with_a_checkpoint(two_nodes, demo_data, tmp_path):
    run_dir, out = tmp_path / "run", tmp_path / "job.out"
    job = submit_demo(two_nodes, demo_data, run_dir, out, TWO_NODES, "tracking.enabled=false")
    wait_for_text(out, rf"checkpoint saved: \S+/step_{INTERVAL:07d}$", 600, two_nodes, job)
    two_nodes.scancel(job)  # SIGTERM to every process of the job, on both nodes
    info = two_nodes.wait(job, timeout=120)
    log = out.read_text()
    assert (info["JobState"], info["Restarts"]) == ("CANCELLED", "0"), log
    saved = [int(s) for s in re.findall(r"pre-empted: checkpoint saved at step (\d+)", log)]
    assert len(saved) == 2 and saved[0] == saved[1] > INTERVAL, log[-4000:]  # both ranks
    assert "could not write checkpoint" not in log and "requeueing" not in log, log[-4000:]
    latest = (run_dir / "checkpoints" / "latest").read_text().strip()
    assert latest == f"step_{saved[0]:07d}"
    assert_both_ranks_wrote(run_dir / "checkpoints" / latest)


@needs_two_nodes
@pytest.mark.slow
def test_two_nodes_node_crash_is_requeued_and_resumes_from_latest(two_nodes, two_node_run, demo_data,
                                                                  tmp_path):
    run_dir, out = tmp_path / "run", tmp_path / "job.out"
    job = submit_demo(two_nodes, demo_data, run_dir, out, TWO_NODES)
    wait_for_text(out, rf"step {INTERVAL + 2}/{STEPS} loss", 600, two_nodes, job)
    two_nodes.crash("node2")
    # No save can complete without node2's rank: `latest` is what the resumed job must use.
    latest = (run_dir / "checkpoints" / "latest").read_text().strip()
    info = two_nodes.wait(job, timeout=300, until=lambda f: f["Restarts"] != "0"
                          or f["JobState"] in ("COMPLETED", "FAILED", "CANCELLED", "NODE_FAIL"))
    # Requeued (the first attempt's processes on node1 may still be ending: COMPLETING).
    assert info["Restarts"] == "1" and info["JobState"] in ("COMPLETING", "PENDING", "REQUEUED"), info
    two_nodes.revive("node2")
    info = two_nodes.wait(job, timeout=600)
    log = out.read_text()
    assert (info["JobState"], info["ExitCode"], info["Restarts"]) == ("COMPLETED", "0:0", "1"), log
    step = int(latest.removeprefix("step_"))
    assert step >= INTERVAL
    assert f"resumed from {run_dir}/checkpoints/{latest} at step {step}" in log, log[-4000:]
    assert_losses(mlflow_losses(run_dir),  # one run, continued; re-run steps logged twice
                  [v[0] for _, v in sorted(two_node_run[4].items())])


@needs_two_nodes
def test_tear_down_ends_running_jobs_and_leaves_nothing(tmp_path):
    """What a failed test's tear-down meets: a job still running on both nodes."""
    c = SlurmCluster.start(nodes=2)
    try:
        script = tmp_path / "sleep.sh"
        script.write_text("#!/bin/bash\nsrun sleep 600\n")
        job = c.sbatch(["--nodes=2", "--ntasks-per-node=1", f"--output={tmp_path / 'out'}", str(script)])
        c.wait(job, timeout=60, until=lambda f: f["JobState"] == "RUNNING")
        wait_for_sleepers = time.monotonic() + 60
        while not all(sleeping_in(n.netns) for n in c.nodes):
            assert time.monotonic() < wait_for_sleepers, "the job's tasks did not start on both nodes"
            time.sleep(0.2)
    finally:
        c.stop()
    assert leftovers(c) == []


def sleeping_in(netns: str) -> bool:
    """Whether a `sleep` runs in ``netns``."""
    names = []
    for pid in namespace_pids(netns):
        try:
            names.append(Path(f"/proc/{pid}/comm").read_text().strip())
        except OSError:
            pass  # ended meanwhile
    return "sleep" in names
