"""The queue's capacity alone (`bulkgen bench --queue`): N worker processes claim, heartbeat and commit
through the real store (worker.py, writer.py, store/queue.py) with an engine that finishes every request it
is given at once with a fixed number of tokens (no model), so the figure is requests/s through the database.

A GPU worker finishes on the order of 100 requests a second; a cluster of them must never wait on the queue.
"""

from __future__ import annotations

import multiprocessing
import queue
import time
from dataclasses import dataclass, field
from typing import Any

from bulkgen.config import EngineConfig, SamplingParams
from bulkgen.engine.protocol import EngineStats, FinishReason, RequestOutput
from bulkgen.errors import BulkgenError
from bulkgen.store import jobs as job_ops
from bulkgen.store.db import open_store
from bulkgen.worker import Worker, WorkerOptions

JOB_MODEL = "bulkgen-queue-bench"  # the job's model: no engine loads it


@dataclass
class FixedEngine:
    """EngineProtocol without a model: every request added finishes at the next step, `num_tokens` tokens
    long. What a worker does around its engine (claims, leases, commits) is all that is left to measure."""

    num_tokens: int = 16
    max_num_tokens: int = 1 << 30
    stats: EngineStats = field(default_factory=EngineStats)
    _queued: list[tuple[Any, list[int]]] = field(default_factory=list)

    def describe(self) -> str:
        return f"fixed engine ({self.num_tokens} tokens a request, no model)"

    def add(self, request_id: Any, prompt_token_ids: list[int], params: SamplingParams) -> None:
        self._queued.append((request_id, prompt_token_ids))

    def step(self) -> list[RequestOutput]:
        out = [RequestOutput(request_id, prompt, list(range(self.num_tokens)), "", FinishReason.LENGTH, latency_s=0.0)
               for request_id, prompt in self._queued]
        self.stats.num_steps += 1
        self.stats.num_output_tokens += self.num_tokens * len(out)
        self._queued = []
        return out

    def abort(self, request_id: Any) -> RequestOutput | None:
        for i, (queued_id, prompt) in enumerate(self._queued):
            if queued_id == request_id:
                del self._queued[i]
                return RequestOutput(request_id, prompt, [], "", FinishReason.ABORT)
        return None

    def abort_waiting(self) -> list[RequestOutput]:
        return []

    def has_unfinished(self) -> bool:
        return bool(self._queued)

    @property
    def num_unfinished(self) -> int:
        return len(self._queued)


def make_queue_job(db_url: str, num_requests: int, prompt_tokens: int = 64, max_new_tokens: int = 16) -> int:
    """A queued job of num_requests requests with fixed token ids (no model, no input file to read)."""
    store = open_store(db_url)
    with store.session_scope(write=True) as session:
        job_id = job_ops.new_job(session, name="queue bench", model=JOB_MODEL, model_path=JOB_MODEL,
                                 spec={"sampling": SamplingParams().to_dict()})
    ids = list(range(prompt_tokens))
    for start in range(0, num_requests, 10_000):
        rows = [job_ops.request_row(job_id, row, 0, ids, max_new_tokens, seed=row)
                for row in range(start, min(num_requests, start + 10_000))]
        with store.session_scope(write=True) as session:
            job_ops.insert_requests(session, rows)
    with store.session_scope(write=True) as session:
        job_ops.open_job(session, job_id, num_requests)
    store.close()
    return job_id


def _worker(db_url: str, job_id: int, kv_tokens: int, max_num_seqs: int, ready: Any, go: Any,
            results: Any) -> None:
    store = open_store(db_url)
    options = WorkerOptions(job_ids=(job_id,), progress=False, poll_s=0.05, commit_every=256, commit_interval=0.5)
    worker = Worker(store, EngineConfig(max_num_seqs=max_num_seqs), options,
                    engine_factory=lambda path, config: FixedEngine(max_num_tokens=kv_tokens))
    ready.put(True)
    go.wait()
    summary = worker.run()
    results.put(summary.num_completed)


def measure(db_url: str, num_workers: int, num_requests: int, max_num_seqs: int = 256) -> dict[str, Any]:
    """One job of num_requests through num_workers worker processes: requests/s from the start signal to the
    last commit. Each worker holds up to max_num_seqs requests (a GPU worker's batch)."""
    job_id = make_queue_job(db_url, num_requests)
    context = multiprocessing.get_context("spawn")
    ready, results, go = context.Queue(), context.Queue(), context.Event()
    kv_tokens = max_num_seqs * 80  # so that packing.claim_target sizes claims as a full batch of 64 + 16 token requests
    procs = [context.Process(target=_worker, args=(db_url, job_id, kv_tokens, max_num_seqs, ready, go, results))
             for _ in range(num_workers)]
    for proc in procs:
        proc.start()
    for _ in procs:
        ready.get(timeout=120)
    start = time.perf_counter()
    go.set()
    completed = [_result(results, procs) for _ in procs]
    seconds = time.perf_counter() - start
    for proc in procs:
        proc.join(timeout=30)
    return {"workers": num_workers, "requests": sum(completed), "seconds": round(seconds, 3),
            "requests_per_s": round(sum(completed) / seconds, 1), "per_worker": completed}


def _result(results: Any, procs: list[Any], timeout_s: float = 3600.0) -> int:
    """The next worker's count; a worker process that died without one ends the wait (it would be forever)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            return results.get(timeout=1.0)
        except queue.Empty:
            dead = [proc.exitcode for proc in procs if proc.exitcode not in (None, 0)]
            if dead:
                for proc in procs:
                    proc.kill()
                raise BulkgenError(f"a queue bench worker process died (exit {dead[0]}); see its output "
                                   "above") from None
    raise BulkgenError(f"the queue bench's workers gave no result in {timeout_s:.0f} s")


def run_queue_bench(db_urls: list[str], workers: list[int], num_requests: int, max_num_seqs: int,
                    log: Any) -> list[dict[str, Any]]:
    rows = []
    for url in db_urls:
        base = None
        for n in workers:
            row = {"db": url.split("://", 1)[0].split("+", 1)[0], **measure(url, n, num_requests, max_num_seqs)}
            base = base or row["requests_per_s"] / n
            row["scaling"] = round(row["requests_per_s"] / (base * n), 2)
            log(f"  {row['db']:<10} {n:>2} workers: {row['requests_per_s']:>8,.1f} requests/s "
                f"({row['requests']} in {row['seconds']:.1f}s; {row['scaling']:.2f} of linear from 1 worker)")
            rows.append(row)
    return rows
