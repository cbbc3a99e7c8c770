# Whole (over 300 lines): claims, leases and commits are one protocol whose invariant (a request held by one worker)
# is read in one place.
"""The work queue: workers claim requests under a lease, renew it by heart-beating, and commit results.

A request is claimed by exactly one worker at a time (SQLite: the claim runs under BEGIN IMMEDIATE;
PostgreSQL: SELECT … FOR UPDATE SKIP LOCKED). A result lands only on a request still leased by the
committing worker, in the same transaction that marks it completed, and `results.request_id` is
unique: so a request is done exactly once, whatever crashed when. Leases of a worker that stopped
heart-beating expire and its requests return to the queue; a request that keeps coming back (it may
be what kills workers) fails after `max_attempts`.
"""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

from sqlalchemy import and_, case, false, func, insert, select, text, update
from sqlalchemy.orm import Session

from bulkgen.store.jobs import state_totals
from bulkgen.store.models import (
    Job,
    JobStatus,
    Request,
    RequestState,
    Result,
    Worker,
    WorkerStatus,
    utcnow,
)
from bulkgen.store.packings import CLAIM_KEYS, DEFAULT_PACKING

RUNNABLE_JOBS = (JobStatus.QUEUED.value, JobStatus.RUNNING.value)
SHAPE_SAMPLE = 1024  # pending requests whose mean length sizes a claim
ID_CHUNK = 1000  # ids in one IN list


@dataclass(frozen=True)
class ClaimedRequest:
    id: int
    job_id: int
    row: int
    sample: int
    prompt_token_ids: bytes
    max_new_tokens: int
    seed: int
    attempts: int
    params: dict[str, Any] | None = None  # the request's own settings (models.Request.params)


def register_worker(session: Session, worker_id: str) -> None:
    now = utcnow()
    session.merge(Worker(id=worker_id, hostname=socket.gethostname(), pid=os.getpid(),
                         status=WorkerStatus.RUNNING.value, started_at=now, heartbeat_at=now, progress_at=now))


def heartbeat(session: Session, worker_id: str, progress_at: datetime | None) -> None:
    """Say the worker is alive, and when it last made progress (its own transaction: a lease renewal that waits on
    a row lock must not hold this back)."""
    session.execute(update(Worker).where(Worker.id == worker_id).values(heartbeat_at=utcnow(), progress_at=progress_at))


def renew_leases(session: Session, worker_id: str, lease_s: float, request_ids: list[int]) -> int:
    """Renew the leases of the requests this worker holds (those it knows of: `request_ids`). On PostgreSQL a row
    locked by the worker's own commit in flight is skipped (that commit ends its lease anyway). Returns how many."""
    until = utcnow() + timedelta(seconds=lease_s)
    renewed = 0
    for start in range(0, len(request_ids), ID_CHUNK):
        mine = select(Request.id).where(Request.id.in_(request_ids[start:start + ID_CHUNK]),
                                        Request.lease_owner == worker_id, Request.state == RequestState.RUNNING.value)
        if session.get_bind().dialect.name == "postgresql":
            mine = mine.with_for_update(skip_locked=True)
        renewed += session.execute(update(Request).where(Request.id.in_(mine.scalar_subquery()))
                                   .values(lease_expires_at=until)).rowcount
    return renewed


def reconcile_leases(session: Session, worker_id: str, held_ids: list[int]) -> tuple[list[int], int]:
    """The store's leases against what the worker holds: (those of `held_ids` it no longer holds: cancelled, or
    reclaimed after a stall; how many requests leased under its id it did not know of were given back). The latter
    come from a claim that committed while its answer was lost (a dropped connection): nobody would run them, and
    nobody else could claim them while this worker lives. Given back as a clean stop gives back: no attempt spent."""
    lost = lost_requests(session, worker_id, held_ids)
    orphans = list(session.scalars(select(Request.id).where(
        Request.lease_owner == worker_id, Request.state == RequestState.RUNNING.value)))
    unknown = sorted(set(orphans) - set(held_ids))
    return lost, release(session, worker_id, unknown)


def held_elsewhere(session: Session, worker_id: str, job_ids: list[int]) -> dict[str, int]:
    """Requests of these jobs running on other workers: worker id -> how many."""
    return {owner: int(n) for owner, n in session.execute(
        select(Request.lease_owner, func.count()).where(
            Request.job_id.in_(job_ids), Request.state == RequestState.RUNNING.value,
            Request.lease_owner != worker_id).group_by(Request.lease_owner))}


