"""The job store's tables: jobs, requests (one per input row × sample), results, workers, and the workers'
run samples (what `bulkgen report` plots).

The schema exists only through the Alembic migrations in `migrations/`; a test checks that those
migrations and these models agree.
"""

from __future__ import annotations

import enum
from array import array
from datetime import UTC, datetime
from typing import Any

from sqlalchemy import (
    JSON,
    BigInteger,
    DateTime,
    Float,
    ForeignKey,
    Index,
    Integer,
    LargeBinary,
    String,
    Text,
    UniqueConstraint,
)
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column

from bulkgen.store.packings import CLAIM_KEYS


class Base(DeclarativeBase):
    pass


class JobStatus(enum.StrEnum):
    SUBMITTING = "submitting"  # requests still being written; workers leave it alone
    QUEUED = "queued"
    RUNNING = "running"
    # Anything after RUNNING is final until `retry`.
    COMPLETED = "completed"
    FAILED = "failed"
    CANCELLED = "cancelled"


class WorkerStatus(enum.StrEnum):
    RUNNING = "running"
    STOPPED = "stopped"  # ended its run
    DEAD = "dead"  # its process is gone (found by a worker of the same host) or its heartbeat stopped


class RequestState(enum.StrEnum):
    PENDING = "pending"
    RUNNING = "running"  # leased by a worker
    # Anything after RUNNING is final until `retry`.
    COMPLETED = "completed"
    FAILED = "failed"
    CANCELLED = "cancelled"


REQUEST_STATES = tuple(s.value for s in RequestState)
FINAL_JOB_STATES = tuple(s.value for s in JobStatus)[list(JobStatus).index(JobStatus.RUNNING) + 1:]


def utcnow() -> datetime:
    """Naive UTC, the same on SQLite (which drops time zones) and PostgreSQL."""
    return datetime.now(UTC).replace(tzinfo=None)


def iso_utc(moment: datetime | None) -> str | None:
    """A stored (naive UTC) moment as JSON shows it: 2026-12-02T15:20:31Z."""
    return moment.isoformat(timespec="seconds") + "Z" if moment else None


def pack_ids(token_ids: list[int] | tuple[int, ...]) -> bytes:
    """Token ids as little-endian int32 bytes: a quarter of the size of JSON, and fast."""
    return array("i", token_ids).tobytes()


def unpack_ids(blob: bytes | None) -> list[int]:
    out = array("i")
    if blob:
        out.frombytes(blob)
    return out.tolist()


class Job(Base):
    __tablename__ = "jobs"

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    name: Mapped[str | None] = mapped_column(String(200))
    status: Mapped[str] = mapped_column(String(16), default=JobStatus.QUEUED.value, index=True)
    model: Mapped[str] = mapped_column(String(1000))  # as the user named it (alias, path or hub name)
    model_path: Mapped[str] = mapped_column(String(1000))  # the resolved Hugging Face directory
    # A hub name's commit, pinned at submit: a worker elsewhere or later runs the same weights (resolve.model_dir)
    model_revision: Mapped[str | None] = mapped_column(String(64))
    input_path: Mapped[str] = mapped_column(String(4000))  # absolute path of the Parquet file
    input_fingerprint: Mapped[str] = mapped_column(String(200))  # size and mtime, checked by export
    input_columns: Mapped[list[str]] = mapped_column(JSON)
    spec: Mapped[dict[str, Any]] = mapped_column(JSON)  # the whole job spec, sampling included
    num_requests: Mapped[int] = mapped_column(Integer, default=0)
    created_at: Mapped[datetime] = mapped_column(DateTime, default=utcnow)
    started_at: Mapped[datetime | None] = mapped_column(DateTime)
    finished_at: Mapped[datetime | None] = mapped_column(DateTime)
    # the latest `bulkgen plan` of it: {"predicted": plan.Prediction's dict, "options": what it assumed, "at"}
    plan: Mapped[dict[str, Any] | None] = mapped_column(JSON)


class Request(Base):
    __tablename__ = "requests"
    __table_args__ = (
        UniqueConstraint("job_id", "row", "sample", name="uq_requests_job_row_sample"),
        # A claim reads a job's pending requests in its packing's order (packings.CLAIM_KEYS) and takes the
        # first few: one index per order, built from its keys, makes that a short index walk instead of
        # sorting every pending request (0.5 s a claim at 500,000 pending on PostgreSQL). fifo's also serves
        # every (job, state) lookup.
        *(Index(f"ix_requests_claim_{name}", "job_id", "state", *(field for field, _ in keys), "id")
          for name, keys in CLAIM_KEYS.items()),
        Index("ix_requests_lease", "state", "lease_expires_at"),
    )

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    job_id: Mapped[int] = mapped_column(ForeignKey("jobs.id", ondelete="CASCADE"))
    row: Mapped[int] = mapped_column(Integer)  # index of the input row, from 0
    sample: Mapped[int] = mapped_column(Integer, default=0)  # 0..n-1
    custom_id: Mapped[str | None] = mapped_column(String(1000))
    prompt: Mapped[str | None] = mapped_column(Text)  # rendered text, as tokenized
    prompt_token_ids: Mapped[bytes | None] = mapped_column(LargeBinary)  # see pack_ids
    num_prompt_tokens: Mapped[int] = mapped_column(Integer, default=0)
    max_new_tokens: Mapped[int] = mapped_column(Integer)  # the rest of sampling is the job's, unless params say
    # its place in the job's lpt order, shared prefixes kept together (packings.prefix_order), given when the job
    # opens (jobs.open_job)
    lpt_rank: Mapped[int | None] = mapped_column(Integer)
    lpt_group_end: Mapped[int | None] = mapped_column(Integer)  # the rank past its innermost prefix group's last
    # A request's own settings, where its line gave them (OpenAI batch files): {"sampling": {field: value}
    # over the job's, "openai": {"url", "model"}}; None for rows of a table
    params: Mapped[dict[str, Any] | None] = mapped_column(JSON)
    seed: Mapped[int] = mapped_column(BigInteger)
    state: Mapped[str] = mapped_column(String(16), default=RequestState.PENDING.value)
    attempts: Mapped[int] = mapped_column(Integer, default=0)
    error: Mapped[str | None] = mapped_column(Text)
    lease_owner: Mapped[str | None] = mapped_column(String(200))
    lease_expires_at: Mapped[datetime | None] = mapped_column(DateTime)
    updated_at: Mapped[datetime] = mapped_column(DateTime, default=utcnow)


