"""The job store: the single source of truth for jobs, requests and results."""

from bulkgen.store.db import Store, open_store

__all__ = ["Store", "open_store"]
