"""The training layer's user errors (common.errors.UserError: one line on stderr, exit status 2)."""

from common.errors import UserError


class CheckpointError(UserError):
    """A missing, unreadable or mismatched checkpoint."""


class TrainingDiverged(UserError):
    """The loss became NaN or infinite."""


class RunLocked(UserError):
    """Another process is training in the same run directory."""


class NonFiniteState(CheckpointError):
    """A state to checkpoint holds NaN or inf: it is not written, so the file on disk stays the last good one."""
