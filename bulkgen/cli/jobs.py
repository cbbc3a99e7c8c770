# Whole (over 300 lines): one module per noun, the CLI's rule; status's watch view is its largest part and belongs to
# status.
"""Commands on jobs: submit, list, status, cancel, retry."""

from __future__ import annotations

import json
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import click
from tqdm import tqdm

from bulkgen import plan as planner
from bulkgen.cli.options import CONTEXT, JOB_ID, JobCommand, db_option, emit_json, json_option
from bulkgen.config import EngineConfig
from bulkgen.io.rows import INPUT_FORMATS
from bulkgen.jobspec import build_spec
from bulkgen.progress import eta_s, format_duration
from bulkgen.store import jobs as job_ops
from bulkgen.store import runs
from bulkgen.store.db import open_store
from bulkgen.store.models import FINAL_JOB_STATES, JobStatus
from bulkgen.store.packings import DEFAULT_PACKING
from bulkgen.submission import submit_job


@click.command(context_settings=CONTEXT)
@click.argument("source", type=click.Path(path_type=Path))
@click.option("--name", help="A name for the job.")
@click.option("--model", help="Hub name (ORG/NAME, ORG/NAME@REVISION, ORG/NAME-GGUF:QUANT), alias, .gguf file or "
                             "Hugging Face directory. Default: BULKGEN_MODEL, else smollm2-135m-instruct.")
@click.option("--gguf-file", help="With a hub --model: the GGUF file of the repository to run (ORG/NAME:FILE).")
@click.option("--prompt-column", help="Column of raw prompt text (default: prompt).")
@click.option("--messages-column", help="Column of chat messages: a list of {role, content}.")
@click.option("--id-column", help="Column of your own row ids, kept in the results.")
@click.option("--max-new-tokens-column", help="Integer column with each row's own token budget.")
@click.option("--system-prompt", help="System message put before each conversation (chat rendering).")
@click.option("--chat/--no-chat", default=None, help="Render raw prompts as a user message with the chat template.")
@click.option("--n", type=int, help="Samples per row (needs --temperature > 0). Default 1.")
@click.option("--max-new-tokens", type=int, help="Tokens to generate at most per request. Default 128.")
@click.option("--temperature", type=float, help="0 (default) is greedy.")
@click.option("--top-p", type=float, help="Nucleus sampling, in (0, 1]. Default 1.")
@click.option("--top-k", type=int, help="Keep the k most likely tokens; 0 (default) is off.")
@click.option("--min-p", type=float, help="Drop tokens below min-p × the top probability; 0 is off.")
@click.option("--repetition-penalty", type=float, help="> 1 discourages repeats; 1 (default) is off.")
@click.option("--frequency-penalty", type=float, help="OpenAI's: in [-2, 2], minus this x each token's count in "
                                                    "the output so far; 0 (default) is off.")
@click.option("--presence-penalty", type=float, help="OpenAI's: in [-2, 2], minus this for each token already "
                                                   "in the output; 0 (default) is off.")
@click.option("--stop", multiple=True, help="Stop string (repeatable); removed from the output.")
@click.option("--stop-token-id", "stop_token_ids", type=int, multiple=True, help="Stop token id (repeatable).")
@click.option("--seed", type=int, help="Job seed; each request derives its own from it. Default 0.")
@click.option("--ignore-eos/--no-ignore-eos", default=None, help="Generate exactly max-new-tokens (benchmarks).")
@click.option("--logprobs", type=int, help="Keep the chosen token's log-probability and this many alternatives.")
@click.option("--json-schema", metavar="FILE_OR_JSON",
              help="Every output is JSON valid against this schema (a file, or the schema's JSON text).")
@click.option("--json-schema-column", help="String column with each row's own JSON schema.")
@click.option("--add-special-tokens/--no-add-special-tokens", default=None,
              help="Tokenizer special tokens (BOS). Default: on for raw text, off for chat-rendered text.")
@click.option("--input-format", type=click.Choice(INPUT_FORMATS),
              help="What the input file is. Default auto: .parquet, .jsonl/.ndjson, .csv by name (else by its "
                   "first bytes); a JSONL file of OpenAI batch requests is read as one.")
