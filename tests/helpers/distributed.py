"""Run a worker script as N gloo ranks on 127.0.0.1 (how TP/DP are tested on CPU)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from polling import hang_limit

from mimir_megatron.ports import free_port

WORKERS = Path(__file__).resolve().parent.parent / "workers"


def run_ranks(worker: str, world_size: int, *args: str, timeout: float = 600) -> None:
    """Start ``tests/workers/<worker>`` once per rank; fail with every rank's output on error
    (``timeout``, scaled by :func:`polling.hang_limit`, only detects a hang)."""
    timeout = hang_limit(timeout)
    port = free_port()
    procs = []
    for rank in range(world_size):
        env = dict(os.environ, RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank),
                   MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS="1")
        procs.append(subprocess.Popen(
            [sys.executable, str(WORKERS / worker), *args], env=env,
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        ))
    outputs, failed = [], False
    for rank, proc in enumerate(procs):
        try:
            out, _ = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            for p in procs:
                p.kill()
            out, failed = f"rank {rank} timed out after {timeout:.0f} s", True
        outputs.append(out)
        failed |= proc.returncode != 0
    if failed:
        joined = "\n".join(f"--- rank {r} ---\n{o[-4000:]}" for r, o in enumerate(outputs))
        raise AssertionError(f"{worker} failed on {world_size} ranks:\n{joined}")