def stop_worker(session: Session, worker_id: str, num_completed: int, num_output_tokens: int) -> None:
    session.execute(update(Worker).where(Worker.id == worker_id).values(
        status=WorkerStatus.STOPPED.value, heartbeat_at=utcnow(), num_completed=num_completed,
        num_output_tokens=num_output_tokens))


def runnable_jobs(session: Session, job_ids: list[int] | None = None) -> list[Job]:
    """Jobs with work left, oldest first."""
    query = select(Job).where(Job.status.in_(RUNNABLE_JOBS)).order_by(Job.id)
    if job_ids:
        query = query.where(Job.id.in_(job_ids))
    return list(session.scalars(query))


def reclaim_expired(session: Session, max_attempts: int, dead_workers: list[str] = (), lease_s: float = 60.0) -> int:
    """Requests whose lease expired (or whose worker is known dead) go back to the queue, or fail
    once they have been attempted `max_attempts` times. Returns how many were reclaimed. A PostgreSQL server that
    started less than a lease ago reclaims none by expiry: its holders were waiting for it (their heartbeats could
    not land), and each gets a lease's time to come back and renew before its requests go to another worker."""
    now = utcnow()
    expired = Request.lease_expires_at < now
    if session.get_bind().dialect.name == "postgresql" and server_started_within(session, lease_s):
        expired = false()
    lost = and_(Request.state == RequestState.RUNNING.value, expired | Request.lease_owner.in_(list(dead_workers)))
    exhausted = Request.attempts >= max_attempts
    return session.execute(
        update(Request).where(lost).values(
            state=case((exhausted, RequestState.FAILED.value), else_=RequestState.PENDING.value),
            error=case((exhausted, f"abandoned {max_attempts} times by workers that stopped while running it: "
                                   "it may be what crashes them; `bulkgen retry` runs it again"), else_=None),
            lease_owner=None, lease_expires_at=None, updated_at=now)
    ).rowcount


def server_started_within(session: Session, seconds: float) -> bool:
    """Whether the PostgreSQL server started (or restarted, or was failed over to) within `seconds`."""
    return bool(session.scalar(text("SELECT pg_postmaster_start_time() > now() - make_interval(secs => :s)"),
                               {"s": seconds}))


def dead_local_workers(session: Session) -> list[str]:
    """Workers on this host whose process is gone: their leases need not wait to expire."""
    host = socket.gethostname()
    running = session.execute(select(Worker.id, Worker.pid).where(Worker.hostname == host,
                                                                  Worker.status == WorkerStatus.RUNNING.value)).all()
    dead = [worker_id for worker_id, pid in running if pid != os.getpid() and not _pid_alive(pid)]
    if dead:
        session.execute(update(Worker).where(Worker.id.in_(dead)).values(status=WorkerStatus.DEAD.value))
    return dead


