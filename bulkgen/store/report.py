"""The reads behind `bulkgen report`: every request's outcome in a few columns (one query, no text), the rows a
page shows, and the constrained outputs to validate, a page at a time."""

from __future__ import annotations

from typing import Any

from sqlalchemy import select
from sqlalchemy.orm import Session

from bulkgen.store.jobs import RETRYABLE
from bulkgen.store.models import Request, RequestState, Result


def outcomes(session: Session, job_id: int) -> list[Any]:
    """(state, prompt tokens, finish reason, output tokens, time to first token, latency) of each request of
    the job; result columns None where it has no result."""
    query = (select(Request.state, Request.num_prompt_tokens, Result.finish_reason, Result.num_output_tokens,
                    Result.time_to_first_token_s, Result.latency_s)
             .outerjoin(Result, Result.request_id == Request.id).where(Request.job_id == job_id))
    return list(session.execute(query).all())


def commits(session: Session, job_id: int) -> list[Any]:
    """(committed at, worker, output tokens) of the job's results: its throughput where no samples were kept."""
    query = select(Result.finished_at, Result.worker_id, Result.num_output_tokens).where(Result.job_id == job_id)
    return list(session.execute(query).all())


def failures(session: Session, job_id: int) -> list[Any]:
    """(row, sample, custom_id, error, retryable) of the job's failed requests, in input order."""
    query = (select(Request.row, Request.sample, Request.custom_id, Request.error, RETRYABLE.label("retryable"))
             .where(Request.job_id == job_id, Request.state == RequestState.FAILED.value)
             .order_by(Request.row, Request.sample))
    return list(session.execute(query).all())


def rows(session: Session, job_id: int, row_ids: list[int]) -> list[Any]:
    """Requests of these input rows with their results: (row, sample, state, prompt, text, finish reason,
    output tokens, error)."""
    query = (select(Request.row, Request.sample, Request.state, Request.prompt, Result.text, Result.finish_reason,
                    Result.num_output_tokens, Request.error)
             .outerjoin(Result, Result.request_id == Request.id)
             .where(Request.job_id == job_id, Request.row.in_(row_ids)).order_by(Request.row, Request.sample))
    return list(session.execute(query).all())


def num_rows(session: Session, job_id: int) -> int:
    top = session.scalar(select(Request.row).where(Request.job_id == job_id).order_by(Request.row.desc()).limit(1))
    return 0 if top is None else top + 1


def constrained_page(session: Session, job_id: int, after_id: int, limit: int) -> list[Any]:
    """(result id, text, finish reason, the request's params) of committed results past after_id, by id."""
    query = (select(Result.id, Result.text, Result.finish_reason, Request.params)
             .join(Request, Request.id == Result.request_id)
             .where(Result.job_id == job_id, Result.id > after_id).order_by(Result.id).limit(limit))
    return list(session.execute(query).all())
