"""`bulkgen run`: the worker loop on this machine, or workers as Ray actors on a cluster."""

from __future__ import annotations

import logging
import sys
from collections.abc import Callable
from dataclasses import fields
from typing import Any

import click

from bulkgen.cli.options import (
    CONTEXT,
    JOB_ID,
    JobCommand,
    db_option,
    emit_json,
    engine_config,
    engine_options,
    json_option,
)
from bulkgen.config import EngineConfig
from bulkgen.outage import open_store_waiting
from bulkgen.ray import RayOptions, require_ray, run_on_ray
from bulkgen.store import jobs as job_ops
from bulkgen.store import queue as q
from bulkgen.store.db import Store
from bulkgen.store.packings import PACKINGS
from bulkgen.worker import Worker, WorkerOptions


def worker_options(func: Callable) -> Callable:
    """The worker's options: each flag's name is its WorkerOptions field's, and its default the field's own."""
    default = WorkerOptions()
    options = [
        click.option("--lease-seconds", type=float, default=default.lease_seconds, show_default=True,
                     help="A request's lease; a worker that stops heart-beating loses its requests after this."),
        click.option("--commit-every", type=int, default=default.commit_every, show_default=True,
                     help="Commit after this many results..."),
        click.option("--commit-interval", type=float, default=default.commit_interval, show_default=True,
                     help="...or this many seconds."),
        click.option("--max-attempts", type=int, default=default.max_attempts, show_default=True,
                     help="A request abandoned by this many crashed workers fails instead of returning."),
        click.option("--drain-timeout", type=float, default=default.drain_timeout, show_default=True,
                     help="On SIGINT/SIGTERM: seconds running requests may take to finish before being released."),
        click.option("--db-outage-s", type=float, default=default.db_outage_s, show_default=True,
                     help="How long the database may be unreachable (restarting, failing over, a dropped "
                          "connection) while the worker keeps generating and holds its results; past it the run "
                          "stops (0: at once)."),
        click.option("--stall-s", type=click.FloatRange(min=0, min_open=True), default=default.stall_s,
                     show_default=True,
                     help="A worker holding requests that makes no progress (no step, claim or commit) for this "
                          "long stops (exit 1) and its requests return to the queue; at a quarter of it, one line "
                          "says what it waits on."),
        click.option("--sample-every", type=click.FloatRange(min=0.1), default=default.sample_every,
                     show_default=True, help="Seconds between the run's samples (throughput, running sequences, "
                                             "KV use) kept for `bulkgen report` and `status --watch`."),
        click.option("--packing", type=click.Choice(PACKINGS), default=default.packing, show_default=True,
                     help="Admission order: lpt = most output tokens first; sorted = by prompt length; fifo = as "
                          "submitted."),
        click.option("--kv-admission/--no-kv-admission", default=default.kv_admission, show_default=True,
                     help="Admit a request only if the KV cache can hold it to its end (avoids preemption)."),
        click.option("--wait", is_flag=True, default=default.wait,
                     help="Keep waiting for new jobs instead of exiting when the queue is empty."),
        click.option("--log-every", type=click.FloatRange(min=0), default=default.log_every, show_default=True,
                     help="Seconds between progress lines when not on a terminal (0: a line every engine step)."),
        click.option("--progress/--no-progress", default=default.progress, help="Show progress on stderr."),
    ]
    for option in reversed(options):
        func = option(func)
    return func


# every field of WorkerOptions but the job ids (run's arguments) and two a test or the bench sets
WORKER_FLAGS = frozenset(f.name for f in fields(WorkerOptions)) - {"job_ids", "poll_s", "max_kept_rows"}


@click.command(cls=JobCommand, context_settings=CONTEXT)
@click.argument("job_ids", type=JOB_ID, nargs=-1)
@engine_options
@worker_options
@click.option("-v", "--verbose", is_flag=True,
              help="Say more on stderr: the CPU, and which path (C or torch) each kernel family took and why.")
