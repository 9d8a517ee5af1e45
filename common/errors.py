"""Errors a user can cause, all UserError: the commands catch them, print one line (no traceback), exit status 2."""


class UserError(ValueError):
    """A mistake in what the user gave: a value, a file, a run directory. Bugs raise anything else."""


class ConfigError(UserError):
    """A config value that can't work."""


class CheckpointError(UserError):
    """A missing, unreadable or mismatched checkpoint."""


class DiskFull(UserError):
    """No space left (or the quota spent) on the disk a file was being written to: the user's to free."""


class DataError(UserError):
    """A problem with the user's data or where it lives."""


class TrainingDiverged(UserError):
    """The loss became NaN or infinite."""


class RunLocked(UserError):
    """Another process is training in the same run directory."""


def first_line(err: BaseException, named: bool = False) -> str:
    """An exception's message as one line: its first, else its type's name; named: after its type's name."""
    line = next(iter(str(err).strip().splitlines()), "")
    return f"{type(err).__name__}: {line}" if named and line else line or type(err).__name__
