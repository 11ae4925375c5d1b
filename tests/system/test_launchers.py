"""launchers/*.sh: shellcheck-clean, the commands they build, and torchrun.sh's stop/resume.

Slurm itself is exercised in test_slurm.py; here v1.sh/v1_5.sh run with DRY_RUN=1 and a fake
job environment, which shows the srun command line (pyxis included) without a cluster.
"""

from __future__ import annotations

import hashlib
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from slurm_cluster import write_fake_trainer

REPO = Path(__file__).resolve().parents[2]
LAUNCHERS = REPO / "launchers"


def run(script: str, env: dict[str, str], timeout: float = 60) -> subprocess.CompletedProcess:
    clean = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "MASTER_"))}
    return subprocess.run(["bash", str(LAUNCHERS / script)], env={**clean, **env}, cwd="/",
                          capture_output=True, text=True, timeout=timeout)


def fake_job(**extra: str) -> dict[str, str]:
    """What sbatch puts in a job's environment, for a 2-node x 8-GPU job (DRY_RUN)."""
    return {"SLURM_JOB_ID": "4242", "SLURM_JOB_NODELIST": "gpu[01-02]", "SLURM_JOB_NUM_NODES": "2",
            "SLURM_NTASKS_PER_NODE": "8", "SLURM_CPUS_PER_TASK": "16", "SLURM_SUBMIT_DIR": str(REPO),
            "MASTER_ADDR": "gpu01", "DRY_RUN": "1", **extra}


def srun_line(proc: subprocess.CompletedProcess) -> str:
    assert proc.returncode == 0, proc.stderr
    return next(line for line in proc.stderr.splitlines() if line.startswith("v1.sh: srun "))


