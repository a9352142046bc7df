"""The one error type for user mistakes: bad paths, bad files, bad flags, bad config values.

The CLIs print it as one line (no traceback) and exit non-zero. Its message says what was
expected, what was found and where (file, tensor, field).
"""


class FlotillaError(Exception):
    """A problem the user can fix; printed without a traceback."""
