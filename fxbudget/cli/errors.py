"""`UsageError`: a bad command-line input, said in one line (its own module: `preflight` and `names` both raise it)."""


class UsageError(Exception):
    """A bad input, said in one line that tells the user what to do."""
