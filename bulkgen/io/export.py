# Whole (over 300 lines): the streamed join and its sinks (Parquet, JSONL, CSV, OpenAI) share one write-then-rename
# path.
"""Export: one row per request, in input order, joined to the input columns; failed rows carry their error.

The input file and the results are streamed side by side, a record batch of input rows at a time, so
memory stays flat. The output is written to a temporary file and renamed: a reader never sees half.
"""

from __future__ import annotations

import itertools
import json
import os
import tempfile
from dataclasses import dataclass
from datetime import UTC
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.csv as pa_csv
import pyarrow.parquet as pq

from bulkgen.errors import InputError
from bulkgen.io.openai_batch import output_line
from bulkgen.io.rows import InputColumns, InputFile, fingerprint
from bulkgen.model import load_tokenizer
from bulkgen.store.db import Store
from bulkgen.store.jobs import get_job, results_page
from bulkgen.store.models import Job, JobStatus, RequestState, unpack_ids

FORMATS = {".parquet": "parquet", ".jsonl": "jsonl", ".ndjson": "jsonl", ".csv": "csv"}
PAGE_ROWS = 4096

RESULT_SCHEMA = pa.schema([
    ("row", pa.int64()),
    ("sample", pa.int32()),
    ("custom_id", pa.string()),
    ("status", pa.string()),
    ("output", pa.string()),
    ("finish_reason", pa.string()),
    ("num_prompt_tokens", pa.int32()),
    ("num_output_tokens", pa.int32()),
    ("num_cached_tokens", pa.int32()),
    ("error", pa.string()),
    ("time_to_first_token_s", pa.float64()),
    ("latency_s", pa.float64()),
])


@dataclass(frozen=True)
class ExportReport:
    path: Path
    num_rows: int
    num_completed: int
    num_failed: int
    is_partial: bool  # the job was still running or queued: what is committed so far

    def to_dict(self) -> dict[str, Any]:
        return {"path": str(self.path), "num_rows": self.num_rows, "num_completed": self.num_completed,
                "num_failed": self.num_failed, "partial": self.is_partial}


def export_job(store: Store, job_id: int, out: Path, include_inputs: bool = True, input_path: Path | None = None,
               include_token_ids: bool = False, fmt: str | None = None) -> ExportReport:
    fmt = fmt or FORMATS.get(out.suffix.lower())
    if fmt is None:
        raise InputError(f"cannot tell the export format from {out.name!r}: name it .parquet, .jsonl or .csv")
    with store.session_scope() as session:
        job = get_job(session, job_id)
        session.expunge(job)
    openai_input = (job.spec.get("input_format") or "") == "openai"
    source = _open_input(job, input_path) if include_inputs and not openai_input else None
    out, tmp_name = temporary_output(out)
    writer = {"parquet": _ParquetSink, "jsonl": _JsonlSink, "csv": _CsvSink}[fmt](Path(tmp_name))
    counts = {"rows": 0, "completed": 0, "failed": 0}
    try:
        for table in _tables(store, job, source, include_token_ids):
            writer.write(table)
            status = table.column("status").to_pylist()
            counts["rows"] += table.num_rows
            counts["completed"] += status.count(RequestState.COMPLETED.value)
            counts["failed"] += status.count(RequestState.FAILED.value)
        writer.close()
        os.replace(tmp_name, out)
    finally:
        writer.close()
        if os.path.exists(tmp_name):
            os.unlink(tmp_name)
    partial = job.status in (JobStatus.SUBMITTING.value, JobStatus.QUEUED.value, JobStatus.RUNNING.value)
    return ExportReport(out, counts["rows"], counts["completed"], counts["failed"], partial)


