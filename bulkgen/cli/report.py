"""`bulkgen report`: a job's figures as one self-contained HTML page with plots, as JSON, or served live."""

from __future__ import annotations

import os
from pathlib import Path

import click

from bulkgen.cli.options import CONTEXT, JOB_ID, JobCommand, db_option, emit_json, json_option
from bulkgen.errors import ConfigError
from bulkgen.io.export import temporary_output
from bulkgen.report.figures import NUM_EXAMPLES, build_report, current_jobs
from bulkgen.report.plots import _matplotlib
from bulkgen.report.serve import ReportServer
from bulkgen.store.db import open_store


@click.command(cls=JobCommand, context_settings=CONTEXT)
@click.argument("job_ids", nargs=-1, type=JOB_ID)
@click.option("-o", "--output", type=click.Path(dir_okay=False, path_type=Path),
              help="The HTML file to write. Default: bulkgen-report-JOB.html (without --json or --serve).")
@click.option("--serve", is_flag=True, help="Serve the page from the database, its figures read again as workers "
                                            "run (Ctrl-C stops serving).")
@click.option("--host", default="127.0.0.1", show_default=True, help="With --serve: the address to bind.")
@click.option("--port", type=click.IntRange(0, 65535), default=8765, show_default=True,
              help="With --serve: the port (0: any free one).")
@click.option("--refresh", "refresh_s", type=click.FloatRange(min=1), default=5.0, show_default=True,
              help="With --serve: seconds between the page's reloads while a job runs.")
@click.option("--examples", "num_examples", type=click.IntRange(0, 1000), default=NUM_EXAMPLES, show_default=True,
              help="Sample rows shown: this many first rows and this many at random.")
@json_option
@db_option
def report(job_ids: tuple[int, ...], output: Path | None, serve: bool, host: str, port: int, refresh_s: float,
           num_examples: int, as_json: bool, db_url: str) -> None:
    """See what jobs did: throughput over time, lengths, latencies, finish reasons, failures, JSON validity,
    the runs' settings and sample rows, as one HTML page that opens offline (plots embedded). Without job
    ids: the jobs not finished yet, or else the newest job (with --serve: looked up again at each load).

    \b
    Example:
      bulkgen report 1 -o report.html
      bulkgen report 1 2 --json | jq '.jobs[].finish_reasons'
      bulkgen report 1 --serve          # http://127.0.0.1:8765/, refreshed while workers run
      bulkgen report --serve            # whatever is running now
    """
    store = open_store(db_url)
    ids = list(dict.fromkeys(job_ids))
    if not ids and not serve:
        ids = current_jobs(store)
    if serve:
        if output is not None or as_json:
            raise ConfigError("--serve serves the page (its figures at /report.json): leave out -o and --json")
        _serve(store, ids, host, port, refresh_s, num_examples)
        return
    path, tmp = None, None
    if output is not None or not as_json:  # where the page goes is checked before anything is built
        path, tmp = temporary_output(output or Path(f"bulkgen-report-{'-'.join(map(str, ids))}.html"),
                                     "write the report", "report.html")
    try:
        figures = build_report(store, ids, num_examples)
        if as_json:
            emit_json(figures)
        if tmp is None:
            return
        from bulkgen.report.page import render  # matplotlib, only for the page

        page = render(figures)
        Path(tmp).write_text(page, encoding="utf-8")
        os.replace(tmp, path)
    finally:
        if tmp is not None and os.path.exists(tmp):
            os.unlink(tmp)
    if not as_json:
        click.echo(f"report of job{'s' if len(ids) > 1 else ''} {', '.join(map(str, ids))}: {path} "
                   f"({len(page) / 1024:.0f} KiB, opens offline)")


def _serve(store, job_ids: list[int], host: str, port: int, refresh_s: float, num_examples: int) -> None:
    _matplotlib()  # refused now, not at the first page load
    build_report(store, job_ids or current_jobs(store), 0)  # a job that does not exist: refused before serving
    try:
        server = ReportServer(store, job_ids, host, port, refresh_s, num_examples)
    except OSError as exc:
        raise ConfigError(f"cannot serve on {host}:{port} ({exc.strerror or exc}): choose another --port") from exc
    which = f"job{'s' if len(job_ids) > 1 else ''} {', '.join(map(str, job_ids))}" if job_ids else \
        "the jobs not finished yet (or else the newest)"
    click.echo(f"serving the report of {which} at {server.url} (figures at {server.url}report.json; Ctrl-C stops)",
               err=True)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
