"""The `bulkgen` command line. The only place that turns errors into messages and exit codes:
0 success, 2 usage or input error, 1 anything else."""

from __future__ import annotations

import functools
import json
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import click

from bulkgen.config import Paths
from bulkgen.errors import BulkgenError

CONTEXT = {"help_option_names": ["-h", "--help"], "max_content_width": 100}


class BulkgenGroup(click.Group):
    def invoke(self, ctx: click.Context) -> Any:
        try:
            return super().invoke(ctx)
        except BulkgenError as exc:
            click.echo(f"error: {exc}", err=True)
            ctx.exit(exc.exit_code)


@click.group(cls=BulkgenGroup, context_settings=CONTEXT)
@click.version_option(package_name="bulkgen")
def cli() -> None:
    """bulkgen: run a language model over a whole dataset as a resumable overnight job.

    \b
    Example:
      bulkgen submit examples/data/prompts.parquet --chat --max-new-tokens 128 --name demo
      bulkgen run
      bulkgen export 1 -o demo.out.parquet
    """


def db_option(func: Callable) -> Callable:
    @click.option("--db", "db_url", envvar="BULKGEN_DB", metavar="URL",
                  help="Database URL (env BULKGEN_DB). Default: sqlite:///~/.local/share/bulkgen/bulkgen.db")
    @functools.wraps(func)
    def wrapper(*args: Any, db_url: str | None, **kwargs: Any) -> Any:
        return func(*args, db_url=db_url or Paths().default_db_url, **kwargs)

    return wrapper


def json_option(func: Callable) -> Callable:
    return click.option("--json", "as_json", is_flag=True, help="Print JSON for scripts.")(func)


def open_db(db_url: str):
    from bulkgen.store import open_store

    return open_store(db_url)


def emit_json(data: Any) -> None:
    click.echo(json.dumps(data, indent=2, default=str))


# ---------------------------------------------------------------------------------------------- submit


@cli.command(context_settings=CONTEXT)
@click.argument("source", type=click.Path(path_type=Path))
@click.option("--name", help="A name for the job.")
@click.option("--model", help="Alias, .gguf file or Hugging Face directory. Default: smollm2-135m-instruct.")
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
@click.option("--stop", multiple=True, help="Stop string (repeatable); removed from the output.")
@click.option("--stop-token-id", "stop_token_ids", type=int, multiple=True, help="Stop token id (repeatable).")
@click.option("--seed", type=int, help="Job seed; each request derives its own from it. Default 0.")
@click.option("--ignore-eos/--no-ignore-eos", default=None, help="Generate exactly max-new-tokens (benchmarks).")
@click.option("--logprobs", type=int, help="Keep the chosen token's log-probability and this many alternatives.")
@click.option("--add-special-tokens/--no-add-special-tokens", default=None,
              help="Tokenizer special tokens (BOS). Default: on for raw text, off for chat-rendered text.")
@json_option
@db_option
def submit(source: Path, as_json: bool, db_url: str, **options: Any) -> None:
    """Submit a Parquet file (or a job file, jobs/*.toml) as a job.

    Checks the file, its columns and every flag before writing anything. A bad row (null or empty
    prompt, a prompt too long for the model) becomes a failed request with its reason; the rest of
    the job goes on. Flags override a job file's settings.

    \b
    Example:
      bulkgen submit data.parquet --prompt-column question --max-new-tokens 256 --name qa
      bulkgen submit data.parquet --messages-column messages --temperature 0.7 --n 4
      bulkgen submit jobs/demo.toml --max-new-tokens 64
    """
    from bulkgen.jobspec import build_spec
    from bulkgen.submit import submit_job

    spec = build_spec(source, options)
    store = open_db(db_url)
    with _row_progress("submit", unit="rows", enabled=not as_json) as advance:
        report = submit_job(store, spec, log=lambda m: click.echo(m, err=True), on_rows=advance)
    if as_json:
        emit_json(report.to_dict())
        return
    failed = f", {report.num_failed} refused (see `bulkgen status {report.job_id}`)" if report.num_failed else ""
    click.echo(f"job {report.job_id}: {report.num_requests} requests from {report.num_rows} rows{failed}; "
               f"{report.num_prompt_tokens:,} prompt tokens; submitted in {report.seconds:.1f} s")
    click.echo(f"next: bulkgen run {report.job_id}")


# ----------------------------------------------------------------------------------------- list, status


@cli.command("list", context_settings=CONTEXT)
@click.option("--limit", type=int, default=50, show_default=True, help="Newest jobs first, at most this many.")
@json_option
@db_option
def list_cmd(limit: int, as_json: bool, db_url: str) -> None:
    """List jobs, newest first, with their progress.

    \b
    Example:
      bulkgen list
      bulkgen list --json | jq '.[] | select(.status == "running") | .id'
    """
    from bulkgen.store import jobs as job_ops

    store = open_db(db_url)
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


