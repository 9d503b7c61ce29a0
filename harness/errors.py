"""The error types that bad input raises. The CLI prints each as a single line and exits 2."""


class CheckpointError(Exception):
    """Something on disk is wrong. `where` names the file or tensor, `what` says what is wrong."""

    def __init__(self, where: str, what: str):
        super().__init__(f"{where}: {what}")
        self.where = where
        self.what = what


class UsageError(Exception):
    """A usage or configuration problem: printed as one line ``error: ...``, exit status 2."""
