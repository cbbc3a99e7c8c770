# Whole (over 300 lines): its loop and the helpers the loop calls share one worker's state (engine, writer, pace,
# outage); writer, lease, liveness, outage, progress and recorder are already rooms of their own.
"""The worker: the only module that joins the store and the engine. Its loop reads as
claim -> add -> step -> write:

- claim: lease pending requests of the runnable jobs, as many as the engine can run soon and no more
  than a fair share among live workers (`claim_target`), in the packer's order;
- add: hand them to the engine (a prompt too long for this run's context fails at once);
- step: one engine step;
- write: finished outputs become result rows, committed in small transactions (writer.py), so a crash
  loses at most what was generated since the last commit and never a committed row.

A database that goes away (a restart, a failover, a dropped connection) is waited out (outage.py): the loop
claims nothing, keeps stepping what it holds, keeps the rows, and its next write is the probe; each store call
goes through `_db`, which starts, extends or ends the outage.

What the run did, interval by interval (tokens, running sequences, KV use), is summed by recorder.py and
written with the commits, for `bulkgen report`. The lease and its heartbeat, and the signals that drain a
run, live in lease.py. (Over 300 lines: the loop's named steps, its shutdown and the run's options and
summary stay together, one class that a reader follows top to bottom.)
"""

from __future__ import annotations

import logging
import os
import socket
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from bulkgen.config import EngineConfig, SamplingParams, request_sampling
from bulkgen.engine.protocol import EngineProtocol, FinishReason
from bulkgen.errors import ConfigError, PromptTooLongError, StoreError
from bulkgen.lease import Heartbeat, on_stop_signals
from bulkgen.liveness import Liveness, StalledError
from bulkgen.outage import Outage
from bulkgen.packing import admission_for, check_packing, claim_target
from bulkgen.progress import Progress
from bulkgen.recorder import SAMPLE_INTERVAL_S, Recorder
from bulkgen.resolve import model_dir
from bulkgen.store import queue as q
from bulkgen.store import runs
from bulkgen.store.db import Store
from bulkgen.store.models import Job, unpack_ids
from bulkgen.store.packings import DEFAULT_PACKING
from bulkgen.summary import RunSummary
from bulkgen.writer import Flushed, ResultWriter

log = logging.getLogger(__name__)

SIZING_INTERVAL_S = 1.0  # how often the claim target is recomputed from the queue


@dataclass(frozen=True)
class WorkerOptions:
    job_ids: tuple[int, ...] = ()  # empty: every runnable job
    lease_seconds: float = 60.0
    commit_every: int = 256
    commit_interval: float = 2.0
    max_attempts: int = 3
    drain_timeout: float = 30.0  # on SIGINT/SIGTERM: how long running sequences may finish
    packing: str = DEFAULT_PACKING  # claim and admission order (bulkgen.packing)
    kv_admission: bool = True  # admit only what the KV cache can hold to the end (no preemption)
    wait: bool = False  # when the queue is empty, wait for new work instead of exiting
    poll_s: float = 2.0
    progress: bool = True
    log_every: float = 30.0
    db_outage_s: float = 900.0  # how long the database may be away before the run stops (transient errors only)
    max_kept_rows: int = 4096  # rows kept while the database is away; past them the engine pauses
    sample_every: float = SAMPLE_INTERVAL_S  # how often the run's samples are closed (recorder.py)
    stall_s: float = 600.0  # holding work without progress this long: stalled, the run stops (liveness.py)

    def __post_init__(self) -> None:
        if self.lease_seconds <= 0 or self.commit_every < 1 or self.commit_interval <= 0 or self.max_attempts < 1 \
                or self.sample_every <= 0 or self.stall_s <= 0:
            raise ConfigError("lease, commit, sample and stall intervals and commit rows must be positive, "
                              "max attempts >= 1")
        if self.db_outage_s < 0:
            raise ConfigError(f"--db-outage-s must be >= 0 (0: stop at the first database error), got "
                              f"{self.db_outage_s:g}")
        check_packing(self.packing)


