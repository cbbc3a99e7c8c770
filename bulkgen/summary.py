"""What a run did, as its last line and its `--json`: one worker's run (worker.py) and a Ray driver's over its
workers (ray.py) say it in the same sentences."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

TOTALS = ("completed", "failed", "released", "num_prompt_tokens", "num_output_tokens", "steps", "drafted_tokens",
          "accepted_tokens")  # summed over Ray's workers


@dataclass
class RunSummary:
    worker_id: str
    num_completed: int = 0
    num_failed: int = 0
    num_released: int = 0
    num_prompt_tokens: int = 0
    num_output_tokens: int = 0
    num_preemptions: int = 0
    num_steps: int = 0  # engine steps, and the draft tokens they verified and kept (engine/speculate.py)
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    seconds: float = 0.0
    stopped_by: str | None = None  # the signal's name, when one stopped the run
    job_ids: set[int] = field(default_factory=set)
    db_outages: int = 0  # times the database was away and waited out, and for how long in all
    db_outage_s: float = 0.0

    def to_dict(self) -> dict[str, Any]:
        return {"worker_id": self.worker_id, "completed": self.num_completed, "failed": self.num_failed,
                "released": self.num_released, "num_prompt_tokens": self.num_prompt_tokens,
                "num_output_tokens": self.num_output_tokens, "preemptions": self.num_preemptions,
                "steps": self.num_steps, "drafted_tokens": self.num_draft_tokens,
                "accepted_tokens": self.num_accepted_tokens,
                **_timing(self.seconds, self.num_output_tokens, self.stopped_by, self.db_outages, self.db_outage_s),
                "jobs": sorted(self.job_ids)}

    def line(self) -> str:
        return _line("bulkgen run", self.to_dict())


@dataclass
class RaySummary:
    workers: int
    nodes: int
    per_worker: list[dict[str, Any]]  # each worker's RunSummary.to_dict()
    seconds: float
    errors: list[str]
    stopped_by: str | None
    db_outages: int = 0  # times the driver found the database unavailable, and for how long in all
    db_outage_s: float = 0.0

    def to_dict(self) -> dict[str, Any]:
        total = {key: sum(w[key] for w in self.per_worker) for key in TOTALS}
        return {"workers": self.workers, "nodes": self.nodes, **total,
                **_timing(self.seconds, total["num_output_tokens"], self.stopped_by, self.db_outages,
                          self.db_outage_s),
                "errors": self.errors, "per_worker": self.per_worker}

    def line(self) -> str:
        return _line(f"bulkgen run --ray: {self.workers} workers on {self.nodes} node(s) ·", self.to_dict())


def _timing(seconds: float, output_tokens: int, stopped_by: str | None, db_outages: int,
            db_outage_s: float) -> dict[str, Any]:
    return {"seconds": round(seconds, 2), "stopped_by": stopped_by,
            "output_tok_per_s": round(output_tokens / seconds, 2) if seconds else None,
            "db_outages": db_outages, "db_outage_s": round(db_outage_s, 1)}


def _line(head: str, d: dict[str, Any]) -> str:
    """`HEAD: N completed · N failed · N output tokens in Ss · R output tok/s`, then how it stopped and the
    database's outages."""
    rate = f" · {d['output_tok_per_s']:.1f} output tok/s" if d["output_tok_per_s"] is not None else ""
    stop = f" · stopped by {d['stopped_by']}, {d['released']} requests released" if d["stopped_by"] else ""
    if d["db_outages"]:
        stop += f" · database unavailable {d['db_outages']} time(s), {d['db_outage_s']:.0f}s in all (waited out)"
    head = head if head.endswith("·") else head + ":"
    steps = f" · {d['steps']:,} steps" if d["steps"] else ""
    if d["drafted_tokens"]:
        steps += f", {d['accepted_tokens']:,} of {d['drafted_tokens']:,} drafted tokens kept"
    return (f"{head} {d['completed']} completed · {d['failed']} failed · {d['num_output_tokens']:,} output tokens "
            f"in {d['seconds']:.1f}s{rate}{steps}{stop}")
