"""The `bulkgen` command line, a module per noun (sqlite-utils style): jobs (submit, list, status, cancel,
retry), run, export, report, bench, db; what they share is in options.py. It is the only place that turns errors
into messages and exit codes: 0 success, 2 usage or input error, 1 anything else. Each command's module
is imported when that command runs (BulkgenGroup's `lazy`), so `bench suite` needs none of the others'
packages (the database's, on a GPU machine)."""

from __future__ import annotations

import click

from bulkgen.cli.options import CONTEXT, BulkgenGroup

COMMANDS = {
    "submit": "bulkgen.cli.jobs:submit", "list": "bulkgen.cli.jobs:list_jobs", "status": "bulkgen.cli.jobs:status",
    "cancel": "bulkgen.cli.jobs:cancel", "retry": "bulkgen.cli.jobs:retry", "run": "bulkgen.cli.run:run",
    "export": "bulkgen.cli.export:export", "bench": "bulkgen.cli.bench:bench", "db": "bulkgen.cli.db:db",
    "report": "bulkgen.cli.report:report", "plan": "bulkgen.cli.plan:plan",
}


@click.group(cls=BulkgenGroup, lazy=COMMANDS, context_settings=CONTEXT)
@click.version_option(package_name="bulkgen")
def cli() -> None:
    """bulkgen: run a language model over a whole dataset as a resumable overnight job.

    \b
    Example:
      bulkgen submit examples/data/prompts.parquet --chat --max-new-tokens 128 --name demo
      bulkgen run
      bulkgen export 1 -o demo.out.parquet
    """


def main() -> None:
    cli(prog_name="bulkgen")