class Worker:
    def __init__(self, store: Store, engine_config: EngineConfig, options: WorkerOptions | None = None,
                 engine_factory: Callable[[str, EngineConfig], EngineProtocol] | None = None) -> None:
        self.store = store
        self.engine_config = engine_config
        self.options = options or WorkerOptions()
        self.worker_id = f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:8]}"
        self.summary = RunSummary(self.worker_id)
        self._engine_factory = engine_factory or (lambda path, config: _default_engine(
            path, config, self.options.kv_admission, self.options.packing))
        # Only the default factory loads weights, so only it needs the model on this machine (resolve.model_dir);
        # a caller's own factory (the queue bench's, tests') gets the job's stored path as it is.
        self._fetches_models = engine_factory is None
        self._engines: dict[str, EngineProtocol] = {}
        self._stop_requested: str | None = None
        self._stop_time = 0.0
        self.writer = ResultWriter(store, self.worker_id, self.options.commit_every, self.options.commit_interval)
        self._progress: Progress | None = None
        self.num_generated = 0  # output tokens generated in this run, committed or not (a Ray driver sums them)
        self.outage = Outage(self.options.db_outage_s)
        self.recorder = Recorder(self.worker_id, self.options.sample_every)
        self.liveness = Liveness(self.options.stall_s, self.options.lease_seconds,
                                 holding=lambda: (self.writer.num_held, self.writer.num_rows),
                                 waiting_out=lambda: self.outage.down)
        self._said: set[tuple[str, tuple[int, ...]]] = set()  # the start lines said (once a model and jobs)
        self._waiting_said: dict[str, int] | None = None  # what the last "waiting" line said
        self._outage_ended = False  # the leases are reconciled at once after an outage

    # ------------------------------------------------------------------ the run

    def run(self) -> RunSummary:
        start = time.monotonic()
        self._store(q.register_worker, self.worker_id, what="register", wait=True)
        heartbeat = Heartbeat(self.store, self.worker_id, self.options.lease_seconds, self.writer.held_ids,
                              self.liveness)
        heartbeat.start()
        self.liveness.start()
        restore = on_stop_signals(self._on_signal, lambda: self._stop_requested is not None)
        error: BaseException | None = None
        try:
            while self._stop_requested is None:
                self.liveness.check()
                jobs = self._db(self._runnable_jobs, "find jobs", wait=True)
                if not jobs:
                    if not self.options.wait:
                        break
                    time.sleep(self.options.poll_s)
                    continue
                model_path = jobs[0].model_path
                jobs = [job for job in jobs if job.model_path == model_path]
                if self._serve(jobs):
                    self._waiting_said = None
                else:  # others hold what is left: say so once, look again after poll_s
                    self._say_waiting([job.id for job in jobs])
                    time.sleep(self.options.poll_s)
        except BaseException as exc:
            error = exc
            raise
        finally:
            self.liveness.stop()
            heartbeat.stop()
            restore()
            self._shutdown(error)
            self.summary.seconds = time.monotonic() - start
            self.summary.db_outages, self.summary.db_outage_s = self.outage.num_outages, self.outage.seconds_down
            if self._progress is not None:
                self._progress.close()
        return self.summary

    def stop(self, reason: str = "request") -> None:
        """Ask the run to drain and stop (what SIGINT/SIGTERM do)."""
        if self._stop_requested is None:
            self._stop_requested = reason
            self.summary.stopped_by = reason
            self._stop_time = time.monotonic()

    def _on_signal(self, name: str) -> None:
        self.stop(name)
        log.warning("bulkgen: %s: finishing running requests (up to %.0fs), then stopping; "
                    "Ctrl-C again to stop at once", name, self.options.drain_timeout)

    def _runnable_jobs(self) -> list[Job]:
        with self.store.session_scope(write=True) as session:
            dead = q.dead_local_workers(session)
            q.reclaim_expired(session, self.options.max_attempts, dead, self.options.lease_seconds)
            jobs = q.runnable_jobs(session, list(self.options.job_ids))
            if jobs:
                q.settle_jobs(session, [job.id for job in jobs])
                jobs = q.runnable_jobs(session, list(self.options.job_ids))
            if jobs and self._progress is None:
                totals = q.queue_totals(session, [job.id for job in jobs])
                self._progress = Progress(totals.num_requests, totals.num_done, totals.budget_left,
                                          enabled=self.options.progress, log_every_s=self.options.log_every,
                                          exact=all(runs_to_budget(job.spec) for job in jobs))
        return jobs

    def _serve(self, jobs: list[Job]) -> int:
        """Run the jobs of one model until none of their requests is pending (or a stop). Returns how many
        requests it claimed. Each turn: stop (drain) or claim if due, step, commit if due, reconcile the leases."""
        engine = self._engine(jobs[0])
        self._say_start(engine, jobs)
        settings = _run_settings(engine, self.engine_config, self.options)
        self._store(runs.set_worker_settings, self.worker_id, settings, what="settings", wait=True)
        counted_before = _counted(engine.stats)
        params = {job.id: SamplingParams.from_dict(job.spec["sampling"]) for job in jobs}
        job_ids = [job.id for job in jobs]
        self.summary.job_ids.update(job_ids)
        pace = _Pace(next_check=time.monotonic() + self.options.lease_seconds / 4)
        self.recorder.serving(job_ids, engine.stats)
        claimed = 0
        while True:
            self.liveness.check()
            now = time.monotonic()
            if self._stop_requested is not None:
                self._drain(engine)
                if not engine.has_unfinished():
                    break
            elif now >= pace.next_claim and not self.outage.down:  # nothing new while the database is away
                claimed += self._db(lambda at=now: self._claim_if_due(engine, job_ids, params, pace, at), "claim") or 0
            if engine.has_unfinished() and not self._kept_full():
                self._step(engine)
            elif self.outage.down:
                self.outage.wait()  # idle, or holding all it may keep: until the next try
            elif self._stop_requested is None and now < pace.next_claim:
                break  # the engine is idle and the queue had nothing: these jobs are done
            if self.recorder.is_due():
                self.recorder.close()
            if self.writer.is_due() or (self.outage.down and self.outage.due()):
                self._write(job_ids)  # while the database is away, also its probe
            if not self.outage.down:
                self._reconcile(engine, pace, job_ids)
                self._sync_progress(pace, job_ids)
            self._show_outage()
        self.recorder.close()
        self._write(job_ids)
        while self.writer.has_rows:  # what is left, once the database takes it (or past --db-outage-s, raised)
            self.liveness.check()
            self.outage.wait()
            self._write(job_ids)
        for name, before in counted_before.items():
            setattr(self.summary, name, getattr(self.summary, name) + getattr(engine.stats, name) - before)
        return claimed

    def _db(self, call: Callable[[], Any], what: str, wait: bool = False) -> Any:
        """A store call through the outage: a transient failure starts or extends it (past --db-outage-s, or not
        transient, it is raised); with wait, tried again until it goes through, else None. A success ends it.
        `what`: the call's name, for a stall's line (liveness.py)."""
        while True:
            if not self.outage.due():
                if not wait:
                    return None
                self.outage.wait()
            try:
                with self.liveness.doing(f"a database call ({what})"):
                    if self.outage.down:
                        self.store.ping()  # back only where the database answers (a call may not reach it: no rows)
                    result = call()
            except StoreError as exc:
                self.outage.failed(exc)
                self._show_outage()
                if not wait:
                    return None
                continue
            if self.outage.down:
                self._outage_ended = True  # what the lost answers of the outage did is reconciled next
            self.outage.ok()
            return result

    def _store(self, function: Callable[..., Any], *args: Any, what: str, wait: bool = False) -> Any:
        """`function(session, *args)` in one write transaction, through the outage (`_db`)."""
        def call() -> Any:
            with self.store.session_scope(write=True) as session:
                return function(session, *args)
        return self._db(call, what, wait)

    def _kept_full(self) -> bool:
        """Whether the run holds as many rows as it may keep while the database is away (it pauses)."""
        return self.outage.down and self.writer.num_rows >= self.options.max_kept_rows

    def _show_outage(self) -> None:
        if self._progress is not None:
            self._progress.status = self.outage.status()

    def _claim_if_due(self, engine: EngineProtocol, job_ids: list[int], params: dict[int, SamplingParams],
                      pace: _Pace, now: float) -> int:
        """Claim up to the target (sized again every SIZING_INTERVAL_S); found nothing pending: look again
        after poll_s. Returns how many requests it claimed."""
        if now >= pace.next_sizing:  # the target (packing.claim_target) from the queue's shape for these jobs
            most = claim_target(self.engine_config.max_num_seqs, engine.max_num_tokens,
                                q.QueueShape(1 << 30, 0, 1.0, 1))  # what it would take from an endless queue
            with self.store.session_scope() as session:
                shape = q.queue_shape(session, job_ids, self.options.lease_seconds, enough_per_worker=most)
            pace.target = claim_target(self.engine_config.max_num_seqs, engine.max_num_tokens, shape)
            pace.next_sizing = now + SIZING_INTERVAL_S
        if self.writer.num_held >= pace.target and not engine.has_unfinished():
            self._write(job_ids)  # all it holds has finished: commit to make room
        if self.writer.num_held >= pace.target:
            return 0  # holding enough: nothing to look for now
        claimed = self._claim(engine, job_ids, params, pace.target - self.writer.num_held)
        if claimed == 0:
            pace.next_claim = pace.next_sizing = now + self.options.poll_s
        return claimed

    def _step(self, engine: EngineProtocol) -> None:
        before = engine.stats.num_output_tokens
        computed = engine.stats.num_prompt_tokens_computed
        with self.liveness.doing("an engine step"):
            outputs = engine.step()
        if outputs or engine.stats.num_output_tokens != before or engine.stats.num_prompt_tokens_computed != computed:
            self.liveness.progressed()
        self.writer.collect(outputs)
        self.recorder.step(engine.stats)
        for out in outputs:
            request = self.writer.held.get(out.request_id)
            if request is not None and out.finish_reason != FinishReason.ABORT:
                failed = out.finish_reason == FinishReason.ERROR
                self.recorder.finished(request.job_id, len(out.output_token_ids), failed)
        generated = engine.stats.num_output_tokens - before
        self.num_generated += generated
        if self._progress is not None:
            self._progress.generated(generated)

    def _reconcile(self, engine: EngineProtocol, pace: _Pace, job_ids: list[int]) -> None:
        """Every quarter lease, and at once after an outage: abort what this worker no longer holds (cancelled, or
        its lease expired), and give back what is leased under its id but not held (a claim whose answer the
        outage lost: nobody else could run it while this worker lives). What is finished is committed first (a
        commit that landed unanswered then counts its rows, rather than taking them for lost)."""
        if time.monotonic() < pace.next_check and not self._outage_ended:
            return
        self._outage_ended = False
        pace.next_check = time.monotonic() + self.options.lease_seconds / 4
        if self.writer.has_rows:
            self._write(job_ids)
        lost, num_unknown = self._db(self.writer.reconcile, "reconcile leases") or ([], 0)
        for request_id in lost:
            engine.abort(request_id)
        if num_unknown:
            log.warning("bulkgen: %d request(s) leased under this worker's id that it did not know of (a claim whose "
                        "answer never came back) given back to the queue", num_unknown)

    def _sync_progress(self, pace: _Pace, job_ids: list[int]) -> None:
        """Now and then (as often as progress lines, between 1 and 10 s), the jobs' counts as the queue has them:
        the progress line then shows what every worker committed, this worker's share beside it."""
        now = time.monotonic()
        if self._progress is None or not self._progress.enabled or now < pace.next_sync:
            return
        pace.next_sync = now + min(max(self.options.log_every / 3, 1.0), 10.0)
        totals = self._store(q.queue_totals, job_ids, what="totals")
        if totals is not None:
            self._progress.sync(totals.num_done, totals.num_requests, totals.budget_left)

    def _claim(self, engine: EngineProtocol, job_ids: list[int], params: dict[int, SamplingParams],
               limit: int) -> int:
        with self.store.session_scope(write=True) as session:
            claimed = q.claim(session, self.worker_id, job_ids, limit, self.options.lease_seconds, self.options.packing)
        for request_id in self.writer.hold(claimed):  # an earlier attempt of ours, lost before we noticed
            engine.abort(request_id)
        if claimed:
            self.liveness.progressed()
        for request in claimed:
            try:
                sampling = request_sampling(params[request.job_id], (request.params or {}).get("sampling"),
                                            max_new_tokens=request.max_new_tokens, seed=request.seed)
                engine.add(request.id, unpack_ids(request.prompt_token_ids), sampling)
            except (PromptTooLongError, ConfigError) as exc:  # a request's own settings checked at submit too
                self.writer.fail(request.id, str(exc))
                self.recorder.finished(request.job_id, 0, failed=True)
        return len(claimed)

    def _write(self, job_ids: list[int]) -> None:
        """Commit the rows held (through the outage: a failed commit keeps them for the next try), and the run's
        closed samples."""
        flushed = self._db(lambda: self.writer.commit(job_ids), "commit")
        if flushed is not None:
            self._count(flushed)
            if flushed.num_completed + flushed.num_failed:
                self.liveness.progressed()
        if self.recorder.pending and not self.outage.down:
            rows = list(self.recorder.pending)
            if self._store(runs.insert_samples, rows, what="samples") is not None:
                self.recorder.written(len(rows))

    def _count(self, flushed: Flushed) -> None:
        self.summary.num_completed += flushed.num_completed
        self.summary.num_failed += flushed.num_failed
        self.summary.num_output_tokens += flushed.num_output_tokens
        self.summary.num_prompt_tokens += flushed.num_prompt_tokens
        if self._progress is not None and flushed.num_completed + flushed.num_failed:
            self._progress.finished(flushed.num_completed + flushed.num_failed, flushed.num_output_tokens,
                                    flushed.budget)

    def _drain(self, engine: EngineProtocol) -> None:
        """Stopping: give back what has not started; let the rest finish until the drain timeout. (While the
        database is away they stay held: the shutdown gives them back, or their leases expire.)"""
        aborted = engine.abort_waiting()
        if time.monotonic() - self._stop_time > self.options.drain_timeout:
            aborted += [engine.abort(request_id) for request_id in list(self.writer.held)]
        ids = [out.request_id for out in aborted if out is not None]
        if ids and (released := self._db(lambda: self.writer.give_back(ids), "give back")) is not None:
            self.summary.num_released += released
            self.liveness.progressed()

    def _shutdown(self, error: BaseException | None) -> None:
        """Commit what is finished; give back the rest of our leases (after an engine error, expire them:
        those attempts count, as after a crash). After a database failure, what was not committed is lost
        (never half-written) and the leases are given back if the database still takes that."""
        store_failed = isinstance(error, StoreError)
        try:
            if not store_failed and self.writer.has_rows:
                self._write(list(self.summary.job_ids))
            if error is not None and not store_failed and not isinstance(error, StalledError):
                with self.store.session_scope(write=True) as session:
                    q.reclaim_expired(session, self.options.max_attempts, [self.worker_id])
            else:
                self.summary.num_released += self.writer.give_back(list(self.writer.held))
            self._store(q.stop_worker, self.worker_id, self.summary.num_completed, self.summary.num_output_tokens,
                        what="stop", wait=error is None)
        except Exception as exc:  # never hide the original error behind a shutdown one
            if error is None:
                raise
            log.warning("bulkgen: could not give back this worker's requests while stopping (%s); they return to "
                        "the queue when their leases expire", exc)

    # ------------------------------------------------------------------ helpers

    def _engine(self, job: Job) -> EngineProtocol:
        if job.model_path not in self._engines:
            self._engines.clear()  # one model in memory at a time
            # the directory submit resolved, or on another node the same model (at its pinned commit) fetched here
            path = model_dir(job.model, job.model_path, job.model_revision, log=log.warning) \
                if self._fetches_models else job.model_path
            self._engines[job.model_path] = self._engine_factory(str(path), self.engine_config)
        return self._engines[job.model_path]

    def _say_start(self, engine: EngineProtocol, jobs: list[Job]) -> None:
        """The run's first line, as soon as the engine is up: what runs, how, and how much is queued (once for a
        model and its jobs, however often the worker comes back to them)."""
        key = (engine.describe(), tuple(job.id for job in jobs))
        if self._progress is None or key in self._said:
            return
        self._said.add(key)
        totals = self._store(q.queue_totals, [job.id for job in jobs], what="totals", wait=True)
        self._progress.begin(f"bulkgen run: {engine.describe()} · jobs {', '.join(str(job.id) for job in jobs)}: "
                             f"{totals.num_pending:,} requests queued, {totals.num_done:,} of "
                             f"{totals.num_requests:,} done")


    def _say_waiting(self, job_ids: list[int]) -> None:
        """One line when the worker has nothing to claim while other workers still run these jobs' requests (and
        again only when who holds them changes): what it waits for, and why that wait is bounded."""
        held = self._store(q.held_elsewhere, self.worker_id, job_ids, what="who holds what")
        if not held or set(held) == set(self._waiting_said or {}):
            return
        self._waiting_said = held
        if self._progress is not None:
            self._progress.say(f"bulkgen run: waiting: {sum(held.values())} request(s) left run on "
                               f"{', '.join(f'{w} ({n})' for w, n in sorted(held.items()))}; they come back to the "
                               "queue if those workers stop or stall")


