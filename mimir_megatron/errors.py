"""Errors that are the user's to fix: the CLI prints their message without a traceback."""


class UserError(Exception):
    """Bad input (config, file, checkpoint, batch): the message says what and where."""


class ConfigError(UserError, ValueError):
    """One or more invalid configuration values; the message lists every mistake."""


class NonFiniteTraining(UserError):
    """A step's loss or gradient norm was not finite and `train.on_nonfinite` says stop."""
