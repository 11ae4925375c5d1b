"""HumanEval pass@1: run generated code against the task's tests in a limited subprocess.

Only with ``--allow-code-execution`` (off by default): the generated program runs in a fresh
``python -I`` in an empty temporary directory with an empty environment, CPU-time, address-space
and file-size limits, a wall-clock timeout, and sockets disabled before the program starts. This
is containment for honest mistakes (infinite loops, memory blow-ups), not a security sandbox:
evaluate untrusted models inside a container without network as well.
"""

from __future__ import annotations

import re
import subprocess
import sys
import tempfile
from pathlib import Path

_PREAMBLE = """\
import socket as _socket
def _no_network(*args, **kwargs):
    raise OSError("network access is disabled during evaluation")
_socket.socket = _no_network
_socket.create_connection = _no_network
_socket.socketpair = _no_network
del _socket, _no_network
"""


def program_from_reply(reply: str, code_prompt: str) -> str:
    """The function to test: the reply's code block (or whole reply); if the reply only gives the
    body, it is appended to the prompt's signature and docstring."""
    blocks = re.findall(r"```(?:python|py)?\n(.*?)```", reply, flags=re.DOTALL)
    code = blocks[0] if blocks else reply
    return code if re.search(r"^\s*def \w+", code, flags=re.MULTILINE) else code_prompt + code


def _limits(cpu_seconds: int, memory_bytes: int):
    def apply() -> None:
        import resource

        resource.setrlimit(resource.RLIMIT_CPU, (cpu_seconds, cpu_seconds))
        resource.setrlimit(resource.RLIMIT_AS, (memory_bytes, memory_bytes))
        resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 20, 1 << 20))
        resource.setrlimit(resource.RLIMIT_NPROC, (64, 64))

    return apply


def passes(program: str, test: str, entry_point: str, timeout_s: float = 10.0,
           memory_mb: int = 1024) -> bool:
    """True when ``program`` followed by ``test`` and ``check(entry_point)`` exits 0 in time."""
    source = f"{_PREAMBLE}\n{program}\n\n{test}\n\ncheck({entry_point})\n"
    with tempfile.TemporaryDirectory(prefix="mimir-humaneval-") as tmp:
        script = Path(tmp) / "candidate.py"
        script.write_text(source, encoding="utf-8")
        try:
            done = subprocess.run(
                [sys.executable, "-I", str(script)], cwd=tmp, env={}, capture_output=True,
                timeout=timeout_s, preexec_fn=_limits(int(timeout_s) + 1, memory_mb << 20),
                stdin=subprocess.DEVNULL,
            )
        except subprocess.TimeoutExpired:
            return False
    return done.returncode == 0
