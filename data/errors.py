from common.errors import UserError


class DataError(UserError):
    """A problem with the user's data or its location, reported as one line without a traceback."""
