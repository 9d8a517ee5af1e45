"""Errors a user can cause: the scripts print them as one line and exit non-zero, without a traceback."""

from data.errors import DataError
from model.hf_gpt2 import PretrainedError


class ConfigError(ValueError):
    """A config value that can't work."""


class CheckpointError(ValueError):
    """A missing, unreadable or mismatched checkpoint."""


class TrainingDiverged(ValueError):
    """The loss became NaN or infinite."""


USER_ERRORS = (ConfigError, CheckpointError, DataError, PretrainedError, TrainingDiverged)
