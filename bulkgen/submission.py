"""Submit: a file of rows (Parquet, JSONL, CSV) or an OpenAI batch file becomes a job of requests, each
rendered, tokenized once and seeded (prompts.py).

One loop for every input: a source yields chunks of rendered request rows, the loop counts them and
writes them in large transactions, and the job opens to workers only at the end. Everything that can
be checked before writing (the file, its columns, the flags, the model) is checked first, so a refused
submit leaves no job behind; a bad row becomes a failed request with its reason.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from bulkgen.config import Paths
from bulkgen.errors import InputError, ModelError
from bulkgen.io import openai_batch
from bulkgen.io.rows import InputFile, detect_format, fingerprint
from bulkgen.jobspec import JobSpec
from bulkgen.prompts import PromptRenderer
from bulkgen.resolve import resolve_model
from bulkgen.store import jobs as job_ops
from bulkgen.store.db import Store
from bulkgen.store.models import RequestState

ROWS_PER_TRANSACTION = 16_384
Chunks = Iterator[tuple[int, list[dict[str, Any]]]]  # (input rows read, their request rows)


@dataclass(frozen=True)
class SubmitReport:
    job_id: int
    num_rows: int
    num_requests: int
    num_failed: int  # requests refused at submit (bad rows), with their reasons stored
    num_prompt_tokens: int
    seconds: float
    model_path: str

    def to_dict(self) -> dict[str, Any]:
        return {"job_id": self.job_id, "num_rows": self.num_rows, "num_requests": self.num_requests,
                "num_failed": self.num_failed, "num_prompt_tokens": self.num_prompt_tokens,
                "seconds": round(self.seconds, 3), "model_path": self.model_path}


@dataclass(frozen=True)
class Source:
    """An input opened and checked: what the job records of it, and its request rows chunk by chunk."""

    path: Path
    fingerprint: str
    column_names: list[str]
    noun: str  # what a row of it is called in messages: "row", or an OpenAI batch file's "line"
    chunks: Callable[[PromptRenderer, int], Chunks]


def open_source(spec: JobSpec) -> tuple[JobSpec, Source]:
    """The spec's input as a source (a table of rows, or an OpenAI batch file); InputError if unreadable."""
    path = spec.input.expanduser().resolve()
    if path.is_file() and detect_format(path, spec.input_format) == "openai":
        return replace(spec, input=path, input_format="openai"), \
            Source(path, fingerprint(path), ["custom_id"], "line", lambda r, job_id: _batch_chunks(path, r, job_id))
    table = InputFile(spec.input, spec.columns, spec.input_format)
    return replace(spec, input_format=table.format), Source(
        table.path, table.fingerprint, table.column_names, "row", lambda r, job_id: _table_chunks(table, r, job_id))


def submit_job(store: Store, spec: JobSpec, paths: Paths | None = None,
               log: Callable[[str], None] | None = None,
               on_rows: Callable[[int], None] | None = None) -> SubmitReport:
    start = time.perf_counter()
    spec, source = open_source(spec)
    try:
        model = resolve_model(spec.model, paths, log)
    except ModelError as exc:
        if not spec.model_from_file:
            raise
        raise ModelError(f"{source.path.name}: its first line names model {spec.model!r}, which bulkgen cannot load: "
                         "give --model (a hub name, an alias, a local Hugging Face directory or a .gguf file) and "
                         "every line runs on it") from exc
    renderer = PromptRenderer(spec, model.path)
    with store.session_scope(write=True) as session:
        job_id = job_ops.new_job(session, name=spec.name, model=spec.model, model_path=str(model.path),
                                 model_revision=model.revision, input_path=str(source.path),
                                 input_fingerprint=source.fingerprint, input_columns=source.column_names,
                                 spec=spec.to_dict())
    counts = _Counts()
    try:
        pending: list[dict[str, Any]] = []
        for num_rows, rows in source.chunks(renderer, job_id):
            counts.add(num_rows, rows)
            pending.extend(rows)
            if len(pending) >= ROWS_PER_TRANSACTION:
                with store.session_scope(write=True) as session:
                    job_ops.insert_requests(session, pending)
                pending = []
            if on_rows:
                on_rows(num_rows)
        counts.check(source)
        with store.session_scope(write=True) as session:
            job_ops.insert_requests(session, pending)
            job_ops.open_job(session, job_id, counts.requests)
    except BaseException:
        with store.session_scope(write=True) as session:
            job_ops.delete_job(session, job_id)
        raise
    return SubmitReport(job_id, counts.rows, counts.requests, counts.failed, counts.prompt_tokens,
                        time.perf_counter() - start, str(model.path))


def _table_chunks(table: InputFile, renderer: PromptRenderer, job_id: int) -> Chunks:
    first_row = 0
    for batch in table.batches():
        yield batch.num_rows, renderer.table_rows(job_id, batch, first_row)
        first_row += batch.num_rows


def _batch_chunks(path: Path, renderer: PromptRenderer, job_id: int) -> Chunks:
    """An OpenAI batch file (io/openai_batch.py), LINES_PER_BATCH lines a chunk: each line a row of `n`
    requests with the line's own settings; a line that cannot run fails alone, a file that is not a batch
    file is refused whole."""
    first_row, chunk = 0, []
    for line in openai_batch.read_lines(path):
        chunk.append(line)
        if len(chunk) >= openai_batch.LINES_PER_BATCH:
            yield len(chunk), renderer.batch_rows(job_id, chunk, first_row)
            first_row, chunk = first_row + len(chunk), []
    if chunk:
        yield len(chunk), renderer.batch_rows(job_id, chunk, first_row)


@dataclass
class _Counts:
    rows: int = 0
    requests: int = 0
    failed: int = 0
    prompt_tokens: int = 0
    first_error: tuple[int, str] | None = None  # (row, reason) of the first failed request

    def add(self, num_rows: int, rows: list[dict[str, Any]]) -> None:
        self.rows += num_rows
        self.requests += len(rows)
        failed = [r for r in rows if r["state"] == RequestState.FAILED.value]
        self.failed += len(failed)
        if failed and self.first_error is None:
            self.first_error = failed[0]["row"], failed[0]["error"]
        self.prompt_tokens += sum(r["num_prompt_tokens"] for r in rows)

    def check(self, source: Source) -> None:
        """A job with no row, or with no row that can run, is refused whole (nothing stays submitted)."""
        if self.rows == 0:
            raise InputError(f"{source.path} has no {source.noun}s: nothing to submit")
        if self.requests and self.failed == self.requests:
            row, error = self.first_error
            raise InputError(f"no {source.noun} of {source.path} can run: all {self.rows} {source.noun}s are bad "
                             f"(row {row}: {error}); fix the input or the flags (nothing was submitted)")
