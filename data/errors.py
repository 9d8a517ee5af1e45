class DataError(ValueError):
    """A problem with the user's data or its location, reported as one line without a traceback."""
