"""Real `bulkgen run` processes: killed with SIGKILL at random moments, stopped with SIGTERM, run two
at a time on one database, and cancelled from outside."""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pyarrow.parquet as pq
from sqlalchemy import func, select

from bulkgen.store import open_store
from bulkgen.store.models import Request, Result
from tests.helpers import invoke, invoke_json, write_parquet

NUM_ROWS = 300
RUN_FLAGS = ["--kv-cache-memory", "16MiB", "--max-num-seqs", "32", "--commit-every", "8",
             "--commit-interval", "0.2", "--lease-seconds", "5", "--no-progress"]


def make_job(tmp_path: Path, model: Path, db: str, num_rows: int = NUM_ROWS, max_new: int = 24) -> int:
    rng = random.Random(0)
    prompts = [" ".join(rng.choice(["alpha", "beta", "gamma", "delta", "river", "stone"])
                        for _ in range(rng.randint(2, 60))) for _ in range(num_rows)]
    data = write_parquet(tmp_path / "in.parquet", {"prompt": prompts, "n": list(range(num_rows))})
    return invoke_json("submit", data, "--model", model, "--max-new-tokens", max_new, "--db", db)["job_id"]


def start_worker(db: str, *extra: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "bulkgen", "run", "--db", db, *RUN_FLAGS, *extra],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "PYTHONUNBUFFERED": "1"})


def num_results(db: str) -> int:
    with open_store(db).session_scope() as session:
        return session.scalar(select(func.count()).select_from(Result))


def wait_for_results(db: str, more_than: int, proc: subprocess.Popen, timeout: float = 120) -> int:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        count = num_results(db)
        if count > more_than or proc.poll() is not None:
            return count
        time.sleep(0.05)
    raise AssertionError("the worker made no progress")


def export_rows(db: str, job_id: int, path: Path) -> list[dict]:
    invoke("export", job_id, "-o", path, "--db", db)
    return pq.read_table(path).to_pylist()


def uninterrupted_run(tmp_path: Path, model: Path, db: str) -> list[dict]:
    """The export of make_job's job run by one worker from start to end: what an interrupted run must equal."""
    (tmp_path / "ref").mkdir()
    job_id = make_job(tmp_path / "ref", model, db)
    done = subprocess.run([sys.executable, "-m", "bulkgen", "run", "--db", db, *RUN_FLAGS], capture_output=True,
                          text=True)
    assert done.returncode == 0, done.stderr
    return export_rows(db, job_id, tmp_path / "reference.parquet")


def test_sigkill_at_random_moments_then_resume_equals_an_uninterrupted_run(tmp_path: Path, tiny_model_dir: Path,
                                                                          make_db) -> None:
    reference = uninterrupted_run(tmp_path, tiny_model_dir, make_db("reference"))

    db = make_db("crash")
    job_id = make_job(tmp_path, tiny_model_dir, db)
    rng = random.Random(42)
    kills = 0
    committed = 0
    # Kills land while requests are in flight, and a slow machine may catch the same ones every time:
    # allow more attempts than kills, so that this tests resuming, not the repeat-offender limit (tested
    # in test_worker.py).
    attempts = ["--max-attempts", "10"]
    while kills < 4:
        proc = start_worker(db, *attempts)
        committed = wait_for_results(db, committed, proc)
        if proc.poll() is not None:
            break  # finished before we could kill it
        time.sleep(rng.uniform(0.0, 0.4))
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        kills += 1
        committed = num_results(db)
    assert kills >= 3, "the job finished too fast to be interrupted"
    assert 0 < committed < NUM_ROWS
    final = subprocess.run([sys.executable, "-m", "bulkgen", "run", "--db", db, *RUN_FLAGS, *attempts],
                           capture_output=True, text=True)
    assert final.returncode == 0, final.stderr
    rows = export_rows(db, job_id, tmp_path / "resumed.parquet")
    assert [r["row"] for r in rows] == list(range(NUM_ROWS))  # every request exactly once
    assert all(r["status"] == "completed" for r in rows)
    assert [r["output"] for r in rows] == [r["output"] for r in reference]
    assert [r["finish_reason"] for r in rows] == [r["finish_reason"] for r in reference]
    with open_store(db).session_scope() as session:
        assert session.scalar(select(func.count()).select_from(Result)) == NUM_ROWS
        assert session.scalar(select(func.count()).select_from(Request).where(Request.attempts > 1)) > 0


