"""The worker: the only module that joins the store and the engine.

It claims pending requests under a lease, keeps the engine fed, and commits finished results in
small transactions (every `commit_rows` results or `commit_interval_s` seconds, whichever is first),
so a crash loses at most what was generated since the last commit and never a committed row.
"""

from __future__ import annotations

import logging
import os
import signal
import socket
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from bulkgen.config import EngineConfig, SamplingParams
from bulkgen.errors import ConfigError, PromptTooLongError
from bulkgen.progress import Progress
from bulkgen.store import Store
from bulkgen.store import queue as q
from bulkgen.store.models import Job, pack_ids, unpack_ids

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class WorkerOptions:
    job_ids: tuple[int, ...] = ()  # empty: every runnable job
    lease_s: float = 60.0
    commit_rows: int = 256
    commit_interval_s: float = 2.0
    max_attempts: int = 3
    drain_timeout_s: float = 30.0  # on SIGINT/SIGTERM: how long running sequences may finish
    packing: str = "lpt"  # claim and admission order (bulkgen.packing)
    kv_admission: bool = True  # admit only what the KV cache can hold to the end (no preemption)
    wait: bool = False  # when the queue is empty, wait for new work instead of exiting
    poll_s: float = 2.0
    progress: bool = True
    log_every_s: float = 30.0

    def __post_init__(self) -> None:
        if self.lease_s <= 0 or self.commit_rows < 1 or self.commit_interval_s <= 0 or self.max_attempts < 1:
            raise ConfigError("lease, commit interval and commit rows must be positive, max attempts >= 1")
        if self.packing not in q.CLAIM_ORDERS:
            raise ConfigError(f"packing policy must be one of {', '.join(q.CLAIM_ORDERS)}")


@dataclass
class RunSummary:
    worker_id: str
    num_completed: int = 0
    num_failed: int = 0
    num_released: int = 0
    num_prompt_tokens: int = 0
    num_output_tokens: int = 0
    num_preemptions: int = 0
    seconds: float = 0.0
    stopped_by: str | None = None  # the signal's name, when one stopped the run
    job_ids: set[int] = field(default_factory=set)

    def to_dict(self) -> dict[str, Any]:
        return {"worker_id": self.worker_id, "completed": self.num_completed, "failed": self.num_failed,
                "released": self.num_released, "num_prompt_tokens": self.num_prompt_tokens,
                "num_output_tokens": self.num_output_tokens, "preemptions": self.num_preemptions,
                "seconds": round(self.seconds, 2), "stopped_by": self.stopped_by,
                "output_tok_per_s": round(self.num_output_tokens / self.seconds, 2) if self.seconds else None,
                "jobs": sorted(self.job_ids)}

    def line(self) -> str:
        rate = f" · {self.num_output_tokens / self.seconds:.1f} output tok/s" if self.seconds else ""
        stop = f" · stopped by {self.stopped_by}, {self.num_released} requests released" if self.stopped_by else ""
        return (f"bulkgen run: {self.num_completed} completed · {self.num_failed} failed · "
                f"{self.num_output_tokens:,} output tokens in {self.seconds:.1f}s{rate}{stop}")


