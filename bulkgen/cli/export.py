"""`bulkgen export`: a job's results in input order, as Parquet, JSONL, CSV or an OpenAI batch output file."""

from __future__ import annotations

from pathlib import Path

import click

from bulkgen.cli.options import CONTEXT, JOB_ID, JobCommand, db_option, emit_json, json_option
from bulkgen.io.export import export_job, export_openai
from bulkgen.store.db import open_store


@click.command(cls=JobCommand, context_settings=CONTEXT)
@click.argument("job_id", type=JOB_ID)
@click.option("-o", "--output", "output", type=click.Path(path_type=Path), required=True,
              help="File to write: .parquet, .jsonl or .csv.")
@click.option("--include-inputs/--no-include-inputs", default=True, show_default=True,
              help="Join the input file's columns to each row.")
@click.option("--input", "input_path", type=click.Path(path_type=Path),
              help="Where the input file is now, if it moved since submit.")
@click.option("--include-token-ids", is_flag=True, help="Add the output token ids (output_token_ids column).")
@click.option("--format", "fmt", type=click.Choice(("auto", "parquet", "jsonl", "csv", "openai")), default="auto",
              show_default=True, help="auto: by the output's name (.parquet, .jsonl, .csv: lists as JSON text); "
                                      "openai: OpenAI's batch output format, a line per input line.")
@click.option("--errors", "errors_path", type=click.Path(path_type=Path),
              help="With --format openai: failed lines go to this file instead (as OpenAI's error file).")
@json_option
@db_option
def export(job_id: int, output: Path, include_inputs: bool, input_path: Path | None, include_token_ids: bool,
           fmt: str, errors_path: Path | None, as_json: bool, db_url: str) -> None:
    """Write a job's results, one row per request in input order, joined to the input columns.

    Columns: row, sample, custom_id, status, output, finish_reason, num_prompt_tokens,
    num_output_tokens, num_cached_tokens, error, time_to_first_token_s, latency_s, then the input
    columns (renamed input_NAME where a name clashes). Failed rows carry their error. A running job
    exports what is committed so far.

    \b
    Example:
      bulkgen export 1 -o demo.out.parquet
      bulkgen export 1 -o demo.out.jsonl --no-include-inputs
      bulkgen export 2 --format openai -o batch_output.jsonl --errors batch_errors.jsonl
    """
    if errors_path is not None and fmt != "openai":
        raise click.UsageError("--errors goes with --format openai")
    store = open_store(db_url)
    if fmt == "openai":
        report = export_openai(store, job_id, output, errors_path)
    else:
        report = export_job(store, job_id, output, include_inputs=include_inputs, input_path=input_path,
                            include_token_ids=include_token_ids, fmt=None if fmt == "auto" else fmt)
    if as_json:
        emit_json(report.to_dict())
        return
    partial = " (the job is not finished: this is what is committed so far)" if report.is_partial else ""
    click.echo(f"job {job_id}: wrote {report.num_rows:,} rows to {report.path} ({report.num_completed:,} completed, "
               f"{report.num_failed:,} failed){partial}")
