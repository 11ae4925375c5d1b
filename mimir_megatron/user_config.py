"""The user's own mimir files: ``$XDG_CONFIG_HOME/mimir`` (else ``~/.config/mimir``), kept 0700,
each secret written once, 0600 from its creation (:func:`write_new_private_file`).

What lives there is private to one Unix user on a shared node: the login of `mimir ui`
(``ui/``, :mod:`mimir_megatron.ops.ui_login`) and the API key of `mimir serve` (``api-key``,
:mod:`mimir_megatron.inference.api_keys`; ``launchers/serve.sh`` uses the same file).
"""

from __future__ import annotations

import os
import stat
from collections.abc import Mapping
from pathlib import Path

from mimir_megatron.errors import UserError
from mimir_megatron.integrity import temporary_path


def config_dir(environ: Mapping[str, str] = os.environ) -> Path:
    """``$XDG_CONFIG_HOME/mimir``, else ``~/.config/mimir``."""
    base = environ.get("XDG_CONFIG_HOME") or os.path.join(os.path.expanduser("~"), ".config")
    return Path(base) / "mimir"


def private_directory(path: Path, purpose: str) -> None:
    """Make ``path`` (and its parents) with mode 0700, or set 0700 on one made by hand or by an
    older version; a one-line error naming ``purpose`` when it cannot be made."""
    try:
        path.mkdir(mode=0o700, parents=True, exist_ok=True)
        if stat.S_IMODE(path.stat().st_mode) != 0o700:
            path.chmod(0o700)
    except OSError as exc:
        raise UserError(f"cannot make {path} for {purpose} ({exc.strerror or exc}); set XDG_CONFIG_HOME "
                        "to a private directory") from None


def write_new_private_file(path: Path, text: str) -> bool:
    """Write ``path`` (mode 0600 from its creation) unless it exists; whether this call made it.

    The text is written whole beside ``path`` and hard-linked into place, so a process starting
    at the same moment (two servers, two `mimir ui`) finds either no file or the whole text, and
    the first link wins. Errors other than "it exists" (no such folder, no hard links on this
    file system) are the caller's to word."""
    draft = temporary_path(path)  # the project's staging name: beside it, hidden, per process
    try:
        fd = os.open(draft, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)  # ours: a 0700 folder
        with os.fdopen(fd, "w", encoding="utf-8") as out:
            out.write(text)
        try:
            os.link(draft, path)
        except FileExistsError:  # another process made it first: its text is the one
            return False
        return True
    finally:
        draft.unlink(missing_ok=True)