class Worker:
    def __init__(self, store: Store, engine_config: EngineConfig, options: WorkerOptions | None = None,
                 engine_factory: Callable[[str, EngineConfig], Any] | None = None) -> None:
        self.store = store
        self.engine_config = engine_config
        self.options = options or WorkerOptions()
        self.worker_id = f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:8]}"
        self.summary = RunSummary(self.worker_id)
        self._engine_factory = engine_factory or (lambda path, config: _default_engine(
            path, config, self.options.kv_admission, spread_ends=self.options.packing == "lpt"))
        self._engines: dict[str, Any] = {}
        self._stop_requested: str | None = None
        self._stop_time = 0.0
        self._inflight: dict[int, q.ClaimedRequest] = {}
        self._results: list[dict[str, Any]] = []
        self._failures: list[tuple[int, str]] = []
        self._last_commit = time.monotonic()
        self._progress: Progress | None = None

    # ------------------------------------------------------------------ the run

    def run(self) -> RunSummary:
        start = time.monotonic()
        with self.store.session_scope(write=True) as session:
            q.register_worker(session, self.worker_id)
        heartbeat = _Heartbeat(self.store, self.worker_id, self.options.lease_s)
        heartbeat.start()
        restore = self._install_signal_handlers()
        failed = True
        try:
            while self._stop_requested is None:
                jobs = self._runnable_jobs()
                if not jobs:
                    if not self.options.wait:
                        break
                    time.sleep(self.options.poll_s)
                    continue
                model_path = jobs[0].model_path
                self._serve([job for job in jobs if job.model_path == model_path])
            failed = False
        finally:
            heartbeat.stop()
            restore()
            self._shutdown(failed)
            self.summary.seconds = time.monotonic() - start
            if self._progress is not None:
                self._progress.close()
        return self.summary

    def stop(self, reason: str = "request") -> None:
        """Ask the run to drain and stop (what SIGINT/SIGTERM do)."""
        if self._stop_requested is None:
            self._stop_requested = reason
            self.summary.stopped_by = reason
            self._stop_time = time.monotonic()

    def _runnable_jobs(self) -> list[Job]:
        with self.store.session_scope(write=True) as session:
            dead = q.dead_local_workers(session)
            q.reclaim_expired(session, self.options.max_attempts, dead)
            jobs = q.runnable_jobs(session, list(self.options.job_ids))
            if jobs:
                q.settle_jobs(session, [job.id for job in jobs])
                jobs = q.runnable_jobs(session, list(self.options.job_ids))
            if jobs and self._progress is None:
                self._start_progress(session, [job.id for job in jobs])
        return jobs

    def _serve(self, jobs: list[Job]) -> None:
        """Run the jobs of one model until none of their requests is pending (or a stop)."""
        engine = self._engine(jobs[0].model_path)
        self._say_start(engine, jobs)
        preemptions_before = engine.stats.num_preemptions
        generated = engine.stats.num_output_tokens
        params = {job.id: SamplingParams.from_dict(job.spec["sampling"]) for job in jobs}
        job_ids = [job.id for job in jobs]
        self.summary.job_ids.update(job_ids)
        target = self.engine_config.max_num_seqs + max(16, self.engine_config.max_num_seqs // 2)
        next_claim = 0.0
        next_check = time.monotonic() + self.options.lease_s / 4
        while True:
            now = time.monotonic()
            if self._stop_requested is not None:
                self._drain(engine)
                if not engine.has_unfinished():
                    break
            elif len(self._inflight) < target and now >= next_claim:
                claimed = self._claim(engine, job_ids, params, target - len(self._inflight))
                if not claimed:
                    next_claim = now + self.options.poll_s  # nothing pending now; look again later
            if engine.has_unfinished():
                self._collect(engine.step())
                if self._progress is not None:
                    self._progress.generated(engine.stats.num_output_tokens - generated)
                generated = engine.stats.num_output_tokens
            elif self._stop_requested is None and now < next_claim:
                break  # the engine is idle and the queue had nothing: these jobs are done
            if len(self._results) + len(self._failures) >= self.options.commit_rows or \
                    time.monotonic() - self._last_commit >= self.options.commit_interval_s:
                self._commit(job_ids)
            if time.monotonic() >= next_check:
                next_check = time.monotonic() + self.options.lease_s / 4
                self._abort_lost(engine)
        self._commit(job_ids)
        self.summary.num_preemptions += engine.stats.num_preemptions - preemptions_before

    def _claim(self, engine: Any, job_ids: list[int], params: dict[int, SamplingParams], limit: int) -> int:
        with self.store.session_scope(write=True) as session:
            claimed = q.claim(session, self.worker_id, job_ids, limit, self.options.lease_s, self.options.packing)
        for request in claimed:
            self._inflight[request.id] = request
            sampling = params[request.job_id].replace(max_new_tokens=request.max_new_tokens, seed=request.seed)
            try:
                engine.add(request.id, unpack_ids(request.prompt_token_ids), sampling)
            except PromptTooLongError as exc:
                self._failures.append((request.id, str(exc)))
        return len(claimed)

    def _collect(self, outputs: list[Any]) -> None:
        for out in outputs:
            request = self._inflight.get(out.request_id)
            if request is None:
                continue
            if out.finish_reason == "error":
                self._failures.append((request.id, out.error or "generation failed"))
            elif out.finish_reason != "abort":
                self._results.append({
                    "request_id": request.id, "job_id": request.job_id, "text": out.text,
                    "token_ids": pack_ids(out.output_token_ids), "finish_reason": out.finish_reason,
                    "num_prompt_tokens": len(out.prompt_token_ids), "num_output_tokens": len(out.output_token_ids),
                    "num_cached_tokens": out.num_cached_tokens, "logprobs": out.logprobs,
                    "time_to_first_token_s": out.time_to_first_token_s, "latency_s": out.latency_s,
                })

    def _commit(self, job_ids: list[int]) -> None:
        self._last_commit = time.monotonic()
        if not self._results and not self._failures:
            return
        results, failures = self._results, self._failures
        with self.store.session_scope(write=True) as session:
            written, failed = q.commit_results(session, self.worker_id, results, failures)
            q.settle_jobs(session, job_ids)
        budget = sum(self._inflight[i].max_new_tokens for i in
                     [r["request_id"] for r in results] + [f[0] for f in failures] if i in self._inflight)
        for item in results:
            self._inflight.pop(item["request_id"], None)
        for request_id, _ in failures:
            self._inflight.pop(request_id, None)
        self._results, self._failures = [], []
        new_tokens = sum(r["num_output_tokens"] for r in results)
        self.summary.num_completed += written
        self.summary.num_failed += failed
        self.summary.num_output_tokens += new_tokens
        self.summary.num_prompt_tokens += sum(r["num_prompt_tokens"] for r in results)
        if self._progress is not None:
            self._progress.finished(written + failed, new_tokens, budget)

    def _abort_lost(self, engine: Any) -> None:
        """Stop working on requests this worker no longer holds (the job was cancelled, say)."""
        with self.store.session_scope() as session:
            lost = q.lost_requests(session, self.worker_id, list(self._inflight))
        for request_id in lost:
            engine.abort(request_id)
            self._inflight.pop(request_id, None)
        if lost:
            lost_set = set(lost)
            self._results = [r for r in self._results if r["request_id"] not in lost_set]
            self._failures = [f for f in self._failures if f[0] not in lost_set]

    def _drain(self, engine: Any) -> None:
        """Stopping: give back what has not started; let the rest finish until the drain timeout."""
        aborted = engine.abort_waiting()
        if time.monotonic() - self._stop_time > self.options.drain_timeout_s:
            aborted += [engine.abort(request_id) for request_id in list(self._inflight)
                        if request_id in getattr(engine, "_seqs", {})]
        ids = [out.request_id for out in aborted if out is not None]
        if ids:
            with self.store.session_scope(write=True) as session:
                self.summary.num_released += q.release(session, self.worker_id, ids)
            for request_id in ids:
                self._inflight.pop(request_id, None)

    def _shutdown(self, failed: bool) -> None:
        """Commit what is finished; give back (or, after a crash, expire) the rest of our leases."""
        try:
            if self._results or self._failures:
                self._commit(list(self.summary.job_ids))
            with self.store.session_scope(write=True) as session:
                leftover = list(self._inflight)
                if failed:  # an engine error: these attempts count, as after a crash
                    q.reclaim_expired(session, self.options.max_attempts, [self.worker_id])
                else:
                    self.summary.num_released += q.release(session, self.worker_id, leftover)
                q.stop_worker(session, self.worker_id, self.summary.num_completed, self.summary.num_output_tokens)
        except Exception:  # never hide the original error behind a shutdown one
            if not failed:
                raise
            log.exception("bulkgen: could not release leases while stopping; they will expire")

    # ------------------------------------------------------------------ helpers

    def _engine(self, model_path: str) -> Any:
        if model_path not in self._engines:
            self._engines.clear()  # one model in memory at a time
            self._engines[model_path] = self._engine_factory(model_path, self.engine_config)
        return self._engines[model_path]

    def _start_progress(self, session, job_ids: list[int]) -> None:
        totals = q.queue_totals(session, job_ids)
        self._progress = Progress(totals.num_requests, totals.num_done, totals.budget_left,
                                  enabled=self.options.progress, log_every_s=self.options.log_every_s)

    def _say_start(self, engine: Any, jobs: list[Job]) -> None:
        """The run's first line, as soon as the engine is up: what runs, how, and how much is queued."""
        if self._progress is None:
            return
        with self.store.session_scope() as session:
            totals = q.queue_totals(session, [job.id for job in jobs])
        self._progress.begin(f"bulkgen run: {engine.describe()} · jobs {', '.join(str(job.id) for job in jobs)}: "
                           f"{totals.num_pending:,} requests queued, {totals.num_done:,} of {totals.num_requests:,} "
                           "done")

    def _install_signal_handlers(self) -> Callable[[], None]:
        if threading.current_thread() is not threading.main_thread():
            return lambda: None

        def handle(signum: int, _frame: Any) -> None:
            if self._stop_requested is not None and signum == signal.SIGINT:
                os._exit(130)  # a second Ctrl-C: now; our leases expire as after a crash
            name = signal.Signals(signum).name
            self.stop(name)
            log.warning("bulkgen: %s: finishing running requests (up to %.0fs), then stopping; "
                        "Ctrl-C again to stop at once", name, self.options.drain_timeout_s)

        previous = {sig: signal.signal(sig, handle) for sig in (signal.SIGINT, signal.SIGTERM)}

        def restore() -> None:
            for sig, handler in previous.items():
                signal.signal(sig, handler)

        return restore


class _Heartbeat(threading.Thread):
    """Renews this worker's leases while the main thread computes (a step may take a while)."""

    def __init__(self, store: Store, worker_id: str, lease_s: float) -> None:
        super().__init__(name="bulkgen-heartbeat", daemon=True)
        self.store = store
        self.worker_id = worker_id
        self.lease_s = lease_s
        self._stopped = threading.Event()

    def run(self) -> None:
        while not self._stopped.wait(self.lease_s / 4):
            try:
                with self.store.session_scope(write=True) as session:
                    q.heartbeat(session, self.worker_id, self.lease_s)
            except Exception as exc:  # keep trying: the database may be briefly unreachable
                log.warning("bulkgen: heartbeat failed: %s", exc)

    def stop(self) -> None:
        self._stopped.set()
        self.join(timeout=5)


def _default_engine(model_path: str, config: EngineConfig, kv_admission: bool = True,
                    spread_ends: bool = True) -> Any:
    from bulkgen.engine.engine import Engine

    engine = Engine(model_path, config)
    if kv_admission:
        from bulkgen.packing import KVAdmission

        engine.scheduler.admission = KVAdmission(engine.block_manager.num_blocks, engine.block_manager.block_size,
                                                 spread_ends=spread_ends)
    return engine
