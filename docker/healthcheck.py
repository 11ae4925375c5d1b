"""The image's HEALTHCHECK: `mimir serve` is healthy when its ``/health`` route answers 200.

Any other command (training, data preparation) has no route to ask and counts as healthy while
it runs. The port is read from the server's own command line (``--port``, default 8000), so a
server started on another port is checked there. Standard library only: it runs every 30 s.
"""

from __future__ import annotations

import sys
import urllib.request
from pathlib import Path

DEFAULT_PORT = 8000


def serve_port() -> int | None:
    """The port of a `mimir serve` process in this container, or None when none runs."""
    for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
        try:
            argv = cmdline.read_bytes().decode(errors="replace").split("\0")
        except OSError:
            continue
        if "serve" not in argv or not any(arg.endswith("mimir") for arg in argv[:2]):
            continue
        for i, arg in enumerate(argv):
            if arg == "--port" and i + 1 < len(argv):
                return int(argv[i + 1])
            if arg.startswith("--port="):
                return int(arg.split("=", 1)[1])
        return DEFAULT_PORT
    return None


def main() -> int:
    port = serve_port()
    if port is None:
        return 0
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=4) as response:
            return 0 if response.status == 200 else 1
    except OSError as error:
        print(f"mimir serve on port {port}: {error}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
