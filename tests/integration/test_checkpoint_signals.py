"""The job's signals reach every process of the job, checkpointing's helpers included.

Slurm delivers a pre-emption or cancel signal to every process of the job step: the ranks, and
the helper processes a save started (megatron's write-results Manager, Python's resource
tracker, an async save's forked writer). Here real signals go to a trainer's whole process
group, as Slurm sends them, after a periodic checkpoint (so the helpers exist), with a second
signal while the pre-emption save is being written: the helpers survive, the save succeeds, and
the run resumes to the losses of an uninterrupted one (system tier). Unit tests check the helpers
themselves, and that a hung peer ends a collective after `train.collective_timeout_s`.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
from conftest import REPO, train_overrides

from mimir_megatron.stop_signals import shield_children
from mimir_megatron.train.config import load_train_config
from mimir_megatron.train.loop import train
from mimir_megatron.checkpoint.signal_safe import write_results_queue

DEMO = REPO / "configs" / "train" / "demo.yaml"
WORKER = Path(__file__).resolve().parents[1] / "workers" / "held_save_worker.py"
EXTRA = ("train.steps=12", "checkpoint.interval=2", "train.log_interval=1")
JOB_SIGNALS = (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT)


def wait_until(condition, timeout: float, what: str, proc=None, log: Path | None = None) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        alive = proc is None or proc.poll() is None
        if not alive or time.monotonic() > deadline:
            tail = log.read_text(errors="replace")[-4000:] if log else ""
            raise AssertionError(f"{what}: {'not after' if alive else 'process ended before'} "
                                 f"{timeout} s\n{tail}")
        time.sleep(0.1)


def spawned_helpers(pid: int) -> list[int]:
    """The trainer's long-lived helpers (the Manager, the resource tracker), which run their own
    command line. A forked per-save async writer shares the trainer's and ends once its save is
    written (it may be a zombie when listed, or exiting: then its command line reads empty, as
    the kernel has released its memory): its survival shows as the save completing."""
    trainer = psutil.Process(pid)
    helpers = []
    for child in trainer.children(recursive=True):
        try:
            cmdline = child.cmdline()
            if cmdline and cmdline != trainer.cmdline() and child.status() != psutil.STATUS_ZOMBIE:
                helpers.append(child.pid)
        except psutil.Error:  # ended or a zombie: not a long-lived helper
            pass
    return helpers


def alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


# -- the helpers themselves ------------------------------------------------------------------------


def test_the_write_results_manager_ignores_the_job_signals_and_is_restarted_when_dead():
    queue = write_results_queue()
    from mimir_megatron.checkpoint import signal_safe as signal_safe_helpers

    pid = signal_safe_helpers._manager._process.pid
    for sig in JOB_SIGNALS:
        os.kill(pid, sig)
    queue.put("after the signals")  # a round trip through the Manager: it is serving
    assert queue.get(timeout=30) == "after the signals" and alive(pid)
    assert write_results_queue() is queue  # alive: reused, not restarted
    from megatron.core.dist_checkpointing.strategies import filesystem_async

    # A synchronous save uses a queue in this process; the next asynchronous one the Manager's.
    assert write_results_queue(cross_process=False) is filesystem_async._results_queue is not queue
    assert write_results_queue() is filesystem_async._results_queue is queue

    os.kill(pid, signal.SIGKILL)  # the OOM killer, say
    # Joined, not polled with psutil: a killed multi-threaded process shows as a zombie while
    # its other threads still exit, and only then can it be reaped.
    signal_safe_helpers._manager._process.join(30)
    assert signal_safe_helpers._manager._process.exitcode == -signal.SIGKILL, "the Manager did not die of SIGKILL"
    again = write_results_queue()
    assert signal_safe_helpers._manager._process.pid != pid
    again.put("restarted")
    assert again.get(timeout=30) == "restarted"


def test_a_child_started_shielded_does_not_die_of_the_job_signals():
    """What megatron's forked async writer gets: the stop signals blocked from its start."""
    code = "import time; time.sleep(60)"
    with shield_children():
        shielded = subprocess.Popen([sys.executable, "-c", code])
    plain = subprocess.Popen([sys.executable, "-c", code])
    try:
        for proc in (shielded, plain):
            os.kill(proc.pid, signal.SIGUSR1)
        assert plain.wait(timeout=30) == -signal.SIGUSR1  # the default action: death
        for sig in JOB_SIGNALS:
            os.kill(shielded.pid, sig)
        time.sleep(0.5)  # a delivered signal would have ended it by now
        assert shielded.poll() is None
    finally:
        shielded.kill()
        shielded.wait()
    # This process's own mask is back: a signal reaches it again.
    assert not set(JOB_SIGNALS) & signal.pthread_sigmask(signal.SIG_BLOCK, [])


