"""The training layer's user errors (common.errors.UserError: one line on stderr, exit status 2)."""

from common.errors import UserError


class TrainingDiverged(UserError):
    """The loss became NaN or infinite."""


class RunLocked(UserError):
    """Another process is training in the same run directory."""
