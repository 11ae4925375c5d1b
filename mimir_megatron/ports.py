"""Picking the TCP port of a server that binds it moments later (``mimir ui``'s MLflow server,
``mimir eval``'s own ``mimir serve``, the benchmarks' servers, the tests' gloo ranks and Slurm
daemons): one picker, so every one of them keeps clear of the ports the kernel hands out."""

from __future__ import annotations

import random
import socket
from pathlib import Path

EPHEMERAL_RANGE = Path("/proc/sys/net/ipv4/ip_local_port_range")


def free_port(host: str = "127.0.0.1", tries: int = 64) -> int:
    """A TCP port that nothing listens on right now, for a server that binds it seconds later.

    Picked at random below the kernel's ephemeral range (``EPHEMERAL_RANGE``, 32768-60999 by
    default), where the kernel never hands ports out on its own: a port the OS picks (bind to 0)
    is an ephemeral one, and any outgoing connection or other server on the machine may be given
    it before ours binds (seen: an MLflow server that starts in ~7 s found its port taken). The
    OS's pick where no port below the range is free."""
    try:
        low = int(EPHEMERAL_RANGE.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        low = 32768
    below = range(max(1024, low // 2), low)
    candidates = random.sample(below, min(tries, len(below)))
    for port in [*candidates, 0]:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            try:
                s.bind((host, port))
            except OSError:
                continue
            return s.getsockname()[1]
    raise OSError(f"no free TCP port on {host}")