@cli.command(context_settings=CONTEXT)
@click.argument("job_id", type=int)
@json_option
@db_option
def status(job_id: int, as_json: bool, db_url: str) -> None:
    """Show a job: requests by state, tokens so far, throughput and ETA.

    \b
    Example:
      bulkgen status 1
      bulkgen status 1 --json | jq .counts.completed
    """
    from bulkgen.store import jobs as job_ops

    store = open_db(db_url)
    with store.session_scope() as session:
        summary = job_ops.describe_jobs(session, [job_ops.get_job(session, job_id)])[0]
        errors = _first_errors(session, job_id) if not as_json else []
    if as_json:
        emit_json(summary)
        return
    c = summary["counts"]
    click.echo(f"job {summary['id']}" + (f" ({summary['name']})" if summary["name"] else "")
               + f": {summary['status']} · model {summary['model']}")
    click.echo(f"requests: {summary['total']} total · {c['completed']} completed · {c['failed']} failed · "
               f"{c['pending']} pending · {c['running']} running · {c['cancelled']} cancelled")
    rate = f" · {summary['output_tok_per_s']} output tok/s" if summary["output_tok_per_s"] is not None else ""
    eta = f" · ETA {_duration(summary['eta_s'])}" if summary["eta_s"] is not None else ""
    click.echo(f"tokens: {summary['num_prompt_tokens']:,} prompt · {summary['num_output_tokens']:,} output"
               f"{rate}{eta}")
    for row, sample, error in errors:
        click.echo(f"  failed row {row}" + (f" sample {sample}" if sample else "") + f": {error}")


def _first_errors(session, job_id: int, limit: int = 5) -> list[tuple[int, int, str]]:
    from sqlalchemy import select

    from bulkgen.store.models import Request, RequestState

    query = (select(Request.row, Request.sample, Request.error)
             .where(Request.job_id == job_id, Request.state == RequestState.FAILED.value)
             .order_by(Request.row, Request.sample).limit(limit))
    return [tuple(r) for r in session.execute(query)]


# ---------------------------------------------------------------------------------------- cancel, retry


@cli.command(context_settings=CONTEXT)
@click.argument("job_id", type=int)
@json_option
@db_option
def cancel(job_id: int, as_json: bool, db_url: str) -> None:
    """Cancel a job: workers stop taking its requests; committed results stay.

    \b
    Example:
      bulkgen cancel 1
    """
    from bulkgen.store import jobs as job_ops

    store = open_db(db_url)
    with store.session_scope(write=True) as session:
        num_cancelled = job_ops.cancel_job(session, job_id)
    if as_json:
        emit_json({"job_id": job_id, "cancelled": num_cancelled})
    else:
        click.echo(f"job {job_id}: cancelled ({num_cancelled} requests not run)")


@cli.command(context_settings=CONTEXT)
@click.argument("job_id", type=int)
@json_option
@db_option
def retry(job_id: int, as_json: bool, db_url: str) -> None:
    """Put a job's failed requests back in the queue (and a cancelled job's cancelled ones).

    \b
    Example:
      bulkgen retry 1 && bulkgen run 1
    """
    from bulkgen.store import jobs as job_ops

    store = open_db(db_url)
    with store.session_scope(write=True) as session:
        num_requeued = job_ops.retry_job(session, job_id)
    if as_json:
        emit_json({"job_id": job_id, "requeued": num_requeued})
    else:
        click.echo(f"job {job_id}: {num_requeued} requests back in the queue" +
                   ("; next: bulkgen run" if num_requeued else ""))


# ------------------------------------------------------------------------------------------------- db


@cli.group(cls=BulkgenGroup, context_settings=CONTEXT)
def db() -> None:
    """Manage the job database's schema (it is also upgraded automatically on open).

    \b
    Example:
      bulkgen db current
      bulkgen db upgrade --db postgresql+psycopg://user@host/bulkgen
    """


@db.command(context_settings=CONTEXT)
@db_option
def upgrade(db_url: str) -> None:
    """Bring the database schema to the newest revision.

    \b
    Example:
      bulkgen db upgrade
    """
    from bulkgen.store import migrate
    from bulkgen.store.db import create_db_engine

    engine = create_db_engine(db_url)
    migrate.upgrade(engine)
    click.echo(f"{_hide_password(db_url)}: at revision {migrate.current_revision(engine)}")


@db.command(context_settings=CONTEXT)
@json_option
@db_option
def current(as_json: bool, db_url: str) -> None:
    """Show the database's schema revision and the newest one this bulkgen knows.

    \b
    Example:
      bulkgen db current
    """
    from bulkgen.store import migrate
    from bulkgen.store.db import create_db_engine

    revision = migrate.current_revision(create_db_engine(db_url))
    head = migrate.head_revision()
    if as_json:
        emit_json({"url": _hide_password(db_url), "current": revision, "head": head})
        return
    state = "up to date" if revision == head else f"behind head {head} (run `bulkgen db upgrade`)"
    click.echo(f"{_hide_password(db_url)}: revision {revision or '(empty)'}, {state}")


# ---------------------------------------------------------------------------------------------- helpers


class _row_progress:
    """A tqdm bar on a terminal, nothing otherwise (submit is quick next to a run)."""

    def __init__(self, desc: str, unit: str, enabled: bool) -> None:
        self.bar = None
        if enabled and sys.stderr.isatty():
            from tqdm import tqdm

            self.bar = tqdm(desc=desc, unit=unit, file=sys.stderr, leave=False)

    def __enter__(self) -> Callable[[int], None]:
        return self.bar.update if self.bar is not None else (lambda n: None)

    def __exit__(self, *exc: object) -> None:
        if self.bar is not None:
            self.bar.close()


def _duration(seconds: float) -> str:
    seconds = int(seconds)
    if seconds < 60:
        return f"{seconds}s"
    if seconds < 3600:
        return f"{seconds // 60}m{seconds % 60:02d}s"
    return f"{seconds // 3600}h{seconds % 3600 // 60:02d}m"


def _hide_password(url: str) -> str:
    from sqlalchemy.engine import make_url

    try:
        return make_url(url).render_as_string(hide_password=True)
    except Exception:
        return url


def main() -> None:
    cli(prog_name="bulkgen")


if __name__ == "__main__":
    main()
