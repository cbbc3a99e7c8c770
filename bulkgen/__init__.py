"""bulkgen: run a language model over a whole dataset as a resumable overnight job.

The Python API (bulkgen/api.py) has the CLI's names: submit, run, generate, Job."""

__version__ = "0.1.0"

from bulkgen.api import Job, generate, run, submit  # noqa: E402  (light: heavy imports happen inside them)
from bulkgen.errors import BulkgenError, ConfigError, InputError, ModelError, NotFoundError, StoreError  # noqa: E402

__all__ = ["BulkgenError", "ConfigError", "InputError", "Job", "ModelError", "NotFoundError", "StoreError",
           "generate", "run", "submit"]