@click.option("--ray", "use_ray", is_flag=True,
              help="Run the workers as Ray actors on a Ray cluster, all on this --db queue (bulkgen[ray]).")
@click.option("--workers", type=int, help="With --ray: how many workers (default: one per GPU Ray sees, else 1).")
@click.option("--ray-address", metavar="ADDR",
              help="With --ray: the cluster's head (default: a running cluster if any, else a local one).")
@click.option("--gpus-per-worker", type=float, help="With --ray: GPUs of each worker (default: 1 if the cluster "
                                                    "has GPUs, else 0).")
@click.option("--cpus-per-worker", type=float, default=1.0, show_default=True, help="With --ray: CPUs of each worker.")
@click.option("--max-restarts", type=int, default=3, show_default=True,
              help="With --ray: how often Ray restarts a worker whose process died.")
@json_option
@db_option
def run(job_ids: tuple[int, ...], as_json: bool, db_url: str, verbose: bool, use_ray: bool, workers: int | None,
        ray_address: str | None, gpus_per_worker: float | None, cpus_per_worker: float, max_restarts: int,
        **flags: Any) -> None:
    """Run queued jobs (all, or the given ones) until the queue is empty.

    Results are committed as they finish: kill the worker at any moment and run it again, and it
    carries on where it stopped, losing only what was in flight. SIGINT or SIGTERM stop it cleanly
    (a second Ctrl-C stops at once). Several workers may share one database.

    \b
    Example:
      bulkgen run
      bulkgen run 3 --kv-cache-memory 2GiB --max-num-seqs 64
      nohup bulkgen run --wait > worker.log 2>&1 &
      bulkgen run -v --kernels linear=torch     # the linear layers in torch; say why each path
      bulkgen run --ray --db postgresql+psycopg://user@host/bulkgen   # a worker per GPU of the Ray cluster
    """
    logging.basicConfig(level=logging.WARNING, format="%(message)s")
    if verbose:
        logging.getLogger("bulkgen").setLevel(logging.INFO)
    worker = {name: flags.pop(name) for name in WORKER_FLAGS}
    progress = worker["progress"] = worker["progress"] and not as_json
    config = engine_config(flags)  # a bad flag is refused before the database is touched
    options = WorkerOptions(job_ids=job_ids, **worker)
    ray_flags = {"--workers": workers, "--ray-address": ray_address, "--gpus-per-worker": gpus_per_worker}
    if not use_ray and any(value is not None for value in ray_flags.values()):
        raise click.UsageError(f"{', '.join(k for k, v in ray_flags.items() if v is not None)} go with --ray")
    if use_ray:
        ray_options = RayOptions(workers, ray_address, gpus_per_worker, cpus_per_worker, max_restarts)
        require_ray()
    store = open_store_waiting(db_url, options.db_outage_s)
    if job_ids:
        with store.session_scope() as session:
            for job_id in job_ids:
                job_ops.get_job(session, job_id)
    if use_ray:
        _run_on_ray(store, db_url, config, options, ray_options, progress, as_json)
        return
    summary = Worker(store, config, options).run()
    if as_json:
        emit_json(summary.to_dict())
    else:
        click.echo(summary.line(), err=True)


def _run_on_ray(store: Store, db_url: str, config: EngineConfig, options: WorkerOptions, ray_options: RayOptions,
                progress: bool, as_json: bool) -> None:
    summary = run_on_ray(store, db_url, config, options, ray_options, progress)
    if as_json:
        emit_json(summary.to_dict())
    else:
        click.echo(summary.line(), err=True)
    if summary.errors:
        with store.session_scope() as session:
            jobs = list(options.job_ids) or [job.id for job in q.runnable_jobs(session)]
            left = q.queue_totals(session, jobs).num_pending if jobs else 0
        for error in summary.errors:
            click.echo(f"error: a worker stopped for good: {error}", err=True)
        if left:
            click.echo(f"error: {left} requests are left in the queue; `bulkgen run` again finishes them", err=True)
        sys.exit(1)
