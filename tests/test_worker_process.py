"""Real `bulkgen run` processes: killed with SIGKILL at random moments, stopped with SIGTERM, run two
at a time on one database, and cancelled from outside."""

from __future__ import annotations

import os
import random
import signal
import sqlite3
import subprocess
import time
from collections.abc import Callable
from pathlib import Path

import pyarrow.parquet as pq
from sqlalchemy import func, select, text

from bulkgen.store.db import open_store
from bulkgen.store.models import Request, Result, Worker
from tests.helpers import invoke, invoke_json, write_parquet
from tests.zygote import bulkgen_process, run_bulkgen

NUM_ROWS = 300
POLL_S = 0.01  # how often a test looks at the database: short, so that what it acts on has just happened
RUN_FLAGS = ["--kv-cache-memory", "16MiB", "--max-num-seqs", "32", "--commit-every", "8",
             "--commit-interval", "0.2", "--lease-seconds", "5", "--no-progress"]


def make_job(tmp_path: Path, model: Path, db: str, num_rows: int = NUM_ROWS, max_new: int = 24) -> int:
    rng = random.Random(0)
    prompts = [" ".join(rng.choice(["alpha", "beta", "gamma", "delta", "river", "stone"])
                        for _ in range(rng.randint(2, 60))) for _ in range(num_rows)]
    data = write_parquet(tmp_path / "in.parquet", {"prompt": prompts, "n": list(range(num_rows))})
    return invoke_json("submit", data, "--model", model, "--max-new-tokens", max_new, "--db", db)["job_id"]


def start_worker(db: str, *extra: str) -> subprocess.Popen:
    return bulkgen_process(["run", "--db", db, *RUN_FLAGS, *extra], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                           text=True)


def num_results(db: str) -> int:
    with open_store(db).session_scope() as session:
        return session.scalar(select(func.count()).select_from(Result))


def wait_for_results(db: str, more_than: int, proc: subprocess.Popen, timeout: float = 120) -> int:
    """Wait until more than `more_than` results are committed (or the worker ends); the count then."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        count = num_results(db)
        if count > more_than or proc.poll() is not None:
            return count
        time.sleep(POLL_S)
    raise AssertionError("the worker made no progress")


def still_running(proc: subprocess.Popen, what: str) -> None:
    """Fail loudly, not flakily, where the job ended before the test could act on it."""
    if proc.poll() is not None:
        raise AssertionError(f"the worker finished before it could be {what}: make the test's job longer "
                             f"(more rows or a smaller --max-num-seqs), not its sleeps")


def kill_before(db: str, proc: subprocess.Popen, ceiling: int, rng: random.Random) -> int:
    """SIGKILL the worker at a random moment after its first commit, and at the latest when `ceiling`
    results are committed: the kill is bounded by an event, not a time, so on a machine of any speed it
    lands with work left (on a slow one, anywhere inside a step or a commit). Returns the count after."""
    committed = wait_for_results(db, num_results(db), proc)
    still_running(proc, "interrupted")
    deadline = time.monotonic() + rng.uniform(0.0, 0.4)
    while time.monotonic() < deadline and committed < ceiling:
        time.sleep(POLL_S)
        committed = num_results(db)
    still_running(proc, "interrupted")
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    return num_results(db)


def workers_with_results(db: str) -> dict[str, int]:
    """worker id -> pid of the workers that have committed results."""
    with open_store(db).session_scope() as session:
        return dict(session.execute(select(Worker.id, Worker.pid).join(Result, Result.worker_id == Worker.id)
                                    .distinct()).all())


def make_two_work(db: str, alive: Callable[[], bool], timeout: float = 180) -> None:
    """Two workers started together: wait for one to commit, then hold it (SIGSTOP) until the other has
    committed too. Which starts first, and whether the job outlasts the other's start, depends on the
    machine; that both take part is then by construction, whatever its speed (their leases must outlast
    the pause)."""
    deadline = time.monotonic() + timeout
    while not workers_with_results(db):
        assert alive() and time.monotonic() < deadline, "no worker committed anything"
        time.sleep(POLL_S)
    first = workers_with_results(db)
    if len(first) > 1:
        return
    (pid,) = first.values()
    pause_between_transactions(db, pid, deadline)
    try:
        while len(workers_with_results(db)) < 2:
            assert alive() and time.monotonic() < deadline, "the second worker committed nothing"
            time.sleep(POLL_S)
    finally:
        os.kill(pid, signal.SIGCONT)


def pause_between_transactions(db: str, pid: int, deadline: float,
                               also: Callable[[], bool] = lambda: True) -> None:
    """SIGSTOP the worker at a moment it holds no open write transaction (and `also` holds while it is paused):
    paused inside one it would block every other writer (SQLite has one), and the other worker could commit
    nothing."""
    while True:
        os.kill(pid, signal.SIGSTOP)
        if not _transaction_open(db) and also():
            return
        os.kill(pid, signal.SIGCONT)
        assert time.monotonic() < deadline, "the worker never stood outside a transaction (as asked)"
        time.sleep(POLL_S)


def _transaction_open(db: str) -> bool:
    if db.startswith("sqlite"):
        connection = sqlite3.connect(db.removeprefix("sqlite:///"), timeout=0)
        try:
            connection.execute("BEGIN IMMEDIATE")  # fails while another connection holds the write lock
            connection.rollback()
            return False
        except sqlite3.OperationalError:
            return True
        finally:
            connection.close()
    with open_store(db).session_scope() as session:  # a paused client's transaction waits, idle, on the server
        return bool(session.execute(text(
            "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() AND pid <> pg_backend_pid() "
            "AND state = 'idle in transaction'")).scalar())


def export_rows(db: str, job_id: int, path: Path) -> list[dict]:
    invoke("export", job_id, "-o", path, "--db", db)
    return pq.read_table(path).to_pylist()


def uninterrupted_run(tmp_path: Path, model: Path, db: str) -> list[dict]:
    """The export of make_job's job run by one worker from start to end: what an interrupted run must equal."""
    (tmp_path / "ref").mkdir()
    job_id = make_job(tmp_path / "ref", model, db)
    done = run_bulkgen(["run", "--db", db, *RUN_FLAGS])
    assert done.returncode == 0, done.stderr
    return export_rows(db, job_id, tmp_path / "reference.parquet")


