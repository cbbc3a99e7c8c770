"""`bulkgen bench report`: how long `bulkgen report` takes on a big job, and what the run samples cost in the
store. Builds a finished job of N requests straight through the store (results as a worker writes them:
token ids, text, timings; a twentieth failed), with the samples of W workers over H hours, then times the
figures (`report --json`) and the page (plots included), and sizes the samples against the whole database."""

from __future__ import annotations

import random
import time
from datetime import timedelta
from typing import Any

from sqlalchemy import insert, text, update

from bulkgen.engine.protocol import FinishReason
from bulkgen.recorder import SAMPLE_INTERVAL_S
from bulkgen.report.figures import build_report
from bulkgen.report.page import render
from bulkgen.store import jobs as job_ops
from bulkgen.store.db import Store
from bulkgen.store.models import Request, RequestState, Result, RunSample, pack_ids, utcnow

WORDS = "alpha beta gamma delta river stone cloud maple ember quartz".split()
CHUNK = 10_000


def make_big_job(store: Store, num_rows: int, num_workers: int = 4, hours: float = 8.0, seed: int = 0) -> int:
    rng = random.Random(seed)
    start = utcnow() - timedelta(hours=hours)
    with store.session_scope(write=True) as session:
        job_id = job_ops.new_job(session, model="bench-model", model_path="-", name="report-scale",
                                 spec={"sampling": {"max_new_tokens": 256, "temperature": 0.0}, "n": 1})
    workers = [f"bench-host-{w}:{1000 + w}:0000000{w}" for w in range(num_workers)]
    for first in range(0, num_rows, CHUNK):
        rows = range(first, min(first + CHUNK, num_rows))
        prompts = {row: [rng.randrange(32000) for _ in range(rng.randint(20, 400))] for row in rows}
        with store.session_scope(write=True) as session:
            job_ops.insert_requests(session, [job_ops.request_row(job_id, row, 0, prompts[row], 256, row,
                                                                  prompt=" ".join(rng.choices(WORDS, k=40)))
                                              for row in rows])
            ids = dict(session.execute(text("SELECT row, id FROM requests WHERE job_id = :j AND row >= :a "
                                            "AND row < :b"), {"j": job_id, "a": rows[0], "b": rows[-1] + 1}).all())
            failed = [row for row in rows if rng.random() < 0.05]
            results = []
            for row in rows:
                if row in failed:
                    continue
                num_out = 256 if rng.random() < 0.12 else rng.randint(5, 255)
                results.append({"request_id": ids[row], "job_id": job_id,
                                "text": " ".join(rng.choices(WORDS, k=num_out)),
                                "token_ids": pack_ids([rng.randrange(32000) for _ in range(num_out)]),
                                "finish_reason": FinishReason.LENGTH if num_out == 256 else FinishReason.STOP,
                                "num_prompt_tokens": len(prompts[row]), "num_output_tokens": num_out,
                                "worker_id": workers[row % num_workers], "time_to_first_token_s": rng.uniform(0.1, 3),
                                "latency_s": rng.uniform(2, 60), "finished_at": start + timedelta(
                                    seconds=hours * 3600 * row / num_rows)})
            session.execute(insert(Result), results)
            session.execute(update(Request).where(Request.job_id == job_id, Request.row.in_(list(rows)))
                            .values(state=RequestState.COMPLETED.value))
            if failed:
                session.execute(update(Request).where(Request.job_id == job_id, Request.row.in_(failed))
                                .values(state=RequestState.FAILED.value,
                                        error=f"the prompt has {rng.randint(5000, 9000)} tokens; the model's "
                                              "context is 4096 tokens, which must also hold the output"))
    _samples(store, job_id, workers, start, hours, rng)
    with store.session_scope(write=True) as session:
        job_ops.open_job(session, job_id, num_rows)
        session.execute(text("UPDATE jobs SET status = 'completed', started_at = :s, finished_at = :f WHERE id = :j"),
                        {"s": start, "f": start + timedelta(hours=hours), "j": job_id})
    return job_id


def _samples(store: Store, job_id: int, workers: list[str], start: Any, hours: float, rng: random.Random) -> None:
    rows = []
    for worker in workers:
        for i in range(int(hours * 3600 / SAMPLE_INTERVAL_S)):
            rows.append({"job_id": job_id, "worker_id": worker, "seconds": SAMPLE_INTERVAL_S,
                         "started_at": start + timedelta(seconds=i * SAMPLE_INTERVAL_S), "num_steps": 200,
                         "num_output_tokens": rng.randint(3000, 5000), "num_prompt_tokens": rng.randint(0, 20000),
                         "num_finished": rng.randint(10, 20), "num_failed": 0, "num_preemptions": 0,
                         "mean_running": rng.uniform(100, 256), "max_running": 256,
                         "mean_kv_usage": rng.uniform(0.6, 0.95), "max_kv_usage": 0.97})
    for first in range(0, len(rows), CHUNK):
        with store.session_scope(write=True) as session:
            session.execute(insert(RunSample), rows[first:first + CHUNK])


def measure(store: Store, job_id: int) -> dict[str, Any]:
    began = time.perf_counter()
    figures = build_report(store, [job_id])
    figures_s = time.perf_counter() - began
    began = time.perf_counter()
    page = render(figures)
    page_s = time.perf_counter() - began
    return {"job_id": job_id, "num_requests": figures["jobs"][0]["summary"]["total"],
            "figures_s": round(figures_s, 2), "page_s": round(page_s, 2), "page_bytes": len(page),
            **store_sizes(store)}


def store_sizes(store: Store) -> dict[str, Any]:
    """Bytes of the run samples (table and index) and of the whole database, where the backend says."""
    with store.session_scope() as session:
        if store.engine.dialect.name == "sqlite":
            sizes = dict(session.execute(text("SELECT name, SUM(pgsize) FROM dbstat GROUP BY name")).all())
            samples = sizes.get("run_samples", 0) + sizes.get("ix_run_samples_job_started", 0)
            total = sum(sizes.values())
        else:
            samples = session.scalar(text("SELECT pg_total_relation_size('run_samples')"))
            total = sum(session.scalar(text(f"SELECT pg_total_relation_size('{t}')"))
                        for t in ("jobs", "requests", "results", "workers", "run_samples"))
    return {"samples_bytes": int(samples), "database_bytes": int(total),
            "samples_share": round(samples / total, 4) if total else None}
