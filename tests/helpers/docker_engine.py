"""A Docker engine for tests/system/test_docker.py: found, or started (and later stopped) here.

`tests/run.sh` installs Debian's `docker.io` and `debootstrap` (as root). No service manager runs
on the CI machine, so when no daemon answers and this process is root, :func:`engine` starts
`dockerd` with its default data root (/var/lib/docker: its layer cache outlives the run, so a
later run rebuilds only what changed) and stops it, by its pid, when the tests are done.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
from pathlib import Path
from typing import Iterator

from polling import wait_for

# Debian's docker.io client has BuildKit built in; docker/build.sh looks for such a client.
CLIENTS = ("docker", "/usr/bin/docker")


def client() -> str | None:
    for candidate in CLIENTS:
        if shutil.which(candidate):
            return shutil.which(candidate)
    return None


def answers(docker: str) -> bool:
    return subprocess.run([docker, "info"], capture_output=True, timeout=60).returncode == 0


@contextlib.contextmanager
def engine(log_dir: Path) -> Iterator[str | None]:
    """Yields the docker client once a daemon answers, or None (with no client, no daemon and no
    way to start one). A daemon started here is stopped on exit."""
    docker = client()
    if docker is None:
        yield None
        return
    if answers(docker):
        yield docker
        return
    dockerd = shutil.which("dockerd")
    if dockerd is None or os.geteuid() != 0:
        yield None
        return
    log = open(log_dir / "dockerd.log", "w")
    proc = subprocess.Popen([dockerd], stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        wait_for(lambda: proc.poll() is None and answers(docker) or proc.poll() is not None,
                 "dockerd to answer", timeout=120, interval=0.5)
        assert proc.poll() is None, (log_dir / "dockerd.log").read_text()[-3000:]
        yield docker
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(30)
        log.close()