@dataclass
class _Pace:
    """When a serving worker next does what it does now and then (monotonic seconds)."""

    target: int = 0  # requests to hold
    next_sizing: float = 0.0  # when to size the target again
    next_claim: float = 0.0  # when to look at the queue again
    next_check: float = 0.0  # when to look for requests lost to a cancel or an expired lease
    next_sync: float = 0.0  # when to read the job's counts again for the progress line (other workers' commits)


def _run_settings(engine: EngineProtocol, engine_config: EngineConfig, options: WorkerOptions) -> dict[str, Any]:
    """What a run ran with, for `bulkgen report`."""
    config = getattr(engine, "config", engine_config)  # its dtype resolved, where the engine has one
    return {"engine": engine.describe(), "dtype": config.dtype, "quantization": config.quantization,
            "device": config.device,
            "kv_cache_tokens": engine.max_num_tokens, "max_num_seqs": config.max_num_seqs,
            "max_num_batched_tokens": config.max_num_batched_tokens, "block_size": config.block_size,
            "attention_backend": config.attention_backend, "kernels": config.kernels,
            "packing": options.packing, "kv_admission": options.kv_admission,
            "stall_s": options.stall_s, "lease_s": options.lease_seconds}


def _default_engine(model_path: str, config: EngineConfig, kv_admission: bool = True,
                    packing: str = DEFAULT_PACKING) -> EngineProtocol:
    from bulkgen.engine.engine import Engine  # here: the worker imports without torch (a bench queue needs none)

    return Engine(model_path, config, admission=admission_for(packing, kv_admission))


def runs_to_budget(spec: dict[str, Any]) -> bool:
    """Whether every request of a job generates exactly its budget (--ignore-eos and nothing else ends it: no stop,
    no schema, no line of an OpenAI batch file with its own stop): the progress's ETA is then exact, not "<="."""
    return SamplingParams.from_dict(spec["sampling"]).runs_to_budget and spec.get("input_format") != "openai" \
        and spec.get("json_schema_column") is None


def _counted(stats: Any) -> dict[str, int]:
    """The engine's counters a run's summary adds up (what this run's jobs added to them)."""
    return {name: getattr(stats, name) for name in ("num_preemptions", "num_steps", "num_draft_tokens",
                                                     "num_accepted_tokens")}
