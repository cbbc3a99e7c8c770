"""Errors bulkgen raises on purpose. The CLI is the only place that maps them to exit codes."""


class BulkgenError(Exception):
    """Base of every error bulkgen raises on purpose; its message says what to fix."""

    exit_code = 1


class ConfigError(BulkgenError):
    """A flag, job file or setting is invalid. Raised before anything is written."""

    exit_code = 2


class UnreachableError(ConfigError):
    """The database did not answer at first contact, for a reason that may pass (a server starting or restarting,
    a refused or dropped connection). A worker waits for it (up to --db-outage-s); other commands stop."""


class InputError(BulkgenError):
    """An input file cannot be used (missing, not Parquet, wrong columns). Nothing is written."""

    exit_code = 2


class ModelError(BulkgenError):
    """A model cannot be found, fetched, converted or loaded."""

    exit_code = 2


class StoreError(BulkgenError):
    """The job store failed (database unreachable, schema too new, transaction failed). `transient`: the kind a
    worker waits out (the server restarting, a dropped connection, a lock held past the busy timeout), not the
    kind that stops it (a full disk, a dropped table, bad credentials)."""

    def __init__(self, message: str, transient: bool = False) -> None:
        super().__init__(message)
        self.transient = transient


class NotFoundError(BulkgenError):
    """A job or request that was asked for does not exist."""

    exit_code = 2


class PromptTooLongError(BulkgenError):
    """A prompt does not fit the model's context together with its token budget."""

    exit_code = 2