# -- a trainer signalled as Slurm does it ----------------------------------------------------------


@pytest.fixture(scope="module")
def uninterrupted(demo_data, tmp_path_factory) -> list[float]:
    cfg = load_train_config(DEMO, train_overrides(demo_data, tmp_path_factory.mktemp("ref"), *EXTRA))
    return train(cfg).losses


@pytest.mark.system
@pytest.mark.slow
@pytest.mark.parametrize("save, first, second", [
    ("sync", signal.SIGUSR1, signal.SIGTERM),
    ("async", signal.SIGTERM, signal.SIGUSR1),
], ids=["sync-usr1-then-term", "async-term-then-usr1"])
def test_a_preemption_after_a_periodic_checkpoint_survives_signals_to_every_process(
        demo_data, tmp_path, uninterrupted, save, first, second):
    run_dir, log_path = tmp_path / "run", tmp_path / "train.log"
    hold, writing = tmp_path / "hold", tmp_path / "writing"
    async_save = f"checkpoint.async_save={str(save == 'async').lower()}"
    cmd = [sys.executable, str(WORKER), str(hold), str(writing), "train", "--config", str(DEMO),
           *train_overrides(demo_data, run_dir, *EXTRA, async_save)]
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        wait_until(lambda: "checkpoint saved: " in log_path.read_text(), 300,
                   "no periodic checkpoint", proc, log_path)
        helpers = spawned_helpers(proc.pid)
        if save == "sync":  # writer threads and their results queue in the trainer: nothing to kill
            assert helpers == [], "a synchronous save started helper processes"
        else:
            assert helpers, "the first save started no helper process"  # else this test proves nothing
        # From now on every save waits: the trainer cannot run far past the signal, and the
        # second signal lands while a save is being written.
        hold.touch()
        os.killpg(proc.pid, first)  # every process of the group, as Slurm signals a job step
        wait_until(lambda: f"received {signal.Signals(first).name}" in log_path.read_text(), 60,
                   "the first signal was not received", proc, log_path)
        wait_until(writing.exists, 120, "no save is being written", proc, log_path)
        os.killpg(proc.pid, second)  # again, while the save is being written
        wait_until(lambda: f"received {signal.Signals(second).name}" in log_path.read_text(), 60,
                   "the second signal was not received", proc, log_path)
        dead = [pid for pid in helpers if not alive(pid)]
        hold.unlink()
        assert proc.wait(timeout=120) == 0, log_path.read_text()[-4000:]
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    text = log_path.read_text()
    assert dead == [], f"helper processes {dead} died of the signals:\n{text[-4000:]}"
    saved = int(re.search(r"pre-empted: checkpoint saved at step (\d+)", text).group(1))
    assert 2 < saved < 12 and "has died" not in text, text[-4000:]
    assert (run_dir / "checkpoints" / "latest").read_text().strip() == f"step_{saved:07d}"
    resumed = train(load_train_config(DEMO, train_overrides(demo_data, run_dir, *EXTRA, async_save)))
    assert resumed.losses == uninterrupted[saved:]


# -- a hung peer ends the job ----------------------------------------------------------------------


def test_a_hung_peer_ends_the_collective_after_the_configured_timeout(tmp_path):
    from distributed import WORKERS, free_port

    port = free_port()
    procs = [subprocess.Popen(
        [sys.executable, str(WORKERS / "hung_peer_worker.py"), str(DEMO), "5"],
        env={**os.environ, "RANK": str(rank), "WORLD_SIZE": "2", "LOCAL_RANK": str(rank),
             "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "OMP_NUM_THREADS": "1"},
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for rank in (0, 1)]
    try:
        out, _ = procs[0].communicate(timeout=300)  # the default (1800 s) would run past this
        assert procs[0].returncode == 3, out[-3000:]
        assert "collective failed after" in out
        assert procs[1].poll() is None  # the peer hung; it did not fail first
    finally:
        for proc in procs:
            proc.kill()
            proc.wait()


class _Stop(Exception):
    pass


def test_the_trainer_passes_the_collective_timeout(demo_data, tmp_path, monkeypatch):
    from mimir_megatron import parallel
    from mimir_megatron.errors import ConfigError

    seen = []

    def init_distributed(timeout_s):
        seen.append(timeout_s)
        raise _Stop  # nothing else to see

    monkeypatch.setattr(parallel, "init_distributed", init_distributed)
    cfg = load_train_config(DEMO, train_overrides(demo_data, tmp_path, "train.collective_timeout_s=42"))
    with pytest.raises(_Stop):
        train(cfg)
    assert seen == [42]
    with pytest.raises(ConfigError, match="train.collective_timeout_s must be >= 1, got 0"):
        load_train_config(DEMO, train_overrides(demo_data, tmp_path, "train.collective_timeout_s=0"))
