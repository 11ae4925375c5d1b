"""A real single-node Slurm for the tests: munged, slurmctld and slurmd from Debian's packages.

Everything lives in one private directory: a generated ``slurm.conf`` (``SLURM_CONF`` points
at it), its own munge key and socket, free TCP ports, spool, state and logs, so it neither
needs nor touches a system Slurm or munge. Needs root (slurmd launches jobs, munged runs as
the ``munge`` user). ``missing()`` says why a cluster cannot start here, or None.

    cluster = SlurmCluster.start()
    job = cluster.sbatch(["--wrap", "hostname"])
    info = cluster.wait(job)            # scontrol's fields once the job is finished
    cluster.stop()

Requeued jobs wait ``cred_expire`` seconds before they may start again (Slurm's default is
120 s); the generated config sets the minimum so that requeue tests stay short.
"""

from __future__ import annotations

import os
import re
import shutil
import socket
import subprocess
import tempfile
import time
from pathlib import Path

BINARIES = ("munged", "mungekey", "slurmctld", "slurmd", "sbatch", "scontrol", "squeue",
            "sinfo", "scancel", "srun", "runuser")
FINISHED = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY",
            "BOOT_FAIL", "DEADLINE", "PREEMPTED"}
CRED_EXPIRE_S = 5  # requeued jobs become eligible this long after they are requeued


def _which(name: str) -> str | None:
    return shutil.which(name) or next(
        (str(p) for d in ("/usr/sbin", "/sbin") if (p := Path(d) / name).exists()), None
    )


def missing() -> str | None:
    """Why a cluster cannot be started here (None when it can)."""
    absent = [b for b in BINARIES if _which(b) is None]
    if absent:
        return (
            f"Slurm/munge binaries missing ({', '.join(absent)}): apt-get install -y "
            "--no-install-recommends slurmctld slurmd slurm-client munge"
        )
    if os.geteuid() != 0:
        return "the single-node Slurm needs root (slurmd launches jobs, munged runs as munge)"
    return None


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def parse_scontrol(text: str) -> dict[str, str]:
    """``scontrol show job`` output -> {field: value} (values may contain spaces only in a few
    fields such as Command; those are not needed here)."""
    fields: dict[str, str] = {}
    for token in text.split():
        key, sep, value = token.partition("=")
        if sep:
            fields[key] = value
    return fields


