"""The `bulkgen` command line, a module per noun (sqlite-utils style): jobs (submit, list, status, cancel,
retry), run, export, bench, db; what they share is in options.py. It is the only place that turns errors
into messages and exit codes: 0 success, 2 usage or input error, 1 anything else."""

from __future__ import annotations

import click

from bulkgen.cli.bench import bench
from bulkgen.cli.db import db
from bulkgen.cli.export import export
from bulkgen.cli.jobs import cancel, list_jobs, retry, status, submit
from bulkgen.cli.options import CONTEXT, BulkgenGroup
from bulkgen.cli.run import run


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


for command in (submit, list_jobs, status, run, export, bench, cancel, retry, db):
    cli.add_command(command)


def main() -> None:
    cli(prog_name="bulkgen")
