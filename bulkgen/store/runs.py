"""What workers record of their runs: interval samples (recorder.py writes them, `bulkgen report` reads them)
and each worker's settings."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

from sqlalchemy import func, insert, select, update
from sqlalchemy.orm import Session

from bulkgen.store.models import Request, RequestState, Result, RunSample, Worker, utcnow


def insert_samples(session: Session, rows: list[dict[str, Any]]) -> int:
    if rows:
        session.execute(insert(RunSample), rows)
    return len(rows)


def set_worker_settings(session: Session, worker_id: str, settings: dict[str, Any]) -> None:
    session.execute(update(Worker).where(Worker.id == worker_id).values(settings=settings))


def job_samples(session: Session, job_id: int) -> list[Any]:
    """The job's samples, oldest first (rows, not objects: thousands of them)."""
    query = (select(*RunSample.__table__.columns).where(RunSample.job_id == job_id)
             .order_by(RunSample.started_at, RunSample.id))
    return list(session.execute(query).all())


def recent(session: Session, job_id: int, window_s: float = 60.0) -> dict[str, Any]:
    """The job's rate over the samples of the last window_s (None where none were closed in it), and the
    workers holding its requests now: what `bulkgen status --watch` shows."""
    since = utcnow() - timedelta(seconds=window_s)
    samples = list(session.scalars(select(RunSample).where(RunSample.job_id == job_id, RunSample.started_at >= since)))
    workers = sorted(session.scalars(select(Request.lease_owner).distinct().where(
        Request.job_id == job_id, Request.state == RequestState.RUNNING.value, Request.lease_owner.is_not(None))))
    out: dict[str, Any] = {"window_s": window_s, "output_tok_per_s": None, "requests_per_s": None,
                           "workers": workers}
    if samples:
        start = min(s.started_at for s in samples)
        end = max(s.started_at + timedelta(seconds=s.seconds) for s in samples)
        seconds = max((end - start).total_seconds(), 1e-3)
        out["output_tok_per_s"] = round(sum(s.num_output_tokens for s in samples) / seconds, 2)
        out["requests_per_s"] = round(sum(s.num_finished for s in samples) / seconds, 3)
    return out


def job_workers(session: Session, job_id: int) -> list[tuple[Worker, int, int]]:
    """Workers that committed results to the job or recorded samples of it, oldest first: (worker, results
    committed, their output tokens)."""
    committed = {w: (int(n), int(t or 0)) for w, n, t in session.execute(
        select(Result.worker_id, func.count(), func.sum(Result.num_output_tokens))
        .where(Result.job_id == job_id).group_by(Result.worker_id))}
    sampled = set(session.scalars(select(RunSample.worker_id).where(RunSample.job_id == job_id).distinct()))
    ids = [w for w in {*committed, *sampled} if w]
    workers = list(session.scalars(select(Worker).where(Worker.id.in_(ids)).order_by(Worker.started_at))) \
        if ids else []
    return [(w, *committed.get(w.id, (0, 0))) for w in workers]
