"""Job-level operations of the store: create (a job and its request rows), describe, list, cancel, retry."""

from __future__ import annotations

from datetime import datetime
from typing import Any

from sqlalchemy import delete, func, insert, select, update
from sqlalchemy.orm import Session

from bulkgen.errors import ConfigError, NotFoundError
from bulkgen.progress import eta_s
from bulkgen.store.models import (
    REQUEST_STATES,
    Job,
    JobStatus,
    Request,
    RequestState,
    Result,
    iso_utc,
    pack_ids,
    utcnow,
)
from bulkgen.store.packings import prefix_order


def new_job(session: Session, *, model: str, model_path: str, spec: dict[str, Any], name: str | None = None,
            input_path: str = "-", input_fingerprint: str = "-", input_columns: list[str] | None = None,
            model_revision: str | None = None) -> int:
    """A job being submitted (invisible to workers until open_job); its id. Submit and the bench's jobs
    both start here."""
    job = Job(status=JobStatus.SUBMITTING.value, name=name, model=model, model_path=model_path,
              model_revision=model_revision, spec=spec, input_path=input_path,
              input_fingerprint=input_fingerprint, input_columns=input_columns or [])
    session.add(job)
    session.flush()
    return job.id


def request_row(job_id: int, row: int, sample: int, token_ids: list[int] | None, max_new_tokens: int, seed: int,
                *, error: str | None = None, custom_id: str | None = None, prompt: str | None = None,
                params: dict[str, Any] | None = None, now: datetime | None = None) -> dict[str, Any]:
    """One request as insert_requests takes it: pending with its token ids, or failed with its reason."""
    return {"job_id": job_id, "row": row, "sample": sample, "custom_id": custom_id, "prompt": prompt,
            "prompt_token_ids": pack_ids(token_ids) if error is None and token_ids is not None else None,
            "num_prompt_tokens": len(token_ids) if token_ids is not None else 0,
            "max_new_tokens": max(int(max_new_tokens), 1), "seed": seed,
            "state": RequestState.FAILED.value if error else RequestState.PENDING.value,
            "attempts": 0, "error": error, "updated_at": now or utcnow(), "params": params}


def insert_requests(session: Session, rows: list[dict[str, Any]]) -> None:
    if rows:
        session.execute(insert(Request), rows)


def open_job(session: Session, job_id: int, num_requests: int) -> None:
    """The last step of submit: each pending request gets its place in the lpt order (`rank_requests`), and the job
    becomes visible to workers."""
    rank_requests(session, job_id)
    session.execute(update(Job).where(Job.id == job_id)
                    .values(status=JobStatus.QUEUED.value, num_requests=num_requests))


def rank_requests(session: Session, job_id: int) -> None:
    """Each pending request's lpt_rank: its place in the job's lpt order (most output tokens first, then the longest
    prompt, then the latest submitted), requests that share a prompt prefix kept together (packings.prefix_order);
    and its lpt_group_end, the rank past its innermost group (a claim takes a group whole)."""
    rows = session.execute(select(Request.id, Request.prompt_token_ids, Request.max_new_tokens,
                                  Request.num_prompt_tokens)
                           .where(Request.job_id == job_id, Request.state == RequestState.PENDING.value)).all()
    if not rows:
        return
    ends: list[int] = []
    ranked = prefix_order([(-r.max_new_tokens, -r.num_prompt_tokens, -r.id) for r in rows],
                          [r.prompt_token_ids or b"" for r in rows], group_ends=ends)
    session.execute(update(Request), [{"id": rows[i].id, "lpt_rank": rank, "lpt_group_end": ends[i]}
                                      for rank, i in enumerate(ranked)])


def delete_job(session: Session, job_id: int) -> None:
    session.execute(delete(Result).where(Result.job_id == job_id))
    session.execute(delete(Request).where(Request.job_id == job_id))
    session.execute(delete(Job).where(Job.id == job_id))


def get_job(session: Session, job_id: int) -> Job:
    job = session.get(Job, job_id)
    if job is None:
        raise NotFoundError(f"no job {job_id}: `bulkgen list` shows the jobs there are")
    return job


def state_totals(session: Session, job_ids: list[int]) -> dict[int, dict[str, tuple[int, int]]]:
    """Each job's requests by state, every state present: (how many, their max_new_tokens summed). The one
    count of requests by state: status, the queue's totals and the settling of finished jobs read it."""
    totals = {job_id: dict.fromkeys(REQUEST_STATES, (0, 0)) for job_id in job_ids}
    query = (select(Request.job_id, Request.state, func.count(), func.coalesce(func.sum(Request.max_new_tokens), 0))
             .where(Request.job_id.in_(job_ids)).group_by(Request.job_id, Request.state))
    for job_id, state, count, budget in session.execute(query):
        totals[job_id][state] = (int(count), int(budget))
    return totals


def token_totals(session: Session, job_ids: list[int]) -> dict[int, tuple[int, int]]:
    """(prompt tokens, output tokens) of the committed results of each job."""
    totals = dict.fromkeys(job_ids, (0, 0))
    query = (select(Result.job_id, func.sum(Result.num_prompt_tokens), func.sum(Result.num_output_tokens))
             .where(Result.job_id.in_(job_ids)).group_by(Result.job_id))
    for job_id, prompt, output in session.execute(query):
        totals[job_id] = (int(prompt or 0), int(output or 0))
    return totals