def test_shellcheck_clean():
    if shutil.which("shellcheck") is None:
        pytest.skip("shellcheck is not installed (apt-get install shellcheck)")
    scripts = sorted(LAUNCHERS.glob("*.sh"))
    assert {p.name for p in scripts} >= {"v1.sh", "v1_5.sh", "torchrun.sh"}
    proc = subprocess.run(["shellcheck", "--external-sources", *map(str, scripts)],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_v1_refuses_to_run_outside_slurm():
    proc = run("v1.sh", {})
    assert proc.returncode == 2
    assert "not inside a Slurm job; submit it: sbatch launchers/v1.sh" in proc.stderr


def test_v1_srun_command_bare():
    line = srun_line(run("v1.sh", fake_job(PYTHON="/opt/venv/bin/python",
                                           EXTRA_ARGS="train.steps=5 checkpoint.interval=2")))
    assert line == (
        "v1.sh: srun --nodes=2 --ntasks-per-node=8 --ntasks=16 --kill-on-bad-exit=1 "
        "/opt/venv/bin/python -m mimir_megatron.cli train --config configs/train/mimir_v1.yaml "
        f"run.dir={REPO}/runs/mimir_v1 train.steps=5 checkpoint.interval=2"
    )


def test_v1_srun_command_in_a_pyxis_container():
    proc = run("v1.sh", fake_job(CONTAINER_IMAGE="registry#mimir/megatron:0.1.0",
                                 CONTAINER_MOUNTS="/data:/data,/scratch:/scratch",
                                 RUN_DIR="/scratch/runs/v1"))
    assert srun_line(proc) == (
        "v1.sh: srun --nodes=2 --ntasks-per-node=8 --ntasks=16 --kill-on-bad-exit=1 "
        "--container-image=registry#mimir/megatron:0.1.0 "
        "--container-mounts=/data:/data,/scratch:/scratch "
        f"--container-workdir={REPO} mimir train --config configs/train/mimir_v1.yaml "
        "run.dir=/scratch/runs/v1"
    )
    assert "master gpu01:24242" in proc.stderr  # 20000 + job id % 20000


def test_v1_5_starts_from_the_newest_v1_checkpoint_then_resumes_its_own(tmp_path):
    v1_run, v15_run = tmp_path / "v1", tmp_path / "v15"
    (v1_run / "checkpoints" / "step_0000100").mkdir(parents=True)
    (v1_run / "checkpoints" / "latest").write_text("step_0000100\n")
    env = fake_job(PYTHON="python3", V1_RUN_DIR=str(v1_run), RUN_DIR=str(v15_run))

    line = srun_line(run("v1_5.sh", env))
    assert line.endswith(
        f"--config configs/train/mimir_v1_5.yaml run.dir={v15_run} "
        f"checkpoint.init_from={v1_run}/checkpoints/step_0000100"
    )

    (v15_run / "checkpoints").mkdir(parents=True)
    (v15_run / "checkpoints" / "latest").write_text("step_0000010\n")
    proc = run("v1_5.sh", env)
    assert srun_line(proc).endswith(f"--config configs/train/mimir_v1_5.yaml run.dir={v15_run}")
    assert "has checkpoints: resuming, INIT_FROM not used" in proc.stderr


def test_v1_5_needs_a_v1_checkpoint(tmp_path):
    proc = run("v1_5.sh", fake_job(V1_RUN_DIR=str(tmp_path / "none"), RUN_DIR=str(tmp_path / "r")))
    assert proc.returncode == 2
    assert "set INIT_FROM to a v1 checkpoint directory" in proc.stderr
    proc = run("v1_5.sh", fake_job(INIT_FROM=str(tmp_path / "missing"), RUN_DIR=str(tmp_path)))
    assert proc.returncode == 2
    assert f"INIT_FROM={tmp_path}/missing is not a directory" in proc.stderr


def test_torchrun_command():
    proc = run("torchrun.sh", {"DRY_RUN": "1", "PYTHON": "python3", "NPROC_PER_NODE": "8",
                               "CONFIG": "configs/train/demo.yaml", "EXTRA_ARGS": "train.steps=3"})
    assert proc.returncode == 0, proc.stderr
    assert re.search(
        r"torchrun\.sh: pid \d+: python3 -m torch\.distributed\.run --standalone --nnodes=1 "
        r"--nproc-per-node=8 -m mimir_megatron\.cli train --config configs/train/demo\.yaml "
        r"run\.dir=runs/demo train\.steps=3$", proc.stderr.strip()), proc.stderr


def test_torchrun_stops_with_a_checkpoint_on_sigusr1_and_resumes(tmp_path):
    """Real torchrun, 2 workers of the stand-in trainer: the launcher forwards SIGUSR1 to the
    workers, exits 0 after their checkpoint, and a second run resumes and finishes."""
    python = write_fake_trainer(tmp_path / "fake", sys.executable)
    run_dir = tmp_path / "run"
    log_path = tmp_path / "first.log"
    env = {**{k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "MASTER_"))},
           "PYTHON": str(python), "NPROC_PER_NODE": "2", "RUN_DIR": str(run_dir),
           "CONFIG": "configs/train/demo.yaml", "EXTRA_ARGS": "train.steps=200",
           "FAKE_STEP_SECONDS": "0.1"}
    with open(log_path, "w") as log:
        proc = subprocess.Popen(["bash", str(LAUNCHERS / "torchrun.sh")], env=env, stdout=log,
                                stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 90
        while "step 2/200" not in log_path.read_text():
            assert proc.poll() is None and time.monotonic() < deadline, log_path.read_text()
            time.sleep(0.2)
        proc.send_signal(signal.SIGUSR1)
        assert proc.wait(timeout=60) == 0, log_path.read_text()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    text = log_path.read_text()
    saved = int(re.search(r"pre-empted: checkpoint saved at step (\d+)", text).group(1))
    assert 2 <= saved < 200
    assert (run_dir / "checkpoints" / "latest").read_text().strip() == f"step_{saved:07d}"

    env["EXTRA_ARGS"] = f"train.steps={saved + 3}"
    second = subprocess.run(["bash", str(LAUNCHERS / "torchrun.sh")], env=env, timeout=90,
                            capture_output=True, text=True)
    assert second.returncode == 0, second.stderr
    assert f"resumed from {run_dir}/checkpoints/step_{saved:07d} at step {saved}" in second.stderr
    assert f"training done at step {saved + 3}" in second.stderr


@pytest.mark.slow
def test_torchrun_trains_the_demo_on_two_processes(demo_data, tmp_path):
    from conftest import train_overrides

    run_dir = tmp_path / "run"
    overrides = [o for o in train_overrides(demo_data, run_dir) if not o.startswith("run.dir=")]
    env = {**{k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "MASTER_"))},
           "PYTHON": sys.executable, "NPROC_PER_NODE": "2", "RUN_DIR": str(run_dir),
           "CONFIG": "configs/train/demo.yaml", "EXTRA_ARGS": " ".join(overrides)}
    proc = subprocess.run(["bash", str(LAUNCHERS / "torchrun.sh")], env=env, timeout=600,
                          capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "TP=1 DP=2" in proc.stderr
    assert (run_dir / "checkpoints" / "latest").read_text().strip() == "step_0000006"


FAKE_PYTHON = """#!/bin/bash
echo "$*" >> "$CALLS"
if [ "$1" = - ]; then  # setup_env.sh's check of the installed requirements (program on stdin)
    cat > /dev/null
    exit "$CHECK_EXIT"
fi
"""


def pyproject_digest() -> str:
    """What setup_env.sh stamps a venv with: the sha256 of pyproject.toml and the image's pins."""
    parts = ("pyproject.toml", "docker/requirements.txt", "docker/requirements-torch.txt")
    return hashlib.sha256(b"".join((REPO / part).read_bytes() for part in parts)).hexdigest()


def test_setup_env_installs_only_what_is_missing(tmp_path):
    """pip runs when pyproject.toml or the image's pins changed since the last install or a
    requirement of the extra is missing, and not otherwise: a second `setup_env.sh` must not reinstall the editable package
    under the processes running from the venv (the README check's demo runs it mid-suite)."""
    venv, calls = tmp_path / "venv", tmp_path / "calls.log"
    (venv / "bin").mkdir(parents=True)
    (venv / "bin" / "python").write_text(FAKE_PYTHON)
    (venv / "bin" / "python").chmod(0o755)

    def setup(check_exit: int) -> list[str]:
        calls.write_text("")
        proc = run("setup_env.sh", {"VENV": str(venv), "CALLS": str(calls), "CHECK_EXIT": str(check_exit)},
                   timeout=60)
        assert proc.returncode == 0, proc.stderr
        return [line for line in calls.read_text().splitlines() if line.startswith("-m pip install")]

    upgrade, install = setup(check_exit=0)  # no stamp yet: pip upgrades itself, then installs
    for pins in ("requirements.txt", "requirements-torch.txt"):  # at the image's versions
        assert f"--constraint {REPO / 'docker' / pins}" in install, install
    assert (venv / ".mimir-pyproject.sha256").read_text().strip() == pyproject_digest()
    assert setup(check_exit=0) == []  # the same pyproject.toml, everything installed
    assert len(setup(check_exit=1)) == 2  # a requirement of the extra missing
    (venv / ".mimir-pyproject.sha256").write_text("0" * 64 + "\n")
    assert len(setup(check_exit=0)) == 2  # pyproject.toml changed since


def test_setup_env_finds_this_venv_complete():
    """The requirement check itself, on the venv running these tests (set up by tests/run.sh)."""
    stamp = Path(sys.prefix) / ".mimir-pyproject.sha256"
    if not stamp.is_file() or stamp.read_text().strip() != pyproject_digest():  # it would reinstall: not here
        pytest.skip("this venv was not set up by launchers/setup_env.sh for this pyproject.toml "
                    "(run the tests with tests/run.sh)")
    proc = run("setup_env.sh", {"VENV": sys.prefix}, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "setup_env: mimir-megatron[test] is installed" in proc.stdout, proc.stdout + proc.stderr


def test_prepare_array_submits_its_parts_then_the_merge_and_each_job_runs_its_part():
    clean = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "MASTER_"))}
    args = ["-i", "raw/a.jsonl", "-t", "tok", "-o", "prepared/a"]

    def launch(**env: str) -> list[str]:
        proc = subprocess.run(["bash", str(LAUNCHERS / "prepare_array.sh"), *args], env={**clean, **env}, cwd=REPO,
                              capture_output=True, text=True, timeout=60)
        assert proc.returncode == 0, proc.stderr
        return proc.stdout.splitlines()

    script = str(LAUNCHERS / "prepare_array.sh")
    submit = launch(DRY_RUN="1", PARTS="3", SBATCH_ARGS="--partition=cpu")  # what it prints
    assert submit[0] == f"sbatch --parsable --array=0-2 --partition=cpu {script} {' '.join(args)}"
    assert submit[1].startswith("sbatch --parsable --dependency=afterok:ARRAY_JOB_ID "
                                "--export=ALL,MIMIR_PREPARE_MERGE=1 --partition=cpu ")
    job = {"SLURM_JOB_ID": "7", "SLURM_SUBMIT_DIR": str(REPO), "SLURM_CPUS_PER_TASK": "4", "PYTHON": "echo"}
    part = launch(**job, SLURM_ARRAY_TASK_ID="1", SLURM_ARRAY_TASK_COUNT="3")
    assert part == [f"-m mimir_megatron.cli prepare --part 1/3 --workers 4 --no-progress {' '.join(args)}"]
    merge = launch(**job, MIMIR_PREPARE_MERGE="1")
    assert merge == [f"-m mimir_megatron.cli prepare --merge --workers 4 --no-progress {' '.join(args)}"]


