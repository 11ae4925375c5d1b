"""The login of `mimir ui`: MLflow's basic-auth app, one account per Unix user, made on first use.

On a shared node ``127.0.0.1`` is every user's: without a login, anyone on the machine could list,
delete or overwrite a run through MLflow's REST API and its artifact proxy. `mimir ui` therefore
always runs MLflow's own authentication (``mlflow.server.auth``, composed with the page of
:mod:`.ui_app`). Its files live in the user's config directory, ``$XDG_CONFIG_HOME/mimir/ui`` (else
``~/.config/mimir/ui``), mode 0700::

    login      USER:PASSWORD, mode 0600 (``curl -u "$(cat login)"`` takes it as it is)
    auth.ini   MLflow's auth configuration: the account store below, no permission by default
    auth.db    MLflow's account store (the password's hash), rebuilt when the login is new

The password is generated (192 bits) the first time and printed once; MLflow creates the account
from it when its server starts (``MLFLOW_AUTH_ADMIN_PASSWORD`` in the server's environment, never
on its command line). Deleting the directory makes a new login at the next start. Every request
but ``/health`` and the page's static files needs it: the UI (the browser asks once), the REST API,
the artifact proxy; Python clients give it as ``MLFLOW_TRACKING_USERNAME`` and
``MLFLOW_TRACKING_PASSWORD``.
"""

from __future__ import annotations

import logging
import os
import secrets
import stat
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

from mimir_megatron import user_config
from mimir_megatron.errors import UserError
from mimir_megatron.mlflow_store import unix_user

log = logging.getLogger("mimir")


def config_dir(environ: Mapping[str, str] = os.environ) -> Path:
    """Where the login lives: ``$XDG_CONFIG_HOME/mimir/ui``, else ``~/.config/mimir/ui``."""
    return user_config.config_dir(environ) / "ui"


@dataclass(frozen=True)
class UiLogin:
    """One user's login to their `mimir ui` servers."""

    directory: Path
    username: str
    password: str = field(repr=False)

    @property
    def login_file(self) -> Path:
        return self.directory / "login"

    @property
    def auth_config(self) -> Path:
        return self.directory / "auth.ini"

    @property
    def auth_db(self) -> Path:
        return self.directory / "auth.db"

    def server_env(self) -> dict[str, str]:
        """What MLflow's auth app reads at start-up (the secret key signs its CSRF tokens: one
        per server start, as the server runs one worker)."""
        return {"MLFLOW_AUTH_CONFIG_PATH": str(self.auth_config),
                "MLFLOW_AUTH_ADMIN_USERNAME": self.username,
                "MLFLOW_AUTH_ADMIN_PASSWORD": self.password,
                "MLFLOW_FLASK_SERVER_SECRET_KEY": secrets.token_hex(32)}

    @property
    def headers(self) -> dict[str, str]:
        """The ``Authorization`` header of this login (HTTP basic)."""
        import base64

        token = base64.b64encode(f"{self.username}:{self.password}".encode()).decode()
        return {"Authorization": f"Basic {token}"}

    def client_env(self) -> dict[str, str]:
        """What an MLflow client (``MlflowClient("http://...")``) needs to be let in."""
        return {"MLFLOW_TRACKING_USERNAME": self.username, "MLFLOW_TRACKING_PASSWORD": self.password}


def _read_login(path: Path) -> tuple[str, str]:
    mode = stat.S_IMODE(path.stat().st_mode)
    if mode & 0o077:
        path.chmod(0o600)
        log.warning("%s could be read by other users (mode %04o): made 0600; if another user may have read "
                    "it, delete %s and start mimir ui again for a new login", path, mode, path.parent)
    username, sep, password = path.read_text(encoding="utf-8").strip().partition(":")
    if not sep or not username or not password:
        raise UserError(f"{path} is not USER:PASSWORD; delete it and start mimir ui again for a new login")
    return username, password


_AUTH_INI = """\
# Written by `mimir ui` (mimir_megatron/ops/ui_login.py) at every start; edits are lost.
[mlflow]
default_permission = NO_PERMISSIONS
database_uri = sqlite:///{db}
admin_username = {user}
authorization_function = mlflow.server.auth:authenticate_request_basic_auth
"""


def ui_login(directory: Path | None = None) -> tuple[UiLogin, bool]:
    """This user's login (made now if there is none) and whether it was made now."""
    directory = directory or config_dir()
    user_config.private_directory(directory, "the login of mimir ui")
    login_file = directory / "login"
    created = False
    if not login_file.exists():
        login_text = f"{unix_user().replace(' ', '-')}:{secrets.token_urlsafe(24)}\n"
        created = user_config.write_new_private_file(login_file, login_text)
    username, password = _read_login(login_file)
    login = UiLogin(directory, username, password)
    if created:
        login.auth_db.unlink(missing_ok=True)  # an account made from an older login
    # made 0600 here, not by MLflow under the umask (sqlite takes an empty file as a new store)
    os.close(os.open(login.auth_db, os.O_WRONLY | os.O_CREAT, 0o600))
    login.auth_db.chmod(0o600)
    fd = os.open(login.auth_config, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w", encoding="utf-8") as out:
        out.write(_AUTH_INI.format(db=login.auth_db, user=username))
    return login, created