def describe_jobs(session: Session, jobs: list[Job]) -> list[dict[str, Any]]:
    """What `status` and `list` show: counts by request state, tokens, throughput, ETA."""
    ids = [job.id for job in jobs]
    totals = state_totals(session, ids)
    tokens = token_totals(session, ids)
    return [_summary(job, {state: n for state, (n, _) in totals[job.id].items()}, tokens[job.id]) for job in jobs]


def list_jobs(session: Session, limit: int | None = None) -> list[Job]:
    query = select(Job).order_by(Job.id.desc())
    if limit:
        query = query.limit(limit)
    return list(session.scalars(query))


def cancel_job(session: Session, job_id: int) -> int:
    """Cancel what has not finished; committed results stay. Returns how many requests were cancelled.

    Workers holding a cancelled request drop it: their commit only lands on requests still theirs."""
    job = get_job(session, job_id)
    if job.status in (JobStatus.COMPLETED.value, JobStatus.CANCELLED.value):
        return 0
    cancelled = session.execute(
        update(Request)
        .where(Request.job_id == job_id,
               Request.state.in_([RequestState.PENDING.value, RequestState.RUNNING.value]))
        .values(state=RequestState.CANCELLED.value, lease_owner=None, lease_expires_at=None, updated_at=utcnow())
    ).rowcount
    job.status = JobStatus.CANCELLED.value
    job.finished_at = utcnow()
    return cancelled


# a failed request that running again can change: it failed in a run (an engine error, a run's limits, workers that
# stopped while running it), not refused at submit for its input (a null prompt, one too long for the model)
RETRYABLE = Request.prompt_token_ids.is_not(None) & (Request.attempts > 0)


def num_retryable(session: Session, job_id: int) -> int:
    """How many of the job's failed requests `retry` puts back in the queue."""
    return session.scalar(select(func.count()).select_from(Request).where(
        Request.job_id == job_id, Request.state == RequestState.FAILED.value, RETRYABLE)) or 0


def retry_job(session: Session, job_id: int) -> int:
    """Put failed requests that a run can change (RETRYABLE), and a cancelled job's cancelled ones, back in the
    queue, attempts reset."""
    job = get_job(session, job_id)
    if job.status == JobStatus.SUBMITTING.value:
        raise ConfigError(f"job {job_id} is still being submitted: wait for submit to finish")
    which = (Request.state == RequestState.FAILED.value) & RETRYABLE
    if job.status == JobStatus.CANCELLED.value:
        which = which | ((Request.state == RequestState.CANCELLED.value) & Request.prompt_token_ids.is_not(None))
    requeued = session.execute(
        update(Request)
        .where(Request.job_id == job_id, which)
        .values(state=RequestState.PENDING.value, attempts=0, error=None, lease_owner=None,
                lease_expires_at=None, updated_at=utcnow())
    ).rowcount
    if requeued:
        job.status = JobStatus.QUEUED.value
        job.finished_at = None
    return requeued


def first_errors(session: Session, job_id: int, limit: int = 5) -> list[tuple[int, int, str]]:
    """(row, sample, error) of the job's first failed requests, in input order."""
    query = (select(Request.row, Request.sample, Request.error)
             .where(Request.job_id == job_id, Request.state == RequestState.FAILED.value)
             .order_by(Request.row, Request.sample).limit(limit))
    return [tuple(r) for r in session.execute(query)]


def results_page(session: Session, job_id: int, start: int, end: int) -> list[Any]:
    """Every request of input rows [start, end) with its result (None columns where it has none), in
    row then sample order: what export writes."""
    query = (select(Request.row, Request.sample, Request.custom_id, Request.state, Request.error,
                    Request.num_prompt_tokens, Result.text, Result.finish_reason, Result.num_output_tokens,
                    Result.num_cached_tokens, Result.time_to_first_token_s, Result.latency_s,
                    Result.token_ids, Result.logprobs, Request.params, Result.finished_at)
             .outerjoin(Result, Result.request_id == Request.id)
             .where(Request.job_id == job_id, Request.row >= start, Request.row < end)
             .order_by(Request.row, Request.sample))
    return list(session.execute(query).all())


def _summary(job: Job, counts: dict[str, int], tokens: tuple[int, int]) -> dict[str, Any]:
    total = sum(counts.values())
    done = counts[RequestState.COMPLETED.value] + counts[RequestState.FAILED.value]
    end = job.finished_at or utcnow()
    elapsed = (end - job.started_at).total_seconds() if job.started_at else None
    output_rate = tokens[1] / elapsed if elapsed and elapsed > 0 else None
    remaining = counts[RequestState.PENDING.value] + counts[RequestState.RUNNING.value]
    eta = eta_s(remaining, done / elapsed) if elapsed and done and remaining and job.status == JobStatus.RUNNING \
        else None
    return {
        "id": job.id,
        "name": job.name,
        "status": job.status,
        "model": job.model,
        "model_revision": job.model_revision,
        "input": job.input_path,
        "counts": counts,
        "total": total,
        "num_prompt_tokens": tokens[0],
        "num_output_tokens": tokens[1],
        "output_tok_per_s": round(output_rate, 2) if output_rate is not None else None,
        "elapsed_s": round(elapsed, 1) if elapsed is not None else None,
        "eta_s": round(eta, 1) if eta is not None else None,
        "created_at": iso_utc(job.created_at),
        "started_at": iso_utc(job.started_at),
        "finished_at": iso_utc(job.finished_at),
    }
