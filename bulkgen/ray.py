"""Scale-out on Ray: queue workers as Ray actors (`bulkgen run --ray`), and the engine as a Ray Data stage.

The queue (one database URL) stays the only coordination. Each actor runs today's worker loop (worker.py:
its own engine, lease and heartbeat) against the same --db; the driver places the actors, shows one
progress line for the whole queue (tokens/s summed over the actors, requests done read from the database),
drains every actor on SIGINT/SIGTERM, and prints one summary. An actor that dies (its process killed, its
node lost) is restarted by Ray, up to a limit, and its run retried; its leases go back to the queue (at
once on its own node, where the new worker sees the old process gone; else when they expire).

Ray is an optional dependency (`pip install 'bulkgen[ray]'`): this module imports it only when called.
(Just over 300 lines: the placement, the actor and the driver belong together; the Ray Data stage is
api.Generate.)
"""

from __future__ import annotations

import logging
import os
import sys
import time
from dataclasses import dataclass
from typing import Any

from bulkgen.api import OUTPUT_COLUMNS, Generate  # the engine as a Ray Data stage (it needs no Ray itself)
from bulkgen.config import EngineConfig
from bulkgen.errors import BulkgenError, ConfigError, StoreError
from bulkgen.hub import pinned_model
from bulkgen.lease import on_stop_signals
from bulkgen.outage import Outage, open_store_waiting
from bulkgen.progress import Progress
from bulkgen.store import jobs as job_ops
from bulkgen.store import queue as q
from bulkgen.store.db import Store
from bulkgen.summary import RaySummary
from bulkgen.worker import Worker, WorkerOptions

__all__ = ["OUTPUT_COLUMNS", "Generate", "RayOptions", "generate", "run_on_ray"]

log = logging.getLogger(__name__)

EXTRA = "pip install 'bulkgen[ray]'"
POLL_S = 1.0  # how often the driver reads the queue and the actors' counters


def require_ray(what: str = "--ray") -> Any:
    try:
        import ray
    except ImportError as exc:
        raise ConfigError(f"{what} needs Ray, which is not installed: {EXTRA}") from exc
    return ray


@dataclass(frozen=True)
class RayOptions:
    workers: int | None = None  # None: one per GPU the cluster has, else 1
    address: str | None = None  # None: join a running cluster if there is one, else start a local one
    gpus_per_worker: float | None = None  # None: 1 where the cluster has GPUs, else 0
    cpus_per_worker: float = 1.0
    max_restarts: int = 3  # of each actor, after its process dies

    def __post_init__(self) -> None:
        if self.workers is not None and self.workers < 1:
            raise ConfigError(f"--workers must be at least 1, got {self.workers}")
        if self.gpus_per_worker is not None and self.gpus_per_worker < 0:
            raise ConfigError(f"--gpus-per-worker must be >= 0, got {self.gpus_per_worker}")
        if self.cpus_per_worker <= 0:
            raise ConfigError(f"--cpus-per-worker must be > 0, got {self.cpus_per_worker}")
        if self.max_restarts < 0:
            raise ConfigError(f"--max-restarts must be >= 0, got {self.max_restarts}")


def connect(address: str | None) -> Any:
    """Join the cluster at `address`; without one, a running cluster if there is one, else a new local one."""
    ray = require_ray()
    if ray.is_initialized():
        return ray
    quiet = dict(logging_level=logging.WARNING, log_to_driver=True)
    try:
        if address:
            ray.init(address=address, **quiet)
        else:
            try:
                ray.init(address="auto", **quiet)
            except ConnectionError:
                ray.init(include_dashboard=False, **quiet)
    except (ConnectionError, ValueError, RuntimeError) as exc:
        raise ConfigError(f"cannot join the Ray cluster at {address or 'auto'}: {str(exc).splitlines()[0]}; "
                          "give --ray-address HOST:PORT of its head (ray start --head prints it)") from exc
    return ray


@dataclass(frozen=True)
class Placement:
    workers: int
    gpus_per_worker: float
    cpus_per_worker: float
    node_id: str | None  # every actor on this node (a SQLite database: one file on one disk)
    num_nodes: int


