"""bulkgen: run a language model over a whole dataset as a resumable overnight job.

The Python API (bulkgen/api.py) has the CLI's names: submit, run, generate, Job. It is loaded on first use
(`bulkgen.submit`), so that importing one of bulkgen's modules (the CLI, the GPU suite on a machine without
the database packages) loads only what that module needs."""

from typing import Any

from bulkgen.errors import BulkgenError, ConfigError, InputError, ModelError, NotFoundError, StoreError

__version__ = "0.1.0"
_API = ("Job", "generate", "run", "submit")
__all__ = ["BulkgenError", "ConfigError", "InputError", "Job", "ModelError", "NotFoundError", "StoreError",
           "generate", "run", "submit"]


def __getattr__(name: str) -> Any:
    if name in _API:
        from bulkgen import api  # here: see the docstring

        return getattr(api, name)
    raise AttributeError(f"module 'bulkgen' has no attribute {name!r}")
