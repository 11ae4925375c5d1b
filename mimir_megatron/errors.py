"""Errors that are the user's to fix: the CLI prints their message without a traceback."""


class UserError(Exception):
    """Bad input (config, file, checkpoint, batch): the message says what and where."""


class ConfigError(UserError, ValueError):
    """One or more invalid configuration values; the message lists every mistake."""


class NonFiniteTraining(UserError):
    """A step's loss or gradient norm was not finite and `train.on_nonfinite` says stop."""


def write_error(exc: OSError, path, fix: str, needed: int | None = None) -> UserError:
    """One line for a failed write: the path, what went wrong in plain words, and ``fix``.

    A full disk says how much was needed when ``needed`` is known; a read-only place says so
    (``EROFS``, ``EACCES``, ``EPERM``); anything else keeps the system's message."""
    import errno

    if exc.errno in (errno.ENOSPC, errno.EDQUOT):
        what = "no space left on device" if exc.errno == errno.ENOSPC else "disk quota exceeded"
        amount = f", {needed:,} bytes needed" if needed is not None else ""
        return UserError(f"{what}: {path}{amount}; {fix}")
    if exc.errno in (errno.EROFS, errno.EACCES, errno.EPERM):
        return UserError(f"{path} is not writable ({exc.strerror}); {fix}")
    return UserError(f"cannot write {path} ({exc.strerror or exc}); {fix}")
