"""What workers record of their runs: interval samples (recorder.py writes them, `bulkgen report` reads them)
and each worker's settings."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

from sqlalchemy import func, insert, select, update
from sqlalchemy.orm import Session

from bulkgen.store.jobs import describe_jobs, num_retryable
from bulkgen.store.models import Job, Request, RequestState, Result, RunSample, Worker, WorkerStatus, iso_utc, utcnow
from bulkgen.store.queue import is_gone

STALLED_SHARE = 0.25  # of a worker's --stall-s without progress while holding requests: shown as stalled (its
# own line says so at the same moment: liveness.WARN_SHARE)
DEFAULT_STALL_S = 600.0  # a worker that did not record its own (an older bulkgen)


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


def lease_holders(session: Session, job_id: int) -> list[dict[str, Any]]:
    """The workers holding the job's requests now, and how each is doing: "working"; "stalled" (heart-beating, but
    no progress for a quarter of its --stall-s: its own log says what it waits on); "gone" (its process is gone on
    this host, or no heartbeat for a lease: killed, or its machine or network gone; its requests return to the
    queue when a worker next looks, at once on this host, else when their leases expire)."""
    held = dict(session.execute(select(Request.lease_owner, func.count()).where(
        Request.job_id == job_id, Request.state == RequestState.RUNNING.value, Request.lease_owner.is_not(None))
        .group_by(Request.lease_owner)).all())
    workers = {w.id: w for w in session.scalars(select(Worker).where(Worker.id.in_(list(held))))} if held else {}
    now = utcnow()
    out = []
    for worker_id in sorted(held):
        worker = workers.get(worker_id)
        settings = (worker.settings if worker else None) or {}
        lease_s, stall_s = settings.get("lease_s", 60.0), settings.get("stall_s", DEFAULT_STALL_S)
        state = "working"
        if worker is None or worker.status == WorkerStatus.DEAD or is_gone(worker.hostname, worker.pid) or \
                (now - worker.heartbeat_at).total_seconds() > lease_s:
            state = "gone"
        elif worker.progress_at is not None and (now - worker.progress_at).total_seconds() > STALLED_SHARE * stall_s:
            state = "stalled"
        out.append({"worker_id": worker_id, "num_requests": int(held[worker_id]), "state": state,
                    "heartbeat_at": iso_utc(worker.heartbeat_at) if worker else None,
                    "progress_at": iso_utc(worker.progress_at) if worker else None})
    return out


def job_summary(session: Session, job: Job) -> dict[str, Any]:
    """`bulkgen status --json` (and the report's summary): the job's summary and the workers holding its requests
    now (working, stalled or gone)."""
    summary = describe_jobs(session, [job])[0]
    summary["workers"] = lease_holders(session, job.id)
    # of the failed, those `bulkgen retry` puts back (the rest were refused at submit for their input)
    summary["num_retryable"] = num_retryable(session, job.id) if summary["counts"]["failed"] else 0
    return summary
