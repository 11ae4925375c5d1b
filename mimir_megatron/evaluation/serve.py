"""Start `mimir serve` for a checkpoint or HF directory on a free 127.0.0.1 port, and stop it.

The server gets a fresh API key through its environment (not its command line, which `ps` shows
to every user): another user of the machine cannot use it while the evaluation runs."""

from __future__ import annotations

import contextlib
import logging
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx

from mimir_megatron.errors import UserError
from mimir_megatron.inference.api_keys import ENV_VAR, Endpoint, new_key
from mimir_megatron.ports import free_port

log = logging.getLogger(__name__)


@contextlib.contextmanager
def launched_server(*, checkpoint: str | None = None, ema: bool = False, hf: str | None = None,
                    weights: str | None = None, tokenizer: str | None = None,
                    log_file: Path, startup_timeout_s: float = 900.0) -> Iterator[Endpoint]:
    """Yields the endpoint (".../v1" and its key) of a `mimir serve` subprocess; its output goes
    to ``log_file``. A server that exits or does not answer /health in time is a UserError that
    quotes the end of its log."""
    port = free_port()
    command = [sys.executable, "-m", "mimir_megatron.cli", "serve", "--host", "127.0.0.1",
               "--port", str(port)]
    for flag, value in (("--checkpoint", checkpoint), ("--hf", hf), ("--weights", weights),
                        ("--tokenizer", tokenizer)):
        if value:
            command += [flag, str(value)]
    if ema:
        command.append("--ema")
    log_file.parent.mkdir(parents=True, exist_ok=True)
    root = f"http://127.0.0.1:{port}"
    key = new_key()
    with log_file.open("w") as out:
        log.info("starting %s", " ".join(command))
        process = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                   env={**os.environ, ENV_VAR: key})
        try:
            _wait_healthy(process, root, log_file, startup_timeout_s)
            log.info("mimir serve is up at %s (log: %s)", root, log_file)
            yield Endpoint(root + "/v1", key)
        finally:
            process.terminate()
            try:
                process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()


def _wait_healthy(process: subprocess.Popen, root: str, log_file: Path, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if process.poll() is not None:
            tail = "\n".join(log_file.read_text(errors="replace").splitlines()[-15:])
            raise UserError(f"mimir serve exited with status {process.returncode}:\n{tail}")
        try:
            if httpx.get(root + "/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise UserError(f"mimir serve did not answer {root}/health within {timeout_s:.0f} s (log: {log_file})")