def test_sigkill_at_random_moments_then_resume_equals_an_uninterrupted_run(tmp_path: Path, tiny_model_dir: Path,
                                                                          make_db,
                                                                          standard_reference: list[dict]) -> None:
    reference = standard_reference

    db = make_db("crash")
    job_id = make_job(tmp_path, tiny_model_dir, db)
    rng = random.Random(42)
    committed = 0
    # Kills land while requests are in flight, and a slow machine may catch the same ones every time:
    # allow more attempts than kills, so that this tests resuming, not the repeat-offender limit (tested
    # in test_worker.py). At most 8 sequences at a time: a commit then adds few rows, so a kill bounded by
    # a count of rows lands close to it.
    flags = ["--max-attempts", "10", "--max-num-seqs", "8"]
    holders = []
    for kill in range(4):
        ceiling = min(committed + rng.randint(8, 40), NUM_ROWS - 60)
        committed = kill_before(db, start_worker(db, *flags), ceiling, rng)
        assert committed < NUM_ROWS - 30, f"kill {kill + 1} came too late ({committed} of {NUM_ROWS} committed)"
        holders += invoke_json("status", job_id, "--db", db)["workers"]  # what a user sees before the next run
    assert committed > 0
    assert holders and all(w["state"] == "gone" for w in holders), holders  # the killed holder, said gone
    final = run_bulkgen(["run", "--db", db, *RUN_FLAGS, *flags])
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
    still_running(proc, "stopped")
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
    done = run_bulkgen(["run", "--db", db, *RUN_FLAGS])
    assert done.returncode == 0
    assert invoke_json("status", job_id, "--db", db)["counts"]["completed"] == NUM_ROWS


def test_two_workers_share_the_queue_without_doing_anything_twice(tmp_path: Path, tiny_model_dir: Path,
                                                                  make_db) -> None:
    db = make_db("two")
    job_id = make_job(tmp_path, tiny_model_dir, db)
    # leases long enough to outlast make_two_work's pause: a paused worker's requests stay its own
    workers = [start_worker(db, "--max-num-seqs", "8", "--lease-seconds", "120", "--json") for _ in range(2)]
    make_two_work(db, lambda: all(w.poll() is None for w in workers))
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


def test_cancel_during_a_run_stops_the_worker_taking_its_requests(tmp_path: Path, tiny_model_dir: Path,
                                                                  make_db) -> None:
    db = make_db("cancel")
    num_rows = 1200  # the run stops at the cancel: rows past it cost only their submit, and keep work left
    job_id = make_job(tmp_path, tiny_model_dir, db, num_rows=num_rows, max_new=64)
    proc = start_worker(db, "--lease-seconds", "2")
    wait_for_results(db, 3, proc)
    still_running(proc, "cancelled")
    invoke("cancel", job_id, "--db", db)
    proc.communicate(timeout=60)
    assert proc.returncode == 0
    status = invoke_json("status", job_id, "--db", db)
    assert status["status"] == "cancelled"
    assert status["counts"]["pending"] == 0 and status["counts"]["running"] == 0
    assert status["counts"]["completed"] < num_rows and status["counts"]["cancelled"] > 0
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


def test_a_cancel_and_retry_under_a_paused_worker_runs_each_request_once(tmp_path: Path, tiny_model_dir: Path,
                                                                       make_db) -> None:
    """The job is cancelled and retried while its worker is paused holding requests: on waking it claims again
    requests still in its engine before it notices it lost them (the soak found each failed, 'already in the
    engine'). The earlier attempt is dropped, the new one runs: every request completed once. One request's budget
    is far the largest: claimed first, it still runs when the others have finished, and the first claim after
    waking takes it again."""
    db = make_db("again")
    num_rows = 40
    data = write_parquet(tmp_path / "in.parquet", {"prompt": [f"Say {i}." for i in range(num_rows)],
                                                   "budget": [1500] + [8] * (num_rows - 1)})
    job_id = invoke_json("submit", data, "--model", tiny_model_dir, "--max-new-tokens-column", "budget",
                         "--ignore-eos", "--db", db)["job_id"]
    proc = start_worker(db, "--max-num-seqs", "4", "--lease-seconds", "300")
    wait_for_results(db, 0, proc)
    still_running(proc, "paused")
    pause_between_transactions(db, proc.pid, time.monotonic() + 60)
    try:
        invoke("cancel", job_id, "--db", db)
        assert invoke_json("retry", job_id, "--db", db)["requeued"] > 0
    finally:
        os.kill(proc.pid, signal.SIGCONT)
    _, stderr = proc.communicate(timeout=300)
    assert proc.returncode == 0, stderr
    status = invoke_json("status", job_id, "--db", db)
    assert status["counts"] == {"pending": 0, "running": 0, "completed": num_rows, "failed": 0, "cancelled": 0}, \
        status
    with open_store(db).session_scope() as session:
        assert session.scalar(select(func.count()).select_from(Result)) == num_rows
