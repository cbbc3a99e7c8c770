"""The result writer: what a worker holds, and how finished requests become committed rows.

A worker holds each request it claimed until the request's result (or its failure) is committed, it
is given back, or the worker learns it lost it (a cancel, an expired lease). Outputs become result rows
as they finish, and rows are committed in one transaction every `commit_rows` rows or
`commit_interval_s` seconds, whichever is first: a crash loses at most what was generated since.
Joins nothing: it talks to the store only (the worker hands it the engine's outputs).
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from bulkgen.engine.protocol import FinishReason
from bulkgen.store import queue as q
from bulkgen.store.db import Store
from bulkgen.store.models import pack_ids


@dataclass(frozen=True)
class Flushed:
    """What one commit wrote."""

    num_completed: int = 0
    num_failed: int = 0
    num_prompt_tokens: int = 0
    num_output_tokens: int = 0
    budget: int = 0  # max_new_tokens of the requests committed


class ResultWriter:
    def __init__(self, store: Store, worker_id: str, commit_rows: int, commit_interval_s: float) -> None:
        self.store = store
        self.worker_id = worker_id
        self.commit_rows = commit_rows
        self.commit_interval_s = commit_interval_s
        self.held: dict[int, q.ClaimedRequest] = {}  # claimed and not yet committed, given back or lost
        self._results: list[dict[str, Any]] = []
        self._failures: list[tuple[int, str]] = []
        self._last_commit = time.monotonic()

    @property
    def num_held(self) -> int:
        return len(self.held)

    @property
    def num_rows(self) -> int:
        """Rows (results and failures) not yet committed."""
        return len(self._results) + len(self._failures)

    @property
    def has_rows(self) -> bool:
        return bool(self._results or self._failures)

    def hold(self, requests: Iterable[q.ClaimedRequest]) -> list[int]:
        """Hold newly claimed requests. Returns those this worker held already: an earlier attempt of its own that
        it lost (a cancel and a retry, or a lease that expired while it was paused) before it noticed; that
        attempt's rows are dropped here, and the caller drops it from the engine (the new lease runs it anew)."""
        again = [request.id for request in requests if request.id in self.held]
        if again:
            self._forget_rows(set(again))
        for request in requests:
            self.held[request.id] = request
        return again

    def _forget_rows(self, request_ids: set[int]) -> None:
        self._results = [r for r in self._results if r["request_id"] not in request_ids]
        self._failures = [f for f in self._failures if f[0] not in request_ids]

    def fail(self, request_id: int, reason: str) -> None:
        self._failures.append((request_id, reason))

    def collect(self, outputs: Iterable[Any]) -> None:
        """The engine's finished outputs (RequestOutput) of held requests become result rows or failures;
        aborted ones (given back) become neither."""
        for out in outputs:
            request = self.held.get(out.request_id)
            if request is None:
                continue
            if out.finish_reason == FinishReason.ERROR:
                self._failures.append((request.id, out.error or "generation failed"))
            elif out.finish_reason != FinishReason.ABORT:
                self._results.append({
                    "request_id": request.id, "job_id": request.job_id, "text": out.text,
                    "token_ids": pack_ids(out.output_token_ids), "finish_reason": out.finish_reason,
                    "num_prompt_tokens": len(out.prompt_token_ids), "num_output_tokens": len(out.output_token_ids),
                    "num_cached_tokens": out.num_cached_tokens, "logprobs": out.logprobs,
                    "time_to_first_token_s": out.time_to_first_token_s, "latency_s": out.latency_s,
                })

    def is_due(self) -> bool:
        return len(self._results) + len(self._failures) >= self.commit_rows or \
            time.monotonic() - self._last_commit >= self.commit_interval_s

    def commit(self, job_ids: list[int]) -> Flushed:
        """Write the rows in one transaction (only onto requests this worker still holds); settle the jobs."""
        self._last_commit = time.monotonic()
        if not self.has_rows:
            return Flushed()
        results, failures = self._results, self._failures
        with self.store.session_scope(write=True) as session:
            written, failed = q.commit_results(session, self.worker_id, results, failures)
            q.settle_jobs(session, job_ids)
        ids = [r["request_id"] for r in results] + [f[0] for f in failures]
        budget = sum(self.held[i].max_new_tokens for i in ids if i in self.held)
        for request_id in ids:
            self.held.pop(request_id, None)
        self._results, self._failures = [], []
        return Flushed(written, failed, sum(r["num_prompt_tokens"] for r in results),
                       sum(r["num_output_tokens"] for r in results), budget)

    def held_ids(self) -> list[int]:
        """The ids held now; safe from another thread (the heartbeat's): dict.copy runs without a thread switch."""
        return list(self.held.copy())

    def reconcile(self) -> tuple[list[int], int]:
        """The store's leases against what is held: held requests the worker no longer leases (cancelled, or
        reclaimed after a stall) are forgotten here with their rows, and returned (the caller stops working on
        them); requests leased under its id that it does not hold (a claim whose answer was lost) are given back.
        Returns (the lost, how many were given back)."""
        with self.store.session_scope(write=True) as session:
            lost, num_unknown = q.reconcile_leases(session, self.worker_id, list(self.held))
        if lost:
            self._forget_rows(set(lost))
            for request_id in lost:
                self.held.pop(request_id, None)
        return lost, num_unknown

    def give_back(self, request_ids: list[int]) -> int:
        """Return held requests to the queue (not started, or stopped by a drain). Returns how many."""
        if not request_ids:
            return 0
        with self.store.session_scope(write=True) as session:
            released = q.release(session, self.worker_id, request_ids)
        for request_id in request_ids:
            self.held.pop(request_id, None)
        return released
