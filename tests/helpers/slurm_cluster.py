"""A real Slurm for the tests: munged, slurmctld and slurmd from Debian's packages, on one node
or on N simulated nodes.

Everything lives in one private directory: a generated ``slurm.conf`` (``SLURM_CONF`` points
at it), its own munge key and socket, spool, state and logs, so it neither needs nor touches a
system Slurm or munge. Needs root (slurmd launches jobs, munged runs as the ``munge`` user).
``missing(nodes)`` says why a cluster cannot start here, or None.

    cluster = SlurmCluster.start()              # one node: this host, on 127.0.0.1
    cluster = SlurmCluster.start(nodes=2)       # node1, node2: one network namespace each
    job = cluster.sbatch(["--wrap", "hostname"])
    info = cluster.wait(job, timeout=60)        # scontrol's fields once the job is finished
    cluster.stop()                              # also after a failure: leaves nothing behind

N nodes on one machine: one network namespace per node, joined by a bridge that lives in a
namespace of its own, with addresses from a made-up private range (:data:`SUBNET`) that exist
only inside those namespaces. A node's processes run under ``nsenter --net=<its namespace>
unshare --uts --mount`` with its own hostname and a bind-mounted ``/etc/hosts`` naming the
nodes (``ip netns exec`` would remount ``/sys``, hiding the cgroup tree slurmd needs). One
``slurmd -N nodeX`` per node, slurmctld and every client command in node1, one munged for all
(its socket is a file). The nodes share this machine's kernel, CPUs and file system: the run
directory is the same path everywhere, as on a cluster with a shared file system.
:meth:`SlurmCluster.crash` takes a node's link down and kills everything in it;
:meth:`SlurmCluster.revive` brings it back.

Requeued jobs wait ``cred_expire`` seconds before they may start again (Slurm's default is
120 s); the generated config sets the minimum so that requeue tests stay short. A crashed node
is declared DOWN once slurmctld's pings to it have failed for ``SlurmdTimeout``; each ping waits
``MessageTimeout`` (default 10 s) for the lost node, so 5 s shortens the time from a crash to the
requeue (~30 s -> ~19 s in test_slurm's node-crash test); loopback messages take milliseconds.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from mimir_megatron.ports import free_port

BINARIES = ("munged", "mungekey", "slurmctld", "slurmd", "sbatch", "scontrol", "squeue",
            "sinfo", "scancel", "srun", "runuser")
NETNS_BINARIES = ("ip", "nsenter", "unshare", "mount", "hostname")
FINISHED = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY",
            "BOOT_FAIL", "DEADLINE", "PREEMPTED"}
CRED_EXPIRE_S = 5  # requeued jobs become eligible this long after they are requeued
SUBNET = "10.213.7"  # made up: assigned only to interfaces inside the nodes' namespaces
NETNS_PREFIX = "mimir-slurm-"  # + <pid of the test process>-<n>: stale ones are found by pid
# In a node: its hostname, the nodes' /etc/hosts and an empty resolv.conf (no DNS to wait for).
_ENTER_NODE = ('hostname "$1" && mount --bind "$2" /etc/hosts && mount --bind "$3" /etc/resolv.conf'
               ' && shift 3 && exec "$@"')


def _which(name: str) -> str | None:
    return shutil.which(name) or next(
        (str(p) for d in ("/usr/sbin", "/sbin") if (p := Path(d) / name).exists()), None
    )


def missing(nodes: int = 1) -> str | None:
    """Why a cluster of ``nodes`` nodes cannot be started here (None when it can)."""
    absent = [b for b in BINARIES if _which(b) is None]
    if absent:
        return (
            f"Slurm/munge binaries missing ({', '.join(absent)}): apt-get install -y "
            "--no-install-recommends slurmctld slurmd slurm-client munge"
        )
    if os.geteuid() != 0:
        return "the test Slurm needs root (slurmd launches jobs, munged runs as munge)"
    if nodes > 1:
        absent = [b for b in NETNS_BINARIES if _which(b) is None]
        if absent:
            return (f"the {nodes}-node Slurm needs iproute2 and util-linux ({', '.join(absent)} "
                    "missing): apt-get install -y --no-install-recommends iproute2 util-linux")
        probe = subprocess.run([_which("unshare"), "--net", "--uts", "--mount", "true"],
                               capture_output=True, text=True, timeout=30)
        if probe.returncode != 0:
            return (f"the {nodes}-node Slurm cannot create namespaces here (unshare: "
                    f"{probe.stderr.strip()}); it needs CAP_SYS_ADMIN and CAP_NET_ADMIN")
    return None


def _two_free_ports() -> tuple[int, int]:
    """slurmctld's and slurmd's ports on this host: each free, and not the same one (each pick is
    random below the ephemeral range, so two picks may meet)."""
    first = free_port()
    second = free_port()
    while second == first:
        second = free_port()
    return first, second


def parse_scontrol(text: str) -> dict[str, str]:
    """``scontrol show job`` output -> {field: value} (values may contain spaces only in a few
    fields such as Command; those are not needed here)."""
    fields: dict[str, str] = {}
    for token in text.split():
        key, sep, value = token.partition("=")
        if sep:
            fields[key] = value
    return fields


@dataclass
class Node:
    name: str
    addr: str
    netns: str | None = None  # None: this host itself (the one-node cluster)
    port: str | None = None  # its end of the link, in the switch namespace


class SlurmCluster:
    def __init__(self, root: Path, nodes: int = 1) -> None:
        self.root = root
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
        if nodes == 1:
            self.nodes = [Node(socket.gethostname().split(".")[0], "127.0.0.1")]
            self.switch = None
        else:
            tag = f"{NETNS_PREFIX}{os.getpid()}-{root.name[-6:]}"
            self.nodes = [Node(f"node{i}", f"{SUBNET}.{i}", f"{tag}-n{i}", f"port{i}")
                          for i in range(1, nodes + 1)]
            self.switch = f"{tag}-sw"
        self.host = self.nodes[0].name  # slurmctld's node; job scripts run on it

    # ---------------------------------------------------------------- lifecycle
    @classmethod
    def start(cls, root: Path | None = None, nodes: int = 1) -> SlurmCluster:
        root = root or Path(tempfile.mkdtemp(prefix="mimir-slurm-"))
        root.chmod(0o755)  # munged (as munge) must traverse it
        if nodes > 1:
            remove_stale_namespaces()
        cluster = cls(root, nodes)
        try:
            cluster._start_munge()
            if cluster.switch:
                cluster._make_network()
            cluster._write_conf()
            cluster._run(cluster._on(cluster.nodes[0], [_which("slurmctld")]))
            for node in cluster.nodes:
                cluster._start_slurmd(node)
            cluster._wait_idle(timeout=60)
        except BaseException:
            cluster.stop()
            raise
        return cluster

    def stop(self) -> None:
        """End every job, the daemons and munged, delete the namespaces and the directory (kept
        when MIMIR_KEEP_SLURM is set, for the daemons' logs); never raises."""
        if self.conf.exists():
            self._end_jobs()
            try:
                subprocess.run(self._on(self.nodes[0], ["scontrol", "shutdown"]), env=self.env,
                               capture_output=True, timeout=30)
            except (OSError, subprocess.SubprocessError):
                pass  # the pid files and namespaces below end whatever is left
            for pid_file in [self.root / "slurmctld.pid",
                             *(self._slurmd_pid_file(n) for n in self.nodes)]:
                self._wait_pid_gone(pid_file, timeout=15)
        if self.switch:
            for node in self.nodes:
                _kill_namespace(node.netns)
            _delete_namespace(self.switch)
        if self.munge_pid.exists():
            self._kill_pid_file(self.munge_pid)
        if not os.environ.get("MIMIR_KEEP_SLURM"):
            shutil.rmtree(self.root, ignore_errors=True)

    def _end_jobs(self) -> None:
        """Kill the processes of every job still there (a failed test's): slurmstepd and its
        tasks outlive `scontrol shutdown` otherwise."""
        try:
            jobs = subprocess.run(self._on(self.nodes[0], ["squeue", "-h", "-o", "%i"]),
                                  env=self.env, capture_output=True, text=True, timeout=30)
            ids = jobs.stdout.split()
            if not ids:
                return
            for args in (["--full", "--signal=KILL"], []):
                subprocess.run(self._on(self.nodes[0], ["scancel", *args, *ids]), env=self.env,
                               capture_output=True, timeout=30)
            deadline = time.monotonic() + 20
            while time.monotonic() < deadline and subprocess.run(
                    self._on(self.nodes[0], ["squeue", "-h", "-t", "R,CG", "-o", "%i"]),
                    env=self.env, capture_output=True, text=True, timeout=30).stdout.strip():
                time.sleep(0.2)
        except (OSError, subprocess.SubprocessError):
            pass

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

    def _make_network(self) -> None:
        """Namespaces for the switch and each node; a veth pair from each node to the bridge."""
        ip = _which("ip")
        etc = self.root / "etc"
        etc.mkdir()
        lines = ["127.0.0.1 localhost", *(f"{n.addr} {n.name}" for n in self.nodes)]
        (etc / "hosts").write_text("\n".join(lines) + "\n")
        (etc / "resolv.conf").write_text("")
        self._run([ip, "netns", "add", self.switch])
        self._run([ip, "-n", self.switch, "link", "add", "br0", "type", "bridge"])
        self._run([ip, "-n", self.switch, "link", "set", "br0", "up"])
        for node in self.nodes:
            self._run([ip, "netns", "add", node.netns])
            self._run([ip, "-n", self.switch, "link", "add", node.port, "type", "veth", "peer",
                       "name", "eth0", "netns", node.netns])
            self._run([ip, "-n", self.switch, "link", "set", node.port, "master", "br0", "up"])
            self._run([ip, "-n", node.netns, "addr", "add", f"{node.addr}/24", "dev", "eth0"])
            for dev in ("lo", "eth0"):
                self._run([ip, "-n", node.netns, "link", "set", dev, "up"])

    def _write_conf(self) -> None:
        for sub in ("spool", "state", "log"):
            (self.root / sub).mkdir()
        for node in self.nodes:
            (self.root / "spool" / node.name).mkdir()
        probe = subprocess.run([_which("slurmd"), "-C"], capture_output=True, text=True,
                               timeout=30, check=True).stdout
        hardware = parse_scontrol(probe.splitlines()[0])
        self.cpus = int(hardware["CPUs"])
        memory = hardware.get("RealMemory", "1000")
        auth = f"socket={self.munge_socket},cred_expire={CRED_EXPIRE_S}"
        # In namespaces every node has its own ports; on this host, take free ones.
        ports = (6817, 6818) if self.switch else _two_free_ports()
        r, first = self.root, self.nodes[0]
        node_lines = "\n".join(
            f"NodeName={n.name} NodeAddr={n.addr} CPUs={self.cpus} RealMemory={memory} "
            "State=UNKNOWN" for n in self.nodes)
        self.conf.write_text(f"""\
# Generated by tests/slurm_cluster.py: a private {len(self.nodes)}-node Slurm.
ClusterName=mimirtest
SlurmctldHost={first.name}({first.addr})
SlurmctldPort={ports[0]}
SlurmdPort={ports[1]}
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
SlurmdTimeout=10
MessageTimeout=5
EnforcePartLimits=ALL
MailProg=/bin/true
MinJobAge=600
KillWait=30
SlurmctldPidFile={r / 'slurmctld.pid'}
SlurmdPidFile={r / 'slurmd-%n.pid'}
SlurmdSpoolDir={r / 'spool' / '%n'}
StateSaveLocation={r / 'state'}
SlurmctldLogFile={r / 'log' / 'slurmctld.log'}
SlurmdLogFile={r / 'log' / 'slurmd-%n.log'}
{node_lines}
PartitionName=debug Nodes={','.join(n.name for n in self.nodes)} Default=YES MaxTime=INFINITE State=UP
""")

    def _start_slurmd(self, node: Node) -> None:
        self._run(self._on(node, [_which("slurmd"), "-N", node.name]))

    def _slurmd_pid_file(self, node: Node) -> Path:
        return self.root / f"slurmd-{node.name}.pid"

    def node_states(self) -> dict[str, str]:
        proc = subprocess.run(self._on(self.nodes[0], ["sinfo", "-h", "-N", "-o", "%N %T"]),
                              env=self.env, capture_output=True, text=True, timeout=30)
        return dict(line.split() for line in proc.stdout.splitlines() if line.strip())

    def _wait_idle(self, timeout: float, nodes: list[Node] | None = None) -> None:
        names = [n.name for n in nodes or self.nodes]
        deadline = time.monotonic() + timeout
        states: dict[str, str] = {}
        while time.monotonic() < deadline:
            states = self.node_states()
            if all(states.get(name) in ("idle", "mixed", "allocated")  # "*": not responding
                   for name in names) and (nodes or set(states.values()) == {"idle"}):
                return
            time.sleep(0.2)
        raise RuntimeError(f"nodes not idle after {timeout} s (sinfo: {states!r})\n{self._logs()}")

    # ---------------------------------------------------------------- node failures
    def crash(self, name: str) -> None:
        """The node's link goes down and every process in it is killed (SIGKILL), as when a
        machine loses power: its slurmd, its job steps and their helpers."""
        node = self._node(name)
        assert self.switch, "crash() needs the namespaced cluster (nodes > 1)"
        self._run([_which("ip"), "-n", self.switch, "link", "set", node.port, "down"])
        _kill_namespace(node.netns, delete=False)

    def revive(self, name: str, timeout: float = 60) -> None:
        """Link up and slurmd started again; returns once slurmctld has it back in service."""
        node = self._node(name)
        self._run([_which("ip"), "-n", self.switch, "link", "set", node.port, "up"])
        self._start_slurmd(node)
        self._wait_idle(timeout, nodes=[node])

    def _node(self, name: str) -> Node:
        return next(n for n in self.nodes if n.name == name)

    # ---------------------------------------------------------------- jobs
    def sbatch(self, args: list[str], env: dict[str, str] | None = None,
               cwd: Path | None = None) -> str:
        """Submit (from the first node); returns the job id. ``env`` is added to the cluster's
        environment."""
        proc = subprocess.run(self._on(self.nodes[0], ["sbatch", "--parsable", *args]),
                              env={**self.env, **(env or {})}, cwd=cwd, capture_output=True,
                              text=True, timeout=30)
        if proc.returncode != 0:
            raise RuntimeError(f"sbatch {args} failed ({proc.returncode}): {proc.stderr}")
        return proc.stdout.strip().split(";")[0]

    def job(self, job_id: str) -> dict[str, str]:
        proc = subprocess.run(self._on(self.nodes[0], ["scontrol", "show", "job", "-o", job_id]),
                              env=self.env, capture_output=True, text=True, timeout=30)
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
        subprocess.run(self._on(self.nodes[0], ["scancel", *args]), env=self.env, check=True,
                       capture_output=True, timeout=30)

    # ---------------------------------------------------------------- helpers
    def _on(self, node: Node, cmd: list) -> list[str]:
        """``cmd`` as run on ``node``: inside its namespaces, or as is on this host."""
        cmd = [str(c) for c in cmd]
        if node.netns is None:
            return cmd
        etc = self.root / "etc"
        return [_which("nsenter"), f"--net=/run/netns/{node.netns}", _which("unshare"), "--uts",
                "--mount", "--propagation", "private", "sh", "-c", _ENTER_NODE, "sh", node.name,
                str(etc / "hosts"), str(etc / "resolv.conf"), *cmd]

    def _run(self, cmd: list) -> None:
        proc = subprocess.run([str(c) for c in cmd], env=self.env, capture_output=True,
                              text=True, timeout=60)
        if proc.returncode != 0:
            raise RuntimeError(
                f"{' '.join(map(str, cmd))} failed ({proc.returncode}): {proc.stderr}\n"
                f"{self._logs()}"
            )

    def _logs(self, chars: int = 3000) -> str:
        out = []
        paths = [self.logs / "slurmctld.log", *sorted(self.logs.glob("slurmd*.log")),
                 self.munge_dir / "private" / "munged.log"]
        for path in paths:
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


def namespace_pids(netns: str) -> list[int]:
    """Every process in network namespace ``netns`` (empty when it does not exist)."""
    try:
        proc = subprocess.run([_which("ip") or "ip", "netns", "pids", netns], capture_output=True,
                              text=True, timeout=30)
    except (OSError, subprocess.SubprocessError):
        return []
    return [int(p) for p in proc.stdout.split() if p.isdigit() and int(p) != os.getpid()]


def _kill_namespace(netns: str, delete: bool = True) -> None:
    """SIGKILL everything in ``netns`` until nothing is left, then delete it; never raises."""
    deadline = time.monotonic() + 30
    while (pids := namespace_pids(netns)) and time.monotonic() < deadline:
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
        time.sleep(0.1)
    if delete:
        _delete_namespace(netns)


def _delete_namespace(netns: str) -> None:
    try:
        subprocess.run([_which("ip") or "ip", "netns", "del", netns], capture_output=True,
                       timeout=30)
    except (OSError, subprocess.SubprocessError):
        pass


def processes_of(cluster: SlurmCluster) -> list[int]:
    """Every process started by ``cluster`` (daemons, job steps, tasks and their helpers): they
    all carry its ``SLURM_CONF`` in their environment."""
    marker = f"SLURM_CONF={cluster.conf}".encode()
    found = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit() or int(proc.name) == os.getpid():
            continue
        try:
            if marker in (proc / "environ").read_bytes().split(b"\0"):
                found.append(int(proc.name))
        except OSError:
            pass  # gone meanwhile, or a process we may not read
    return found


def namespaces() -> list[str]:
    """The test clusters' network namespaces that exist now."""
    try:
        proc = subprocess.run([_which("ip") or "ip", "netns", "list"], capture_output=True,
                              text=True, timeout=30)
    except (OSError, subprocess.SubprocessError):
        return []
    return [line.split()[0] for line in proc.stdout.splitlines()
            if line.startswith(NETNS_PREFIX)]


def remove_stale_namespaces() -> None:
    """Delete namespaces left by a test process that is gone (killed before its tear-down)."""
    for netns in namespaces():
        owner = netns.removeprefix(NETNS_PREFIX).split("-")[0]
        if owner.isdigit() and not Path(f"/proc/{owner}").exists():
            _kill_namespace(netns)


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