def test_prepare_array_submits_the_merge_only_after_every_part_succeeded(tmp_path):
    """What is submitted, not what a dry run prints: a stand-in ``sbatch`` on PATH records each
    call's arguments and answers as sbatch --parsable does (``ID;CLUSTER`` on a federation). The
    merge depends on the array with ``afterok`` (``afterany`` would merge the shards of a failed
    part's predecessors into a manifest) on the job id alone."""
    bin_dir, calls = tmp_path / "bin", tmp_path / "calls"
    bin_dir.mkdir()
    (bin_dir / "sbatch").write_text(
        "#!/usr/bin/env bash\n"
        f"printf '%s\\0' \"$@\" >> {calls}\n"
        f"printf '\\n' >> {calls}\n"
        f"if [ ! -e {calls}.answered ]; then touch {calls}.answered; echo '4711;cluster'; else echo 4712; fi\n")
    (bin_dir / "sbatch").chmod(0o755)
    clean = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "MASTER_", "DRY_RUN"))}
    args = ["-i", "raw/a b.jsonl", "-t", "tok", "-o", "prepared/a"]
    script = str(LAUNCHERS / "prepare_array.sh")
    proc = subprocess.run(["bash", script, *args], cwd=REPO, capture_output=True, text=True, timeout=60,
                          env={**clean, "PATH": f"{bin_dir}:{clean['PATH']}", "PARTS": "3",
                               "SBATCH_ARGS": "--partition=cpu --time=1:00:00"})
    assert proc.returncode == 0, proc.stderr
    submitted = [line.split("\0")[:-1] for line in calls.read_text().split("\n") if line]
    assert submitted == [
        ["--parsable", "--array=0-2", "--partition=cpu", "--time=1:00:00", script, *args],
        ["--parsable", "--dependency=afterok:4711", "--export=ALL,MIMIR_PREPARE_MERGE=1", "--partition=cpu",
         "--time=1:00:00", script, *args]]
    assert proc.stdout == "submitted parts: job 4711;cluster (array 0-2), merge: job 4712\n"


