"""Errors a user can cause: the commands print them as one line and exit with status 2, without a traceback.

Each layer defines its own (DataError, PretrainedError, CheckpointError, ...) as a subclass of UserError, so the
commands catch them all without importing every layer.
"""


class UserError(ValueError):
    """A mistake in what the user gave: a value, a file, a run directory. Bugs raise anything else."""


class ConfigError(UserError):
    """A config value that can't work."""


class CheckpointError(UserError):
    """A missing, unreadable or mismatched checkpoint."""


class DiskFull(UserError):
    """No space left (or the quota spent) on the disk a file was being written to: the user's to free."""
