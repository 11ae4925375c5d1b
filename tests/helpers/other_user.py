"""A second, unprivileged Unix user of this machine, for the tests of what another user of a shared
node can do with the services the first one runs (`mimir serve`, `mimir ui`).

Where the suite runs as root (CI does), the user is created once (``useradd``, no home, no login
shell) and commands run as it through ``setpriv`` (util-linux) with its own uid, gid and no
supplementary groups. Elsewhere the tests skip with a reason that tests/expected_skips.txt does not
list, so a CI run that cannot make the user fails instead of passing without the check.
"""

from __future__ import annotations

import os
import pwd
import shutil
import subprocess

import pytest

NAME = "mimir-other"


def other_user() -> pwd.struct_passwd:
    """The second user (created if missing); skips where it cannot be made."""
    if os.geteuid() != 0:
        pytest.skip("a second Unix user needs root to create (the suite runs as root in CI)")
    for tool in ("useradd", "setpriv", "curl"):
        if shutil.which(tool) is None:
            pytest.skip(f"no {tool} for the second Unix user (apt-get install passwd util-linux curl)")
    try:
        return pwd.getpwnam(NAME)
    except KeyError:  # (another test worker may be creating it at the same moment)
        made = subprocess.run(["useradd", "--system", "--no-create-home", "--shell", "/usr/sbin/nologin", NAME],
                              capture_output=True, text=True)
        try:
            return pwd.getpwnam(NAME)
        except KeyError:
            raise AssertionError(f"useradd {NAME} failed: {made.stderr}") from None


def run_as_other(argv: list[str], timeout: float = 60) -> subprocess.CompletedProcess:
    """``argv`` as the second user, in / (it can read nothing of the first user's)."""
    user = other_user()
    command = ["setpriv", f"--reuid={user.pw_uid}", f"--regid={user.pw_gid}", "--clear-groups", "--", *argv]
    return subprocess.run(command, capture_output=True, text=True, timeout=timeout, cwd="/",
                          env={"PATH": "/usr/bin:/bin", "HOME": "/nonexistent"})


def curl_as_other(method: str, url: str, *args: str) -> tuple[int, str]:
    """(HTTP status, body) of ``curl -X METHOD URL ARGS`` run by the second user."""
    done = run_as_other(["curl", "-sS", "-X", method, "-o", "-", "-w", "\n%{http_code}", *args, url])
    assert done.returncode == 0, done.stderr
    body, _, status = done.stdout.rpartition("\n")
    return int(status), body