def place(ray: Any, options: RayOptions, sqlite: bool) -> Placement:
    """How many actors, with what, where; refused here (before any actor starts) if the cluster cannot hold
    them, or if a SQLite database would need workers on several nodes."""
    nodes = [n for n in ray.nodes() if n.get("Alive")]
    total = ray.cluster_resources()
    gpus_total, cpus_total = float(total.get("GPU", 0)), float(total.get("CPU", 0))
    gpus = options.gpus_per_worker if options.gpus_per_worker is not None else (1.0 if gpus_total else 0.0)
    workers = options.workers or (max(1, int(gpus_total // gpus)) if gpus else 1)
    if workers * gpus > gpus_total:
        raise ConfigError(f"--workers {workers} with {gpus:g} GPUs each needs {workers * gpus:g} GPUs; the Ray "
                          f"cluster has {gpus_total:g}: lower --workers or --gpus-per-worker")
    if workers * options.cpus_per_worker > cpus_total:
        raise ConfigError(f"--workers {workers} with {options.cpus_per_worker:g} CPUs each needs "
                          f"{workers * options.cpus_per_worker:g} CPUs; the Ray cluster has {cpus_total:g}: lower "
                          "--workers or --cpus-per-worker")
    node_id = None
    if sqlite and len(nodes) > 1:
        node_id = ray.get_runtime_context().get_node_id()
        here = next((n.get("Resources", {}) for n in nodes if n.get("NodeID") == node_id), {})
        if workers * gpus > here.get("GPU", 0) or workers * options.cpus_per_worker > here.get("CPU", 0):
            raise ConfigError(f"a SQLite database is one file on one disk: {workers} workers do not fit on this "
                              f"node of the {len(nodes)}-node Ray cluster, and workers on other nodes cannot share "
                              "the file; use a PostgreSQL --db (bulkgen[postgres]) to run on several nodes")
    return Placement(workers, gpus, options.cpus_per_worker, node_id, len(nodes))


class QueueWorker:
    """A Ray actor running one worker loop. Threaded (two calls at once), so that `stop` and `counters`
    reach it while `run` works."""

    def __init__(self, db_url: str, engine_config: EngineConfig, options: WorkerOptions) -> None:
        logging.basicConfig(level=logging.WARNING, format="%(message)s")
        self.store = open_store_waiting(db_url, options.db_outage_s)
        self.engine_config, self.options = engine_config, options
        self.worker = None
        self.stopping = False

    def run(self) -> dict[str, Any]:
        self.worker = Worker(self.store, self.engine_config, self.options)
        if self.stopping:
            self.worker.stop("driver")
        summary = self.worker.run().to_dict()
        summary["node"] = os.uname().nodename
        return summary

    def stop(self) -> None:
        self.stopping = True
        if self.worker is not None:
            self.worker.stop("driver")

    def counters(self) -> int:
        """Output tokens generated so far (committed or not)."""
        return self.worker.num_generated if self.worker is not None else 0


def run_on_ray(store: Store, db_url: str, engine_config: EngineConfig, options: WorkerOptions,
               ray_options: RayOptions, progress: bool = True) -> RaySummary:
    """Start the actors, follow the queue until every actor's run ends (or a signal drains them)."""
    ray = connect(ray_options.address)
    placement = place(ray, ray_options, store.is_sqlite)
    actor_options: dict[str, Any] = dict(num_cpus=placement.cpus_per_worker, num_gpus=placement.gpus_per_worker,
                                         max_restarts=ray_options.max_restarts,
                                         max_task_retries=ray_options.max_restarts, max_concurrency=3)
    if placement.node_id is not None:
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        actor_options["scheduling_strategy"] = NodeAffinitySchedulingStrategy(placement.node_id, soft=False)
    actor_class = ray.remote(QueueWorker)
    worker_options = WorkerOptions(**{**options.__dict__, "progress": False})
    actors = [actor_class.options(**actor_options).remote(db_url, engine_config, worker_options)
              for _ in range(placement.workers)]
    runs = {actor.run.remote(): actor for actor in actors}
    follower = _Follower(store, list(options.job_ids), progress, options.log_every)
    follower.begin(f"bulkgen run --ray: {placement.workers} workers ({placement.gpus_per_worker:g} GPU, "
                   f"{placement.cpus_per_worker:g} CPU each) on {placement.num_nodes} node(s), queue {store.url}")
    stop = _DriverSignals(actors)
    start = time.monotonic()
    per_worker: list[dict[str, Any]] = []
    errors: list[str] = []
    try:
        pending = list(runs)
        while pending:
            done, pending = ray.wait(pending, num_returns=len(pending), timeout=POLL_S)
            for ref in done:
                try:
                    per_worker.append(ray.get(ref))
                except ray.exceptions.RayError as exc:
                    errors.append(_first_line(exc))
            follower.poll([a for ref, a in runs.items() if ref in pending], ray)
    finally:
        stop.restore()
        follower.close()
    return RaySummary(placement.workers, placement.num_nodes, per_worker, time.monotonic() - start, errors,
                      stop.signal_name, follower.outage.num_outages, follower.outage.seconds_down)


class _Follower:
    """The driver's one progress line: requests done and their tokens from the database, tokens generated
    but not yet committed from the actors' counters."""

    def __init__(self, store: Store, job_ids: list[int], enabled: bool, log_every_s: float) -> None:
        self.store, self.job_ids = store, job_ids
        totals, self.tokens = self._read()
        self.progress = Progress(totals.num_requests, totals.num_done, totals.budget_left, enabled=enabled,
                                 log_every_s=log_every_s)
        self.done, self.budget_left, self.generated = totals.num_done, totals.budget_left, 0
        self.outage = Outage(float("inf"), say=False)  # the driver follows; the actors' own --db-outage-s decides

    def _read(self) -> tuple[q.QueueTotals, int]:
        started = time.monotonic()
        with self.store.session_scope() as session:
            jobs = self.job_ids or [job.id for job in q.runnable_jobs(session)]
            totals = q.queue_totals(session, jobs)
            tokens = sum(output for _, output in job_ops.token_totals(session, jobs).values())
        if not self.job_ids and jobs:
            self.job_ids = jobs  # the jobs this run found; finished ones stay counted
        # counting a job's requests grows with the job: read a huge queue less often than every second
        self.next_read = time.monotonic() + max(POLL_S, 20 * (time.monotonic() - started))
        return totals, tokens

    def begin(self, text: str) -> None:
        self.progress.begin(text)

    def poll(self, actors: list[Any], ray: Any) -> None:
        try:
            generated = sum(ray.get([a.counters.remote() for a in actors], timeout=POLL_S)) if actors else 0
        except ray.exceptions.RayError:
            generated = self.generated  # an actor restarting: its counter returns with it
        if generated > self.generated:
            self.progress.generated(generated - self.generated)
        self.generated = generated
        if time.monotonic() < self.next_read:
            return
        try:
            totals, tokens = self._read()
        except StoreError as exc:  # the actors wait it out (worker.py); the driver says so on its line
            self.outage.failed(exc)
            self.progress.status = self.outage.status()
            self.next_read = time.monotonic() + POLL_S
            return
        self.outage.ok()
        self.progress.status = None
        if totals.num_done > self.done:
            self.progress.finished(totals.num_done - self.done, tokens - self.tokens,
                                   max(0, self.budget_left - totals.budget_left))
        self.done, self.budget_left, self.tokens = totals.num_done, totals.budget_left, tokens

    def close(self) -> None:
        self.progress.close()


class _DriverSignals:
    """SIGINT/SIGTERM to the driver drain every actor (each finishes what runs, gives back the rest); a second
    SIGINT kills them at once (their leases then expire, as after a crash)."""

    def __init__(self, actors: list[Any]) -> None:
        self.actors = actors
        self.signal_name: str | None = None
        self.restore = on_stop_signals(self._drain, lambda: self.signal_name is not None, self._kill)

    def _drain(self, name: str) -> None:
        self.signal_name = name
        print(f"bulkgen: {name}: every worker finishes its running requests, then stops; Ctrl-C again to stop "
              "at once", file=sys.stderr, flush=True)
        for actor in self.actors:
            actor.stop.remote()

    def _kill(self) -> None:
        import ray  # here: the driver has imported it (require_ray); bulkgen imports without Ray

        for actor in self.actors:
            ray.kill(actor, no_restart=True)


def _first_line(exc: BaseException) -> str:
    cause = getattr(exc, "cause", None)
    if isinstance(cause, BulkgenError):
        return str(cause)
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


# ---------------------------------------------------------------------------------------------- Ray Data

def generate(dataset: Any, *, concurrency: int = 1, num_gpus: float | None = None, num_cpus: float | None = None,
             batch_size: int = 256, **options: Any) -> Any:
    """dataset.map_batches(Generate, ...): the dataset with export's output columns added, computed by
    `concurrency` engine actors (one GPU each where the cluster has GPUs, unless num_gpus says otherwise).
    Options: Generate's (model, prompt_column, chat, sampling={...}, engine={...}, ...)."""
    ray = require_ray("bulkgen.ray.generate")
    if num_gpus is None:
        num_gpus = 1.0 if ray.is_initialized() and ray.cluster_resources().get("GPU", 0) else 0.0
    resources: dict[str, Any] = {"num_gpus": num_gpus}
    options["model"] = pinned_model(options.get("model"))  # every actor, on any node, runs the same commit
    if num_cpus is not None:
        resources["num_cpus"] = num_cpus
    return dataset.map_batches(Generate, fn_constructor_kwargs=options, batch_format="pyarrow",
                               batch_size=batch_size, concurrency=concurrency, **resources)