def temporary_output(out: Path, what: str = "export", example: str = "results.parquet") -> tuple[Path, str]:
    """The resolved output path and a temporary file beside it (renamed onto it when complete); InputError in
    one line where it cannot be written (`what`: the verb the message uses)."""
    out = out.expanduser().resolve()
    if out.is_dir():
        raise InputError(f"cannot {what} to {out}: it is a directory; give a file in it, such as {out / example}")
    if not out.parent.is_dir():
        raise InputError(f"cannot {what} to {out}: the directory {out.parent} does not exist; create it first")
    try:
        handle, tmp_name = tempfile.mkstemp(dir=out.parent, prefix=f".{out.name}.", suffix=".tmp")
    except OSError as exc:
        raise InputError(f"cannot write in {out.parent} ({exc.strerror}): {what} to a directory you can "
                         "write") from exc
    os.close(handle)
    os.chmod(tmp_name, 0o666 & ~_umask())  # mkstemp makes it 0600; the export gets what open() would give
    return out, tmp_name


def export_openai(store: Store, job_id: int, out: Path, errors: Path | None = None) -> ExportReport:
    """The OpenAI batch output format (io/openai_batch.py): a line per input line, in input order; failed lines
    in `errors` if given (as OpenAI's error file), else in `out` too. Lines not finished yet are left out."""
    with store.session_scope() as session:
        job = get_job(session, job_id)
        session.expunge(job)
    targets = [temporary_output(out)] + ([temporary_output(errors)] if errors is not None else [])
    handles = [open(tmp, "w", encoding="utf-8") for _, tmp in targets]
    main, failed_to = handles[0], handles[-1]
    counts = {"rows": 0, "completed": 0, "failed": 0}
    decode = _token_decoder(job.model_path)
    try:
        start = 0
        while True:
            with store.session_scope() as session:
                rows = results_page(session, job.id, start, start + PAGE_ROWS)
            if not rows:
                break
            for row, samples in itertools.groupby(rows, key=lambda r: r.row):
                samples = list(samples)
                if any(s.state in (RequestState.PENDING.value, RequestState.RUNNING.value) for s in samples):
                    continue
                finished = [s.finished_at for s in samples if s.finished_at is not None]
                created = int(max(finished).replace(tzinfo=UTC).timestamp()) if finished else 0
                # rows of a table (no line of their own): chat completions of the job's model
                params = samples[0].params or {"openai": {"model": job.model}}
                line = output_line(samples[0].custom_id or str(row), job.id, row, params, samples, created, decode)
                ok = line["error"] is None
                (main if ok else failed_to).write(json.dumps(line, ensure_ascii=False) + "\n")
                counts["rows"] += 1
                counts["completed" if ok else "failed"] += 1
            start += PAGE_ROWS
        for handle in handles:
            handle.close()
        for path, tmp in targets:
            os.replace(tmp, path)
    finally:
        for handle in handles:
            handle.close()
        for _, tmp in targets:
            if os.path.exists(tmp):
                os.unlink(tmp)
    partial = job.status in (JobStatus.SUBMITTING.value, JobStatus.QUEUED.value, JobStatus.RUNNING.value)
    return ExportReport(targets[0][0], counts["rows"], counts["completed"], counts["failed"], partial)


def _token_decoder(model_path: str):
    """Token ids -> their text, one by one (log-probabilities' tokens); the tokenizer loaded on first use."""
    tokenizer = None

    def decode(ids: list[int]) -> list[str]:
        nonlocal tokenizer
        if tokenizer is None:
            tokenizer = load_tokenizer(Path(model_path))
        return [tokenizer.decode([i]) for i in ids]

    return decode


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def _open_input(job: Job, override: Path | None) -> InputFile:
    path = Path(override or job.input_path)
    if not path.is_file():
        raise InputError(f"job {job.id}'s input {path} is gone: give its new place with --input PATH, "
                         "or export without it (--no-include-inputs)")
    if override is None and job.input_fingerprint != fingerprint(path):
        raise InputError(f"{path} changed since job {job.id} was submitted, so its rows may not line up: "
                         "point --input at the original file, or use --no-include-inputs")
    return InputFile(path, InputColumns(), job.spec.get("input_format") or "auto")