def claim(session: Session, worker_id: str, job_ids: list[int], limit: int, lease_s: float,
          packing: str = DEFAULT_PACKING) -> list[ClaimedRequest]:
    """Lease up to `limit` pending requests of the given jobs (older jobs first), in the packer's order
    (packings.CLAIM_KEYS: lpt, by each request's lpt_rank: most output tokens first, then longest prompt, then
    latest submitted, with requests that share a prompt prefix together, a group taken whole; sorted, shortest prompt
    first; fifo, as submitted)."""
    if limit <= 0 or not job_ids:
        return []
    columns = (Request.id, Request.job_id, Request.row, Request.sample, Request.prompt_token_ids,
               Request.max_new_tokens, Request.seed, Request.attempts, Request.params, Request.lpt_rank,
               Request.lpt_group_end)
    query = select(*columns).where(Request.job_id.in_(job_ids), Request.state == RequestState.PENDING.value)
    keys = [getattr(Request, field).desc() if descending else getattr(Request, field)
            for field, descending in CLAIM_KEYS[packing]]
    # ties by id in the direction of the order's keys, so that its index (models.Request) serves it as it is
    # or walked backwards, without a sort
    last = Request.id.desc() if CLAIM_KEYS[packing] and CLAIM_KEYS[packing][-1][1] else Request.id
    query = query.order_by(Request.job_id, *keys, last).limit(limit)
    locking = session.bind.dialect.name == "postgresql"
    if locking:
        query = query.with_for_update(skip_locked=True, of=Request)
    rows = session.execute(query).all()
    if not rows:
        return []
    end = rows[-1]
    if packing == "lpt" and end.lpt_rank is not None and (end.lpt_group_end or 0) > end.lpt_rank + 1:
        # the claim ends inside a group of requests that share a prefix: the rest of the group comes too (up to as
        # many again), so that another worker does not compute the prefix a second time
        rest = (select(*columns).where(Request.job_id == end.job_id, Request.state == RequestState.PENDING.value,
                                       Request.lpt_rank > end.lpt_rank, Request.lpt_rank < end.lpt_group_end)
                .order_by(Request.job_id, Request.lpt_rank, Request.id).limit(limit))
        rows += session.execute(rest.with_for_update(skip_locked=True, of=Request) if locking else rest).all()
    now = utcnow()
    ids = [r.id for r in rows]
    session.execute(update(Request).where(Request.id.in_(ids)).values(
        state=RequestState.RUNNING.value, lease_owner=worker_id, lease_expires_at=now + timedelta(seconds=lease_s),
        attempts=Request.attempts + 1, updated_at=now))
    started = {r.job_id for r in rows}
    session.execute(update(Job).where(Job.id.in_(started), Job.status == JobStatus.QUEUED.value)
                    .values(status=JobStatus.RUNNING.value, started_at=func.coalesce(Job.started_at, now)))
    return [ClaimedRequest(r.id, r.job_id, r.row, r.sample, r.prompt_token_ids, r.max_new_tokens, r.seed,
                           r.attempts + 1, r.params) for r in rows]


def commit_results(session: Session, worker_id: str, results: list[dict[str, Any]],
                   failures: list[tuple[int, str]]) -> tuple[int, int]:
    """Record finished requests still leased by this worker (others were cancelled or reclaimed and
    are dropped). Returns (results written, failures written). Results: one UPDATE ... RETURNING for all
    of them and one multi-row INSERT, whatever their number."""
    now = utcnow()
    written = 0
    if results:
        owned = set(session.scalars(
            update(Request)
            .where(Request.id.in_([r["request_id"] for r in results]), Request.state == RequestState.RUNNING.value,
                   Request.lease_owner == worker_id)
            .values(state=RequestState.COMPLETED.value, error=None, lease_owner=None, lease_expires_at=None,
                    updated_at=now)
            .returning(Request.id)))
        rows = [{"worker_id": worker_id, "finished_at": now, **r} for r in results if r["request_id"] in owned]
        if rows:
            session.execute(insert(Result), rows)
        # a commit tried again after its acknowledgement was lost (outage.py): its rows are there, written once
        landed = [r["request_id"] for r in results if r["request_id"] not in owned]
        written = len(rows) + (session.scalar(select(func.count()).select_from(Result).where(
            Result.request_id.in_(landed), Result.worker_id == worker_id)) if landed else 0)
    failed = 0
    for request_id, reason in failures:
        failed += session.execute(
            update(Request)
            .where(Request.id == request_id, Request.state == RequestState.RUNNING.value,
                   Request.lease_owner == worker_id)
            .values(state=RequestState.FAILED.value, error=reason, lease_owner=None, lease_expires_at=None,
                    updated_at=now)
        ).rowcount
    return written, failed


def release(session: Session, worker_id: str, request_ids: list[int]) -> int:
    """Give unfinished requests back to the queue (a clean stop): this attempt does not count."""
    released = 0
    for start in range(0, len(request_ids), ID_CHUNK):
        released += session.execute(
            update(Request)
            .where(Request.id.in_(request_ids[start:start + ID_CHUNK]), Request.state == RequestState.RUNNING.value,
                   Request.lease_owner == worker_id)
            .values(state=RequestState.PENDING.value, lease_owner=None, lease_expires_at=None,
                    attempts=Request.attempts - 1, updated_at=utcnow())
        ).rowcount
    return released


def lost_requests(session: Session, worker_id: str, request_ids: list[int]) -> list[int]:
    """Those of `request_ids` this worker no longer holds (cancelled, or reclaimed after a stall)."""
    if not request_ids:
        return []
    held = set(session.scalars(select(Request.id).where(
        Request.id.in_(request_ids), Request.state == RequestState.RUNNING.value,
        Request.lease_owner == worker_id)))
    return [i for i in request_ids if i not in held]


