"""What a worker did, interval by interval: the rows of `run_samples` that `bulkgen report` plots (throughput,
running sequences, KV use, preemptions over time).

Steps are summed as they happen (a few additions a step) and closed into one row per job every `interval_s`;
an interval in which nothing ran writes nothing, so a report shows a stopped or idle worker as a gap. A worker
serving several jobs of one model at once shares each interval's engine figures between them by the output
tokens each job finished in it (evenly where none finished): exact for one job, the usual case. Joins nothing:
the worker hands it the engine's counters and writes its rows.
"""

from __future__ import annotations

import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from bulkgen.engine.protocol import EngineStats
from bulkgen.store.models import utcnow

SAMPLE_INTERVAL_S = 10.0
MAX_KEPT_SAMPLES = 10_000  # rows kept while the database is away; the oldest go first past them


@dataclass
class _Interval:
    started_at: Any = field(default_factory=utcnow)
    start: float = field(default_factory=time.monotonic)
    num_steps: int = 0
    num_output_tokens: int = 0
    num_prompt_tokens: int = 0
    num_preemptions: int = 0
    sum_running: int = 0
    max_running: int = 0
    sum_kv_usage: float = 0.0
    max_kv_usage: float = 0.0
    finished: Counter = field(default_factory=Counter)  # job id -> requests finished
    failed: Counter = field(default_factory=Counter)
    finished_tokens: Counter = field(default_factory=Counter)  # job id -> output tokens of those


class Recorder:
    def __init__(self, worker_id: str, interval_s: float = SAMPLE_INTERVAL_S) -> None:
        self.worker_id = worker_id
        self.interval_s = interval_s
        self.job_ids: list[int] = []  # the jobs being served
        self.pending: list[dict[str, Any]] = []  # closed intervals not yet written
        self._now = _Interval()
        self._last: tuple[int, int, int] | None = None  # the engine's counters at the last step

    def serving(self, job_ids: list[int], stats: EngineStats) -> None:
        """A new set of jobs (or a new engine): close what ran before, count from the engine's counters now."""
        self.close()
        self.job_ids = list(job_ids)
        self._last = (stats.num_output_tokens, stats.num_prompt_tokens_computed, stats.num_preemptions)

    def step(self, stats: EngineStats) -> None:
        """After each engine step."""
        counters = (stats.num_output_tokens, stats.num_prompt_tokens_computed, stats.num_preemptions)
        last = self._last or counters
        self._last = counters
        now = self._now
        now.num_steps += 1
        now.num_output_tokens += counters[0] - last[0]
        now.num_prompt_tokens += counters[1] - last[1]
        now.num_preemptions += counters[2] - last[2]
        now.sum_running += stats.num_running
        now.max_running = max(now.max_running, stats.num_running)
        now.sum_kv_usage += stats.kv_usage
        now.max_kv_usage = max(now.max_kv_usage, stats.kv_usage)

    def finished(self, job_id: int, num_output_tokens: int, failed: bool = False) -> None:
        """A held request finished (or failed) in the engine."""
        self._now.finished[job_id] += 1
        self._now.failed[job_id] += failed
        self._now.finished_tokens[job_id] += num_output_tokens

    def is_due(self) -> bool:
        return time.monotonic() - self._now.start >= self.interval_s

    def close(self) -> None:
        """End the interval: its rows (one per job served, none if nothing ran) join `pending`."""
        now, self._now = self._now, _Interval()
        if not self.job_ids or (now.num_steps == 0 and not now.finished):
            return
        seconds = time.monotonic() - now.start
        tokens = [now.finished_tokens[job_id] for job_id in self.job_ids]
        total = sum(tokens)
        shares = [t / total for t in tokens] if total else [1 / len(self.job_ids)] * len(self.job_ids)
        steps = max(now.num_steps, 1)
        for job_id, share in zip(self.job_ids, shares, strict=True):
            self.pending.append({
                "job_id": job_id, "worker_id": self.worker_id, "started_at": now.started_at, "seconds": seconds,
                "num_steps": now.num_steps, "num_output_tokens": round(now.num_output_tokens * share),
                "num_prompt_tokens": round(now.num_prompt_tokens * share), "num_finished": now.finished[job_id],
                "num_failed": now.failed[job_id], "num_preemptions": round(now.num_preemptions * share),
                "mean_running": now.sum_running / steps, "max_running": now.max_running,
                "mean_kv_usage": now.sum_kv_usage / steps, "max_kv_usage": now.max_kv_usage})
        del self.pending[:-MAX_KEPT_SAMPLES]

    def written(self, num_rows: int) -> None:
        """The first num_rows of `pending` are in the store."""
        del self.pending[:num_rows]