class SlurmCluster:
    def __init__(self, root: Path) -> None:
        self.root = root
        self.host = socket.gethostname().split(".")[0]
        self.conf = root / "slurm.conf"
        self.munge_dir = root / "munge"
        self.munge_socket = self.munge_dir / "munge.socket"
        self.munge_pid = self.munge_dir / "munged.pid"
        self.logs = root / "log"
        self.env = dict(os.environ, SLURM_CONF=str(self.conf))
        for var in list(self.env):  # a test run inside a Slurm job must not leak its job into ours
            if var.startswith(("SLURM_", "SBATCH_", "SRUN_")) and var != "SLURM_CONF":
                del self.env[var]
        self.cpus = 1

    # ---------------------------------------------------------------- lifecycle
    @classmethod
    def start(cls, root: Path | None = None) -> SlurmCluster:
        root = root or Path(tempfile.mkdtemp(prefix="mimir-slurm-"))
        root.chmod(0o755)  # munged (as munge) must traverse it
        cluster = cls(root)
        try:
            cluster._start_munge()
            cluster._write_conf()
            cluster._run([_which("slurmctld")])
            cluster._run([_which("slurmd")])
            cluster._wait_idle(timeout=30)
        except BaseException:
            cluster.stop()
            raise
        return cluster

    def stop(self) -> None:
        """Shut the daemons down (scontrol shutdown), then munged, and remove the directory
        (kept when MIMIR_KEEP_SLURM is set); never raises."""
        if self.conf.exists():
            try:
                subprocess.run(["scontrol", "shutdown"], env=self.env, capture_output=True,
                               timeout=30)
            except (OSError, subprocess.SubprocessError):
                pass  # the pid files below end whatever is left
            for name in ("slurmctld.pid", "slurmd.pid"):
                self._wait_pid_gone(self.root / name, timeout=15)
        if self.munge_pid.exists():
            self._kill_pid_file(self.munge_pid)
        if not os.environ.get("MIMIR_KEEP_SLURM"):  # set it to keep the daemons' logs
            shutil.rmtree(self.root, ignore_errors=True)

    def _start_munge(self) -> None:
        # munged insists: the socket's directory is searchable by all, the key's is private.
        private = self.munge_dir / "private"
        for path, mode in ((self.munge_dir, 0o755), (private, 0o700)):
            path.mkdir()
            path.chmod(mode)
            shutil.chown(path, "munge", "munge")
        key = private / "munge.key"
        as_munge = [_which("runuser"), "-u", "munge", "--"]
        self._run([*as_munge, _which("mungekey"), "--create", f"--keyfile={key}"])
        self._run([
            *as_munge, _which("munged"), f"--socket={self.munge_socket}", f"--key-file={key}",
            f"--pid-file={self.munge_pid}", f"--log-file={private / 'munged.log'}",
            f"--seed-file={private / 'munged.seed'}",
        ])
        deadline = time.monotonic() + 10
        while not self.munge_socket.exists():
            if time.monotonic() > deadline:
                raise RuntimeError(f"munged did not create {self.munge_socket}\n{self._logs()}")
            time.sleep(0.1)

    def _write_conf(self) -> None:
        for sub in ("spool", "state", "log"):
            (self.root / sub).mkdir()
        probe = subprocess.run([_which("slurmd"), "-C"], capture_output=True, text=True,
                               timeout=30, check=True).stdout
        node = parse_scontrol(probe.splitlines()[0])
        self.cpus = int(node["CPUs"])
        memory = node.get("RealMemory", "1000")
        auth = f"socket={self.munge_socket},cred_expire={CRED_EXPIRE_S}"
        r = self.root
        self.conf.write_text(f"""\
# Generated by tests/slurm_cluster.py: a private single-node Slurm.
ClusterName=mimirtest
SlurmctldHost={self.host}(127.0.0.1)
SlurmctldPort={_free_port()}
SlurmdPort={_free_port()}
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
AuthInfo={auth}
MpiDefault=none
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
SchedulerType=sched/backfill
SchedulerParameters=sched_interval=1,bf_interval=1
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
ReturnToService=2
EnforcePartLimits=ALL
MailProg=/bin/true
MinJobAge=600
KillWait=30
SlurmctldPidFile={r / 'slurmctld.pid'}
SlurmdPidFile={r / 'slurmd.pid'}
SlurmdSpoolDir={r / 'spool'}
StateSaveLocation={r / 'state'}
SlurmctldLogFile={r / 'log' / 'slurmctld.log'}
SlurmdLogFile={r / 'log' / 'slurmd.log'}
NodeName={self.host} NodeAddr=127.0.0.1 CPUs={self.cpus} RealMemory={memory} State=UNKNOWN
PartitionName=debug Nodes={self.host} Default=YES MaxTime=INFINITE State=UP
""")

    def _wait_idle(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        state = ""
        while time.monotonic() < deadline:
            proc = subprocess.run(["sinfo", "-h", "-o", "%T"], env=self.env, capture_output=True,
                                  text=True, timeout=10)
            state = proc.stdout.strip()
            if state == "idle":
                return
            time.sleep(0.2)
        raise RuntimeError(f"node not idle after {timeout} s (sinfo: {state!r})\n{self._logs()}")

    # ---------------------------------------------------------------- jobs
    def sbatch(self, args: list[str], env: dict[str, str] | None = None,
               cwd: Path | None = None) -> str:
        """Submit; returns the job id. ``env`` is added to the cluster's environment."""
        proc = subprocess.run(["sbatch", "--parsable", *args], env={**self.env, **(env or {})},
                              cwd=cwd, capture_output=True, text=True, timeout=30)
        if proc.returncode != 0:
            raise RuntimeError(f"sbatch {args} failed ({proc.returncode}): {proc.stderr}")
        return proc.stdout.strip().split(";")[0]

    def job(self, job_id: str) -> dict[str, str]:
        proc = subprocess.run(["scontrol", "show", "job", "-o", job_id], env=self.env,
                              capture_output=True, text=True, timeout=10)
        if proc.returncode != 0:
            raise RuntimeError(f"scontrol show job {job_id}: {proc.stderr.strip()}")
        return parse_scontrol(proc.stdout)

    def wait(self, job_id: str, timeout: float, until=None) -> dict[str, str]:
        """Poll ``scontrol show job`` until ``until(fields)`` (default: a finished state)."""
        until = until or (lambda f: f["JobState"] in FINISHED)
        deadline = time.monotonic() + timeout
        while True:
            fields = self.job(job_id)
            if until(fields):
                return fields
            if time.monotonic() > deadline:
                raise TimeoutError(
                    f"job {job_id} still {fields.get('JobState')} "
                    f"(Reason={fields.get('Reason')}) after {timeout:.0f} s\n{self._logs()}"
                )
            time.sleep(0.5)

    def scancel(self, *args: str) -> None:
        subprocess.run(["scancel", *args], env=self.env, check=True, capture_output=True,
                       timeout=30)

    # ---------------------------------------------------------------- helpers
    def _run(self, cmd: list[str | None]) -> None:
        proc = subprocess.run([str(c) for c in cmd], env=self.env, capture_output=True,
                              text=True, timeout=60)
        if proc.returncode != 0:
            raise RuntimeError(
                f"{' '.join(map(str, cmd))} failed ({proc.returncode}): {proc.stderr}\n"
                f"{self._logs()}"
            )

    def _logs(self, chars: int = 3000) -> str:
        out = []
        for path in (self.logs / "slurmctld.log", self.logs / "slurmd.log",
                     self.munge_dir / "private" / "munged.log"):
            if path.exists():
                out.append(f"--- {path.name}\n{path.read_text(errors='replace')[-chars:]}")
        return "\n".join(out)

    @staticmethod
    def _pid(path: Path) -> int | None:
        try:
            return int(re.sub(r"\D", "", path.read_text()) or 0) or None
        except OSError:
            return None

    def _wait_pid_gone(self, path: Path, timeout: float) -> None:
        pid = self._pid(path)
        deadline = time.monotonic() + timeout
        while pid and Path(f"/proc/{pid}").exists():
            if time.monotonic() > deadline:
                self._kill_pid_file(path)
                return
            time.sleep(0.1)

    def _kill_pid_file(self, path: Path) -> None:
        pid = self._pid(path)
        if not pid:
            return
        for sig in (15, 9):
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                return
            deadline = time.monotonic() + 5
            while Path(f"/proc/{pid}").exists() and time.monotonic() < deadline:
                time.sleep(0.1)


# ---------------------------------------------------------------- a stand-in trainer
# Follows the trainer's launch contract (ranks from torchrun's or Slurm's variables, stop with
# a checkpoint on SIGUSR1/SIGTERM, resume from <run.dir>/checkpoints/latest, the same log
# lines) in a few milliseconds per step, so the launchers' own mechanics can be tested
# without training a model.
FAKE_TRAINER = r'''
import json, os, signal, sys, time
from pathlib import Path

args = sys.argv[1:]
assert args[0] == "train" and args[1] == "--config", args
overrides = dict(a.split("=", 1) for a in args[3:])
run_dir = Path(overrides["run.dir"])
steps = int(overrides.get("train.steps", "20"))
step_s = float(os.environ.get("FAKE_STEP_SECONDS", "0.2"))
env = os.environ
if "RANK" in env:
    rank, world, local = int(env["RANK"]), int(env["WORLD_SIZE"]), int(env["LOCAL_RANK"])
else:
    rank, world, local = int(env["SLURM_PROCID"]), int(env["SLURM_NTASKS"]), int(env["SLURM_LOCALID"])
stop = []
for sig in (signal.SIGUSR1, signal.SIGTERM):
    signal.signal(sig, lambda signum, frame: stop.append(signum))

def log(msg):
    if rank == 0:
        print(f"[rank0] {msg}", file=sys.stderr, flush=True)

run_dir.mkdir(parents=True, exist_ok=True)
record = {k: env.get(k) for k in ("MASTER_ADDR", "MASTER_PORT", "OMP_NUM_THREADS",
                                  "CUDA_DEVICE_MAX_CONNECTIONS", "NCCL_DEBUG")}
record.update(rank=rank, world=world, local_rank=local, argv=args, pid=os.getpid())
(run_dir / f"env-rank{rank}-{env.get('SLURM_RESTART_COUNT', '0')}.json").write_text(json.dumps(record))
ckpts = run_dir / "checkpoints"

def save(step):
    if rank == 0:
        (ckpts / f"step_{step:07d}").mkdir(parents=True, exist_ok=True)
        (ckpts / "latest").write_text(f"step_{step:07d}\n")

step = 0
if (ckpts / "latest").exists():
    name = (ckpts / "latest").read_text().strip()
    step = int(name.split("_")[1])
    log(f"resumed from {ckpts / name} at step {step}")
while step < steps:
    time.sleep(step_s)
    step += 1
    log(f"step {step}/{steps}")
    if stop:
        save(step)
        log(f"pre-empted: checkpoint saved at step {step}")
        sys.exit(0)
save(step)
log(f"training done at step {step}")
'''

FAKE_PYTHON = r'''#!{python}
"""PYTHON for the launchers: `-m mimir_megatron.cli` runs the stand-in trainer instead."""
import os, runpy, sys
TRAINER = {trainer!r}
args = sys.argv[1:]
if args[:2] == ["-m", "mimir_megatron.cli"]:
    sys.argv = [TRAINER, *args[2:]]
    runpy.run_path(TRAINER, run_name="__main__")
elif args[:2] == ["-m", "torch.distributed.run"]:
    i = args.index("mimir_megatron.cli")
    args[i - 1:i + 1] = [TRAINER]
    os.execv(sys.executable, [sys.executable, *args])
else:
    os.execv(sys.executable, [sys.executable, *args])
'''


def write_fake_trainer(directory: Path, python: str) -> Path:
    """Write the stand-in trainer and a PYTHON wrapper for it into ``directory``; returns the
    wrapper (pass it as the launchers' PYTHON)."""
    directory.mkdir(parents=True, exist_ok=True)
    trainer = directory / "fake_trainer.py"
    trainer.write_text(FAKE_TRAINER)
    wrapper = directory / "python"
    wrapper.write_text(FAKE_PYTHON.format(python=python, trainer=str(trainer)))
    wrapper.chmod(0o755)
    return wrapper