@dataclass(frozen=True)
class QueueTotals:
    """Where the requests of some jobs stand (cancelled ones left out)."""

    num_requests: int
    num_done: int  # completed or failed
    num_pending: int
    budget_left: int  # max_new_tokens summed over the requests not done


def queue_totals(session: Session, job_ids: list[int]) -> QueueTotals:
    counts: dict[str, tuple[int, int]] = {}
    for per_state in state_totals(session, job_ids).values():
        for state, (n, budget) in per_state.items():
            if state != RequestState.CANCELLED.value:
                total = counts.get(state, (0, 0))
                counts[state] = (total[0] + n, total[1] + budget)
    done = (RequestState.COMPLETED.value, RequestState.FAILED.value)
    return QueueTotals(num_requests=sum(n for n, _ in counts.values()),
                       num_done=sum(n for state, (n, _) in counts.items() if state in done),
                       num_pending=counts.get(RequestState.PENDING.value, (0, 0))[0],
                       budget_left=sum(b for state, (_, b) in counts.items() if state not in done))


@dataclass(frozen=True)
class QueueShape:
    """What a worker sizes its next claim by."""

    num_pending: int
    num_running: int  # leased, by any worker
    mean_tokens: float  # prompt + max_new_tokens of a pending request, on average
    num_live_workers: int  # workers heart-beating within the lease, idle or holding requests of these jobs


def queue_shape(session: Session, job_ids: list[int], lease_s: float, enough_per_worker: int = 1 << 30) -> QueueShape:
    """The queue as a worker sizes its claim by. Pending requests are counted only up to what would give
    every live worker `enough_per_worker` (beyond that the count changes no claim), and their mean length
    is that of a sample: a million-request job costs a worker a bounded read every second, not a scan."""
    running = session.scalar(select(func.count()).where(Request.job_id.in_(job_ids),
                                                        Request.state == RequestState.RUNNING.value))
    holds = select(Request.id).where(Request.lease_owner == Worker.id, Request.state == RequestState.RUNNING.value)
    live = session.scalar(select(func.count()).select_from(Worker).where(
        Worker.status == WorkerStatus.RUNNING.value, Worker.heartbeat_at >= utcnow() - timedelta(seconds=lease_s),
        ~holds.exists() | holds.where(Request.job_id.in_(job_ids)).exists()))
    cap = max(int(live or 0), 1) * enough_per_worker
    pending_rows = select(Request.num_prompt_tokens, Request.max_new_tokens).where(
        Request.job_id.in_(job_ids), Request.state == RequestState.PENDING.value)
    pending = session.scalar(select(func.count()).select_from(pending_rows.limit(cap).subquery()))
    sample = pending_rows.limit(SHAPE_SAMPLE).subquery()
    tokens = session.scalar(select(func.coalesce(func.avg(sample.c.num_prompt_tokens + sample.c.max_new_tokens), 0)))
    return QueueShape(int(pending), int(running or 0), float(tokens), int(live or 0))


def settle_jobs(session: Session, job_ids: list[int]) -> None:
    """Jobs with no request left to run become completed (or failed, if nothing succeeded). A job with work
    left costs one index probe (a commit runs this: it must not count a million-request job's rows)."""
    for job in session.scalars(select(Job).where(Job.id.in_(job_ids), Job.status.in_(RUNNABLE_JOBS))):
        left = select(Request.id).where(Request.job_id == job.id, Request.state.in_(
            (RequestState.PENDING.value, RequestState.RUNNING.value))).limit(1)
        if session.scalar(left) is not None:
            continue
        counts = state_totals(session, [job.id])[job.id]
        job.status = JobStatus.COMPLETED.value if counts[RequestState.COMPLETED.value][0] or not \
            counts[RequestState.FAILED.value][0] else JobStatus.FAILED.value
        job.finished_at = utcnow()


def is_gone(hostname: str, pid: int) -> bool:
    """Whether a worker's process is known to be gone: on this host and no longer running."""
    return hostname == socket.gethostname() and pid != os.getpid() and not _pid_alive(pid)


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:  # a zombie (killed, not yet reaped) is dead for our purposes
        with open(f"/proc/{pid}/stat") as handle:
            return handle.read().split(") ", 1)[1][:1] != "Z"
    except (OSError, IndexError):
        return True
