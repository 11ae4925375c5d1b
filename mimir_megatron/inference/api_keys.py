"""API keys of `mimir serve`: where a key comes from, how the server checks one, what a client sends.

A key reaches a process from a file (``--api-key-file PATH``: one key a line, blank lines and
``#`` comments ignored) or from the environment (``MIMIR_API_KEY``: one key), never from the
command line, which ``ps`` shows to every user of the machine. The server accepts every key of
both; a client sends the file's first key, else the variable's.

The server keeps only the SHA-256 digests of its keys and compares the digest of the presented key
with every one of them through :func:`hmac.compare_digest`, without stopping at a match: the time
taken depends on neither the presented key nor which key matched (digests all have one length,
so not even the key's length shows).
"""

from __future__ import annotations

import argparse
import hashlib
import hmac
import logging
import os
import secrets
import stat
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

from mimir_megatron import user_config
from mimir_megatron.errors import UserError

log = logging.getLogger(__name__)

ENV_VAR = "MIMIR_API_KEY"
"""The environment variable holding a key, for the server and its clients alike."""
MIN_LENGTH = 16
"""Keys shorter than this are accepted with a warning: guessable over HTTP at thousands of tries a second."""
SDK_PLACEHOLDER = "EMPTY"
"""What a client sends to a server without keys (the OpenAI SDK insists on some key)."""


def _digest(key: str) -> bytes:
    return hashlib.sha256(key.encode("utf-8")).digest()


class ApiKeys:
    """The keys a server accepts (at least one); ``repr`` never shows them."""

    def __init__(self, keys: Iterable[str]) -> None:
        self._digests = tuple(_digest(k) for k in dict.fromkeys(keys))
        if not self._digests:
            raise ValueError("ApiKeys needs at least one key")

    def __len__(self) -> int:
        return len(self._digests)

    def __repr__(self) -> str:
        return f"ApiKeys({len(self)} key{'s' if len(self) != 1 else ''})"

    def accepts(self, presented: str | None) -> bool:
        """Whether ``presented`` is one of the keys, in constant time (see the module's note)."""
        candidate = _digest(presented or "")
        matched = False
        for digest in self._digests:  # every key, no early exit
            matched |= hmac.compare_digest(candidate, digest)
        return matched and presented is not None


def new_key() -> str:
    """A fresh random key (256 bits), for a server a command starts for itself."""
    return secrets.token_urlsafe(32)


def read_key_file(path: str | os.PathLike) -> list[str]:
    """The keys of a key file; a file others may read is used with a warning (``chmod 600``)."""
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
        mode = path.stat().st_mode
    except FileNotFoundError:
        raise UserError(f"API key file {path}: no such file") from None
    except (OSError, UnicodeDecodeError) as exc:
        reason = getattr(exc, "strerror", None) or exc
        raise UserError(f"API key file {path}: cannot read it ({reason})") from None
    keys = [line.strip() for line in text.splitlines()]
    keys = [k for k in keys if k and not k.startswith("#")]
    if not keys:
        raise UserError(f"API key file {path} holds no key (one key a line; blank and # lines are ignored)")
    if mode & (stat.S_IRWXG | stat.S_IRWXO):
        log.warning("API key file %s may be read by other users (mode %04o): chmod 600 %s",
                    path, stat.S_IMODE(mode), path)
    return keys


def _env_key(environ: Mapping[str, str]) -> str | None:
    if ENV_VAR not in environ:
        return None
    value = environ[ENV_VAR].strip()
    if not value:
        raise UserError(f"{ENV_VAR} is set but empty: set it to the key, or unset it")
    return value


def server_keys(key_file: str | os.PathLike | None,
                environ: Mapping[str, str] = os.environ) -> ApiKeys | None:
    """Every key of ``key_file`` and ``MIMIR_API_KEY``; None when neither is given."""
    keys = read_key_file(key_file) if key_file else []
    from_env = _env_key(environ)
    if from_env is not None:
        keys.append(from_env)
    if not keys:
        return None
    if any(len(k) < MIN_LENGTH for k in keys):
        log.warning("an API key is shorter than %d characters: it can be guessed; make a new one with "
                    "python -c 'import secrets; print(secrets.token_urlsafe(32))'", MIN_LENGTH)
    return ApiKeys(keys)


def own_key_file(environ: Mapping[str, str] = os.environ) -> Path:
    """The user's own key file, ``$XDG_CONFIG_HOME/mimir/api-key`` (else ``~/.config/mimir/api-key``):
    what `mimir serve` on loopback uses when given no key, and ``launchers/serve.sh``'s default."""
    return user_config.config_dir(environ) / "api-key"


def own_keys(environ: Mapping[str, str] = os.environ) -> tuple[ApiKeys, Path, bool]:
    """The keys of the user's own key file, made (one fresh key, mode 0600, in a 0700 directory)
    when there is none: ``(keys, path, made_now)``."""
    path = own_key_file(environ)
    made = False
    if not path.exists():
        user_config.private_directory(path.parent, "the API key of mimir serve")
        try:
            made = user_config.write_new_private_file(path, new_key() + "\n")
        except OSError as exc:
            raise UserError(f"cannot write the API key file {path} ({exc.strerror or exc}); give one with "
                            f"--api-key-file or {ENV_VAR}") from None
    return ApiKeys(read_key_file(path)), path, made


def client_key(key_file: str | os.PathLike | None,
               environ: Mapping[str, str] = os.environ) -> str | None:
    """The key a client sends: ``key_file``'s first, else ``MIMIR_API_KEY``, else None."""
    if key_file:
        return read_key_file(key_file)[0]
    return _env_key(environ)


@dataclass(frozen=True)
class Endpoint:
    """A running `mimir serve` (or any OpenAI-compatible server) as its clients see it."""

    base_url: str
    """The API root, ``http://HOST:PORT/v1``."""
    api_key: str | None = field(default=None, repr=False)
    """The key to send (None: the server asks for none)."""

    @classmethod
    def of(cls, value: Endpoint | str) -> Endpoint:
        """An endpoint, or a bare base URL as one without a key."""
        return value if isinstance(value, Endpoint) else cls(str(value))

    def __post_init__(self) -> None:
        object.__setattr__(self, "base_url", self.base_url.rstrip("/"))

    @property
    def headers(self) -> dict[str, str]:
        """The request headers that carry the key (none without one)."""
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    @property
    def sdk_key(self) -> str:
        """The ``api_key`` to give an OpenAI SDK client (which insists on one)."""
        return self.api_key or SDK_PLACEHOLDER


class _RefuseKeyValue(argparse.Action):
    """``--api-key VALUE``: refused without repeating the value (argparse would otherwise take
    it as an abbreviation of ``--api-key-file`` and print the key as a missing file's name)."""

    def __call__(self, parser, namespace, values, option_string=None) -> None:  # noqa: ANN001
        parser.error(f"{option_string} would show the key to every user of this machine (`ps`): put it in "
                     f"a file (--api-key-file PATH, mode 600) or in the environment ({ENV_VAR})")


def add_api_key_arguments(parser: argparse.ArgumentParser, help: str) -> None:
    """``--api-key-file PATH`` (with ``help``), and ``--api-key``, refused with the reason."""
    parser.add_argument("--api-key-file", metavar="PATH", help=help)
    parser.add_argument("--api-key", nargs="?", action=_RefuseKeyValue, help=argparse.SUPPRESS)