def _tables(store: Store, job: Job, source: InputFile | None, include_token_ids: bool):
    include_logprobs = (job.spec.get("sampling") or {}).get("logprobs") is not None
    if source is None:
        start = 0
        while True:
            table = _results_table(store, job.id, start, start + PAGE_ROWS, include_token_ids, include_logprobs)
            if table is None:
                return
            yield table
            start += PAGE_ROWS
    renamed = [f"input_{name}" if name in RESULT_SCHEMA.names or name == "output_token_ids" else name
               for name in source.schema.names]
    start = 0
    for batch in source.batches(PAGE_ROWS, all_columns=True):
        end = start + batch.num_rows
        results = _results_table(store, job.id, start, end, include_token_ids, include_logprobs)
        if results is not None:
            inputs = pa.Table.from_batches([batch]).rename_columns(renamed)
            rows = pa.array([r - start for r in results.column("row").to_pylist()], pa.int64())
            joined = inputs.take(rows)
            for name in joined.column_names:
                results = results.append_column(name, joined.column(name))
            yield results
        start = end


def _results_table(store: Store, job_id: int, start: int, end: int, include_token_ids: bool,
                   include_logprobs: bool) -> pa.Table | None:
    with store.session_scope() as session:
        rows = results_page(session, job_id, start, end)
    if not rows:
        return None
    columns: dict[str, list[Any]] = {name: [] for name in RESULT_SCHEMA.names}
    token_ids: list[list[int] | None] = []
    logprobs: list[str | None] = []
    for r in rows:
        columns["row"].append(r.row)
        columns["sample"].append(r.sample)
        columns["custom_id"].append(r.custom_id)
        columns["status"].append(r.state)
        columns["output"].append(r.text)
        columns["finish_reason"].append(r.finish_reason)
        columns["num_prompt_tokens"].append(r.num_prompt_tokens)
        columns["num_output_tokens"].append(r.num_output_tokens)
        columns["num_cached_tokens"].append(r.num_cached_tokens)
        columns["error"].append(r.error)
        columns["time_to_first_token_s"].append(r.time_to_first_token_s)
        columns["latency_s"].append(r.latency_s)
        token_ids.append(unpack_ids(r.token_ids) if r.token_ids is not None else None)
        logprobs.append(json.dumps(r.logprobs) if r.logprobs is not None else None)
    table = pa.table(columns, schema=RESULT_SCHEMA)
    if include_token_ids:
        table = table.append_column("output_token_ids", pa.array(token_ids, pa.list_(pa.int32())))
    if include_logprobs:
        table = table.append_column("logprobs", pa.array(logprobs, pa.string()))
    return table


class _ParquetSink:
    def __init__(self, path: Path) -> None:
        self.path = path
        self.writer: pq.ParquetWriter | None = None
        self.schema: pa.Schema | None = None

    def write(self, table: pa.Table) -> None:
        if self.writer is None:
            self.schema = table.schema
            self.writer = pq.ParquetWriter(self.path, self.schema)
        self.writer.write_table(table)

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
            self.writer = None
        elif not self.path.exists() or self.path.stat().st_size == 0:
            pq.write_table(RESULT_SCHEMA.empty_table(), self.path)


class _JsonlSink:
    def __init__(self, path: Path) -> None:
        self.handle = open(path, "w", encoding="utf-8")

    def write(self, table: pa.Table) -> None:
        for record in table.to_pylist():
            self.handle.write(json.dumps(record, ensure_ascii=False, default=str) + "\n")

    def close(self) -> None:
        if not self.handle.closed:
            self.handle.close()


class _CsvSink:
    """A header line, then a line per row; nested values (a messages column, token ids, logprobs) as JSON text,
    as CSV has no lists."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.writer: pa_csv.CSVWriter | None = None
        self.schema: pa.Schema | None = None

    def write(self, table: pa.Table) -> None:
        for i, field in enumerate(table.schema):
            if pa.types.is_nested(field.type):
                text = pa.array([None if v is None else json.dumps(v, ensure_ascii=False, default=str)
                                 for v in table.column(i).to_pylist()], pa.string())
                table = table.set_column(i, pa.field(field.name, pa.string()), text)
        if self.writer is None:
            self.schema = table.schema
            self.writer = pa_csv.CSVWriter(str(self.path), self.schema)
        self.writer.write_table(table.cast(self.schema))

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
            self.writer = None
        elif not self.path.exists() or self.path.stat().st_size == 0:
            pa_csv.write_csv(RESULT_SCHEMA.empty_table(), str(self.path))