@click.option("--plan", "with_plan", is_flag=True,
              help="Then predict the run on this machine with run's default options (as `bulkgen plan JOB`).")
@json_option
@db_option
def submit(source: Path, as_json: bool, db_url: str, with_plan: bool, **options: Any) -> None:
    """Submit a Parquet, JSONL or CSV file of rows (or a job file, jobs/*.toml) as a job.

    Checks the file, its columns and every flag before writing anything. A bad row (null or empty
    prompt, a prompt too long for the model) becomes a failed request with its reason; the rest of
    the job goes on. Flags override a job file's settings.

    \b
    Example:
      bulkgen submit data.parquet --prompt-column question --max-new-tokens 256 --name qa
      bulkgen submit data.parquet --messages-column messages --temperature 0.7 --n 4
      bulkgen submit jobs/demo.toml --max-new-tokens 64
      bulkgen submit rows.jsonl --prompt-column text        # or rows.csv: streamed, same checks
    """
    spec = build_spec(source, options)
    store = open_store(db_url)
    with RowProgress("submit", unit="rows", enabled=not as_json) as advance:
        report = submit_job(store, spec, log=lambda m: click.echo(m, err=True), on_rows=advance)
    prediction = None
    if with_plan and report.num_requests > report.num_failed:
        _, (prediction,), _ = planner.plan_job(store, report.job_id, [(EngineConfig(), DEFAULT_PACKING)],
                                               log=lambda m: click.echo(m, err=True))
    if as_json:
        emit_json({**report.to_dict(), **({"plan": prediction.to_dict()} if prediction else {})})
        return
    failed = f", {report.num_failed:,} refused (see `bulkgen status {report.job_id}`)" if report.num_failed else ""
    click.echo(f"job {report.job_id}: {report.num_requests:,} requests from {report.num_rows:,} rows{failed}; "
               f"{report.num_prompt_tokens:,} prompt tokens; submitted in {report.seconds:.1f} s")
    if prediction is not None:
        click.echo(f"plan (this machine, run's default options): {planner.describe(prediction)}")
    click.echo(f"next: bulkgen run {report.job_id}")


@click.command("list", context_settings=CONTEXT)
@click.option("--limit", type=int, default=50, show_default=True, help="Newest jobs first, at most this many.")
@json_option
@db_option
def list_jobs(limit: int, as_json: bool, db_url: str) -> None:
    """List jobs, newest first, with their progress.

    \b
    Example:
      bulkgen list
      bulkgen list --json | jq '.[] | select(.status == "running") | .id'
    """
    store = open_store(db_url)
    with store.session_scope() as session:
        summaries = job_ops.describe_jobs(session, job_ops.list_jobs(session, limit))
    if as_json:
        emit_json(summaries)
        return
    if not summaries:
        click.echo("no jobs yet: `bulkgen submit FILE.parquet` creates one")
        return
    click.echo(f"{'ID':>4}  {'NAME':<20} {'STATUS':<10} {'DONE':>13} {'FAILED':>7}  {'CREATED':<20} MODEL")
    for s in summaries:
        done = f"{s['counts']['completed']}/{s['total']}"
        click.echo(f"{s['id']:>4}  {(s['name'] or '-')[:20]:<20} {s['status']:<10} {done:>13} "
                   f"{s['counts']['failed']:>7}  {s['created_at']:<20} {s['model']}")


@click.command(cls=JobCommand, context_settings=CONTEXT)
@click.argument("job_id", type=JOB_ID)
@click.option("--watch", is_flag=True, help="Redraw until the job is done: counts, the last minute's rate, ETA, "
                                            "workers, failures so far (Ctrl-C stops watching; the job goes on).")
@click.option("--interval", "interval_s", type=click.FloatRange(min=0.1), default=2.0, show_default=True,
              help="With --watch: seconds between redraws.")
@json_option
@db_option
def status(job_id: int, watch: bool, interval_s: float, as_json: bool, db_url: str) -> None:
    """Show a job: requests by state, tokens so far, throughput and ETA.

    \b
    Example:
      bulkgen status 1
      bulkgen status 1 --json | jq .counts.completed
      bulkgen status 1 --watch          # live, until the job is done (--json: a JSON line per redraw)
    """
    store = open_store(db_url)
    if watch:
        _watch(store, job_id, interval_s, as_json)
        return
    with store.session_scope() as session:
        summary = _summary(session, job_id)
        errors = job_ops.first_errors(session, job_id) if not as_json else []
    if as_json:
        emit_json(summary)
        return
    for line in _status_lines(summary, errors):
        click.echo(line)