class Result(Base):
    __tablename__ = "results"

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    # Unique: a request is done exactly once, whatever a crashed worker did.
    request_id: Mapped[int] = mapped_column(ForeignKey("requests.id", ondelete="CASCADE"), unique=True)
    job_id: Mapped[int] = mapped_column(ForeignKey("jobs.id", ondelete="CASCADE"), index=True)
    text: Mapped[str] = mapped_column(Text)
    token_ids: Mapped[bytes] = mapped_column(LargeBinary)
    finish_reason: Mapped[str] = mapped_column(String(16))  # stop | length | eos
    num_prompt_tokens: Mapped[int] = mapped_column(Integer)
    num_output_tokens: Mapped[int] = mapped_column(Integer)
    num_cached_tokens: Mapped[int] = mapped_column(Integer, default=0)  # prompt tokens reused from the prefix cache
    logprobs: Mapped[list[Any] | None] = mapped_column(JSON)
    worker_id: Mapped[str | None] = mapped_column(String(200))
    time_to_first_token_s: Mapped[float | None] = mapped_column(Float)
    latency_s: Mapped[float | None] = mapped_column(Float)
    finished_at: Mapped[datetime] = mapped_column(DateTime, default=utcnow)


class Worker(Base):
    __tablename__ = "workers"

    id: Mapped[str] = mapped_column(String(200), primary_key=True)  # host:pid:random
    hostname: Mapped[str] = mapped_column(String(200))
    pid: Mapped[int] = mapped_column(Integer)
    status: Mapped[str] = mapped_column(String(16), default=WorkerStatus.RUNNING.value)  # a WorkerStatus
    started_at: Mapped[datetime] = mapped_column(DateTime, default=utcnow)
    heartbeat_at: Mapped[datetime] = mapped_column(DateTime, default=utcnow)
    # The last progress it made (a step, a claim, a commit), as its heartbeat last said: a worker alive and holding
    # requests but not progressing is stalled (`bulkgen status`), whatever its heartbeat
    progress_at: Mapped[datetime | None] = mapped_column(DateTime)
    num_completed: Mapped[int] = mapped_column(Integer, default=0)
    num_output_tokens: Mapped[int] = mapped_column(Integer, default=0)
    # What it ran with, once its engine is up: engine line, dtype, KV cache, packing (`bulkgen report`)
    settings: Mapped[dict[str, Any] | None] = mapped_column(JSON)


class RunSample(Base):
    """What one worker did for one job in one interval (~10 s): a few rows a minute per worker, so a report
    of a million-row job reads thousands of rows, not millions. A worker serving several jobs of one model
    at once writes a row for each, the engine's tokens shared by what each job finished (recorder.py)."""

    __tablename__ = "run_samples"
    __table_args__ = (Index("ix_run_samples_job_started", "job_id", "started_at"),)

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    job_id: Mapped[int] = mapped_column(ForeignKey("jobs.id", ondelete="CASCADE"))
    worker_id: Mapped[str] = mapped_column(String(200))
    started_at: Mapped[datetime] = mapped_column(DateTime)
    seconds: Mapped[float] = mapped_column(Float)
    num_steps: Mapped[int] = mapped_column(Integer)
    num_output_tokens: Mapped[int] = mapped_column(Integer)  # generated in the interval, finished or not
    num_prompt_tokens: Mapped[int] = mapped_column(Integer)  # prompt tokens computed (recomputation included)
    num_finished: Mapped[int] = mapped_column(Integer)  # requests that finished (completed or failed)
    num_failed: Mapped[int] = mapped_column(Integer)
    num_preemptions: Mapped[int] = mapped_column(Integer)
    mean_running: Mapped[float] = mapped_column(Float)  # sequences in a step, over the interval's steps
    max_running: Mapped[int] = mapped_column(Integer)
    mean_kv_usage: Mapped[float] = mapped_column(Float)  # share of KV blocks held after scheduling
    max_kv_usage: Mapped[float] = mapped_column(Float)