def test_sigterm_drains_commits_and_releases(tmp_path: Path, tiny_model_dir: Path, make_db) -> None:
    db = make_db("term")
    job_id = make_job(tmp_path, tiny_model_dir, db, max_new=64)
    proc = start_worker(db)
    wait_for_results(db, 5, proc)
    proc.send_signal(signal.SIGTERM)
    _, stderr = proc.communicate(timeout=60)
    assert proc.returncode == 0, stderr
    assert "stopped by SIGTERM" in stderr and "requests released" in stderr
    status = invoke_json("status", job_id, "--db", db)
    assert status["counts"]["running"] == 0  # nothing left leased
    assert status["counts"]["completed"] + status["counts"]["pending"] == NUM_ROWS
    assert 0 < status["counts"]["completed"] < NUM_ROWS
    with open_store(db).session_scope() as session:  # a released request's attempt did not count
        assert session.scalar(select(func.max(Request.attempts)).where(Request.state == "pending")) == 0
    done = subprocess.run([sys.executable, "-m", "bulkgen", "run", "--db", db, *RUN_FLAGS],
                          capture_output=True, text=True)
    assert done.returncode == 0
    assert invoke_json("status", job_id, "--db", db)["counts"]["completed"] == NUM_ROWS


def test_two_workers_share_the_queue_without_doing_anything_twice(tmp_path: Path, tiny_model_dir: Path, make_db) -> None:
    db = make_db("two")
    job_id = make_job(tmp_path, tiny_model_dir, db)
    workers = [start_worker(db, "--max-num-seqs", "8", "--json") for _ in range(2)]
    outputs = [w.communicate(timeout=300) for w in workers]
    assert all(w.returncode == 0 for w in workers), [o[1] for o in outputs]
    import json

    summaries = [json.loads(out) for out, _ in outputs]
    assert sum(s["completed"] for s in summaries) == NUM_ROWS
    assert all(s["completed"] > 0 for s in summaries), summaries  # both did work
    with open_store(db).session_scope() as session:
        assert session.scalar(select(func.count()).select_from(Result)) == NUM_ROWS
        assert session.scalar(select(func.max(Request.attempts))) == 1  # nobody claimed a request twice
        by_worker = dict(session.execute(select(Result.worker_id, func.count()).group_by(Result.worker_id)).all())
    assert sorted(by_worker.values()) == sorted(s["completed"] for s in summaries)
    assert invoke_json("status", job_id, "--db", db)["status"] == "completed"


def test_cancel_during_a_run_stops_the_worker_taking_its_requests(tmp_path: Path, tiny_model_dir: Path, make_db) -> None:
    db = make_db("cancel")
    job_id = make_job(tmp_path, tiny_model_dir, db, max_new=64)
    proc = start_worker(db, "--lease-seconds", "2")
    wait_for_results(db, 3, proc)
    invoke("cancel", job_id, "--db", db)
    proc.communicate(timeout=60)
    assert proc.returncode == 0
    status = invoke_json("status", job_id, "--db", db)
    assert status["status"] == "cancelled"
    assert status["counts"]["pending"] == 0 and status["counts"]["running"] == 0
    assert status["counts"]["completed"] < NUM_ROWS and status["counts"]["cancelled"] > 0
    with open_store(db).session_scope() as session:  # no result landed on a cancelled request
        assert session.scalar(select(func.count()).select_from(Result).join(Request)
                              .where(Request.state != "completed")) == 0


def test_a_database_failing_mid_run_stops_the_worker_cleanly(tmp_path: Path, tiny_model_dir: Path, make_db) -> None:
    """The database refuses writes of results after a few (a trigger raising, as a full disk or an I/O
    error would): the worker stops with one message and a nonzero exit, no traceback; what was committed
    stays, and its other requests go back to the queue."""
    db = make_db("failing")
    make_job(tmp_path, tiny_model_dir, db, num_rows=60)
    with open_store(db).engine.begin() as conn:
        if conn.dialect.name == "sqlite":
            conn.exec_driver_sql("CREATE TRIGGER fail_after_ten BEFORE INSERT ON results "
                                 "WHEN (SELECT count(*) FROM results) >= 10 "
                                 "BEGIN SELECT RAISE(ABORT, 'disk I/O error (simulated)'); END")
        else:
            conn.exec_driver_sql("CREATE FUNCTION fail_after_ten() RETURNS trigger AS $$ BEGIN "
                                 "IF (SELECT count(*) FROM results) >= 10 THEN "
                                 "RAISE EXCEPTION 'disk I/O error (simulated)'; END IF; RETURN NEW; END $$ "
                                 "LANGUAGE plpgsql")
            conn.exec_driver_sql("CREATE TRIGGER fail_after_ten BEFORE INSERT ON results FOR EACH ROW "
                                 "EXECUTE FUNCTION fail_after_ten()")
    proc = start_worker(db, "--max-num-seqs", "4")
    _, stderr = proc.communicate(timeout=300)
    assert proc.returncode == 1, stderr
    assert "Traceback" not in stderr, stderr
    errors = [line for line in stderr.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1 and "disk I/O error (simulated)" in errors[0], stderr
    with open_store(db).session_scope() as session:
        committed = session.scalar(select(func.count()).select_from(Result))
        states = dict(session.execute(select(Request.state, func.count()).group_by(Request.state)).all())
    assert 0 < committed <= 10 and states == {"completed": committed, "pending": 60 - committed}, states