def _summary(session: Any, job_id: int) -> dict[str, Any]:
    from bulkgen.store import runs  # here: the other commands of this module need none of it

    return runs.job_summary(session, job_ops.get_job(session, job_id))


def _workers_line(workers: list[dict[str, Any]]) -> str:
    said = {"working": "", "stalled": ", stalled: no progress since {progress_at} (its log says what it waits on)",
            "gone": ", gone (last heard of {heartbeat_at}: killed, or its machine went away): its requests go back to "
                    "the queue when a `bulkgen run` next looks (at once on this machine, else when their leases "
                    "expire)"}
    return f"workers holding requests: {len(workers)}" + "".join(
        f"\n  {w['worker_id']}: {w['num_requests']} request(s)" + said[w["state"]].format(**w) for w in workers)


def failed_line(summary: dict[str, Any]) -> str:
    """What can be done about the failed: `retry` for those a run can change, the input for the others."""
    failed, retryable = summary["counts"]["failed"], summary["num_retryable"]
    parts = [f"{retryable:,} can run again: `bulkgen retry {summary['id']}`"] if retryable else []
    if failed > retryable:
        parts.append(f"{failed - retryable:,} refused at submit for their input (fix those rows and submit them "
                     "again: retrying cannot change them)")
    return f"failed: {'; '.join(parts)}"


def _status_lines(summary: dict[str, Any], errors: list[tuple[int, int, str]]) -> list[str]:
    c = summary["counts"]
    rate = f" · {summary['output_tok_per_s']} output tok/s" if summary["output_tok_per_s"] is not None else ""
    eta = f" · ETA {format_duration(summary['eta_s'])}" if summary["eta_s"] is not None else ""
    lines = [f"job {summary['id']}" + (f" ({summary['name']})" if summary["name"] else "")
             + f": {summary['status']} · model {summary['model']}"
             + (f" (commit {summary['model_revision'][:12]})" if summary.get("model_revision") else ""),
             f"requests: {summary['total']:,} total · {c['completed']:,} completed · {c['failed']:,} failed · "
             f"{c['pending']:,} pending · {c['running']:,} running · {c['cancelled']:,} cancelled",
             f"tokens: {summary['num_prompt_tokens']:,} prompt · {summary['num_output_tokens']:,} output{rate}{eta}"]
    if c["failed"] and "num_retryable" in summary:
        lines.append(failed_line(summary))
    if summary.get("workers"):
        lines.append(_workers_line(summary["workers"]))
    return lines + [f"  failed row {row}" + (f" sample {sample}" if sample else "") + f": {error}"
                    for row, sample, error in errors]


def _watch(store: Any, job_id: int, interval_s: float, as_json: bool) -> None:
    """Redraw (a terminal) or print a line (a log, --json: a JSON line) every interval until the job is final."""
    import time

    redraw = sys.stdout.isatty() and not as_json
    try:
        while True:
            with store.session_scope() as session:
                summary = _summary(session, job_id)
                live = runs.recent(session, job_id)
                errors = job_ops.first_errors(session, job_id, 3)
            c = summary["counts"]
            remaining = c["pending"] + c["running"]
            if live["requests_per_s"] and remaining and summary["status"] == JobStatus.RUNNING:
                summary["eta_s"] = round(eta_s(remaining, live["requests_per_s"]), 1)  # at the last minute's pace
            summary["recent"] = live
            final = summary["status"] in FINAL_JOB_STATES
            if as_json:
                click.echo(json.dumps(summary, default=str))
            elif redraw:
                click.echo("\x1b[H\x1b[2J" + "\n".join(_watch_lines(summary, live, errors)))
            else:
                click.echo(_watch_line(summary, live))
            if final:
                return
            time.sleep(interval_s)
    except KeyboardInterrupt:
        pass


