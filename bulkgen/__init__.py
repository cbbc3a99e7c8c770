"""bulkgen: run a language model over a whole dataset as a resumable overnight job."""

__version__ = "0.1.0"