# -- serve.sh: `mimir serve` behind an API key -------------------------------------------------------


def test_serve_makes_a_private_key_and_passes_it_by_file_never_on_the_command_line(tmp_path):
    config = tmp_path / "config"
    proc = run("serve.sh", {"DRY_RUN": "1", "MIMIR_REPO": str(REPO), "XDG_CONFIG_HOME": str(config),
                            "PYTHON": sys.executable})
    assert proc.returncode == 0, proc.stderr
    key_file = config / "mimir" / "api-key"
    key = key_file.read_text().strip()
    assert len(key) >= 40 and oct(key_file.stat().st_mode & 0o777) == "0o600"
    assert proc.stderr.splitlines()[-1] == (
        f"serve.sh: {sys.executable} -m mimir_megatron.cli serve --host 127.0.0.1 --api-key-file {key_file}")
    assert key not in proc.stderr

    # The container: the key file is mounted read-only; container.sh passes MIMIR_API_KEY by name.
    proc = run("serve.sh", {"DRY_RUN": "1", "MIMIR_REPO": str(REPO), "MIMIR_API_KEY_FILE": str(key_file),
                            "DOCKER_IMAGE": "mimir-megatron:test", "HOST": "0.0.0.0"})
    assert proc.returncode == 0 and proc.stderr.splitlines()[-1] == (
        f"serve.sh: bash {REPO}/launchers/container.sh serve --host 0.0.0.0 --api-key-file {key_file}")
    proc = run("container.sh", {"DRY_RUN": "1", "MIMIR_REPO": str(REPO), "DOCKER_IMAGE": "mimir-megatron:test",
                                "DOCKER": "/bin/true", "DOCKER_GPUS": "none", "MIMIR_API_KEY": key,
                                "DOCKER_MOUNTS": f"{REPO},{key_file}:{key_file}:ro"})
    assert proc.returncode == 0, proc.stderr
    assert "--env=MIMIR_API_KEY " in proc.stdout and f"--volume={key_file}:{key_file}:ro" in proc.stdout
    assert key not in proc.stdout + proc.stderr


def test_serve_running_shows_no_key_in_ps(tmp_path):
    """The recipe for real (its python a stand-in that waits): `ps` lists the key file's path, not
    the key, to everyone, the second Unix user included."""
    key_file = tmp_path / "api-key"
    key_file.write_text("sk-launcher-test-5e0b6c1d2a3f47e8\n")
    key_file.chmod(0o600)
    python = tmp_path / "python"
    python.write_text("#!/bin/bash\nsleep 60\n")
    python.chmod(0o755)
    clean = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "MASTER_"))}
    server = subprocess.Popen(["bash", str(LAUNCHERS / "serve.sh"), "--checkpoint", "runs/x"], cwd=REPO,
                              env={**clean, "PYTHON": str(python), "MIMIR_API_KEY_FILE": str(key_file)},
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        def serving() -> str:
            line = Path(f"/proc/{server.pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
            return line if "mimir_megatron.cli serve" in line else ""

        deadline = time.monotonic() + 30
        while not serving() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert f"--api-key-file {key_file}" in serving()
        listed = subprocess.run(["ps", "-eww", "-o", "args"], capture_output=True, text=True, check=True).stdout
        assert str(key_file) in listed and "sk-launcher-test" not in listed
        from other_user import run_as_other

        as_other = run_as_other(["ps", "-eww", "-o", "args"])
        assert str(key_file) in as_other.stdout and "sk-launcher-test" not in as_other.stdout
    finally:
        server.kill()
        server.wait(30)