def _watch_lines(summary: dict[str, Any], live: dict[str, Any], errors: list[tuple[int, int, str]]) -> list[str]:
    c, total = summary["counts"], max(summary["total"], 1)
    done = c["completed"] + c["failed"]
    bar = "#" * int(30 * done / total) + "." * (30 - int(30 * done / total))
    rate = (f"{live['output_tok_per_s']:,.1f} output tok/s and {live['requests_per_s']:.2f} requests/s over the "
            f"last minute" if live["output_tok_per_s"] is not None else "no work in the last minute")
    eta = f" · ETA {format_duration(summary['eta_s'])}" if summary["eta_s"] is not None else ""
    lines = _status_lines(summary, [])
    lines[1:1] = [f"[{bar}] {100 * done / total:.0f}% · {rate}{eta}"]
    if c["failed"]:
        lines += [f"failed so far: {c['failed']} (`bulkgen report {summary['id']}` groups them)"]
        lines += [f"  row {row}" + (f" sample {sample}" if sample else "") + f": {error}"
                  for row, sample, error in errors]
    return lines + ["(watching: Ctrl-C stops watching; the job goes on)"]


def _watch_line(summary: dict[str, Any], live: dict[str, Any]) -> str:
    c = summary["counts"]
    rate = f" · {live['output_tok_per_s']:,.1f} output tok/s" if live["output_tok_per_s"] is not None else ""
    eta = f" · ETA {format_duration(summary['eta_s'])}" if summary["eta_s"] is not None else ""
    return (f"job {summary['id']}: {summary['status']} · {c['completed']}/{summary['total']} completed · "
            f"{c['failed']} failed · {c['pending']} pending · {c['running']} running{rate}{eta} · "
            f"{len(live['workers'])} worker(s)" +
            "".join(f" · {w['worker_id']} {w['state']}" for w in summary.get("workers", []) if w["state"] != "working"))


@click.command(cls=JobCommand, context_settings=CONTEXT)
@click.argument("job_id", type=JOB_ID)
@json_option
@db_option
def cancel(job_id: int, as_json: bool, db_url: str) -> None:
    """Cancel a job: workers stop taking its requests; committed results stay.

    \b
    Example:
      bulkgen cancel 1
    """
    store = open_store(db_url)
    with store.session_scope(write=True) as session:
        num_cancelled = job_ops.cancel_job(session, job_id)
    if as_json:
        emit_json({"job_id": job_id, "cancelled": num_cancelled})
    else:
        click.echo(f"job {job_id}: cancelled ({num_cancelled:,} requests not run)")


@click.command(cls=JobCommand, context_settings=CONTEXT)
@click.argument("job_id", type=JOB_ID)
@json_option
@db_option
def retry(job_id: int, as_json: bool, db_url: str) -> None:
    """Put a job's failed requests back in the queue (and a cancelled job's cancelled ones).

    \b
    Example:
      bulkgen retry 1 && bulkgen run 1
    """
    store = open_store(db_url)
    with store.session_scope(write=True) as session:
        num_requeued = job_ops.retry_job(session, job_id)
        num_left = job_ops.describe_jobs(session, [job_ops.get_job(session, job_id)])[0]["counts"]["failed"]
    if as_json:
        emit_json({"job_id": job_id, "requeued": num_requeued, "not_retried": num_left})
        return
    left = (f"; {num_left:,} failed request(s) stay failed: refused at submit for their input (a null or empty "
            "prompt, one too long for the model), which retrying cannot change; fix those rows and submit them "
            "again") if num_left else ""
    click.echo(f"job {job_id}: {num_requeued:,} requests back in the queue" +
               (f"; next: bulkgen run {job_id}" if num_requeued else "") + left)


class RowProgress:
    """A tqdm bar on a terminal, nothing otherwise (submit is quick next to a run)."""

    def __init__(self, desc: str, unit: str, enabled: bool) -> None:
        self.bar = tqdm(desc=desc, unit=unit, file=sys.stderr, leave=False) \
            if enabled and sys.stderr.isatty() else None

    def __enter__(self) -> Callable[[int], None]:
        return self.bar.update if self.bar is not None else (lambda n: None)

    def __exit__(self, *exc: object) -> None:
        if self.bar is not None:
            self.bar.close()
