"""A worker never hangs: a stall made by hand (another client holding a lock the worker needs) is said in one line
with what the worker waits on, shown by `status`, and ends the run (exit 1) with its requests back in the queue;
a worker that holds nothing and waits on others says so once, not at every poll."""

from __future__ import annotations

import logging
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from sqlalchemy import func, select, text

from bulkgen.config import EngineConfig
from bulkgen.liveness import StalledError
from bulkgen.store.db import open_store
from bulkgen.store.models import Request, Result
from bulkgen.worker import Worker, WorkerOptions
from tests.conftest import OwnDatabase
from tests.helpers import invoke_json
from tests.test_worker_process import POLL_S, RUN_FLAGS, make_job, num_results, start_worker
from tests.zygote import run_bulkgen


def wait_until(condition, what: str, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(POLL_S * 5)


def states(db: str) -> dict[str, int]:
    with open_store(db).session_scope() as session:
        return dict(session.execute(select(Request.state, func.count()).group_by(Request.state)).all())


def finish_and_check_exactly_once(db: str, num_rows: int) -> None:
    done = run_bulkgen(["run", "--db", db, *RUN_FLAGS], timeout=600)
    assert done.returncode == 0, done.stderr
    with open_store(db).session_scope() as session:
        assert session.scalar(select(func.count()).select_from(Result)) == num_rows
        assert session.scalar(select(func.count(func.distinct(Result.request_id)))) == num_rows
    assert states(db) == {"completed": num_rows}


def test_a_worker_blocked_on_a_lock_says_so_then_stops_and_gives_its_requests_back(
        tmp_path: Path, tiny_model_dir: Path, caplog: pytest.LogCaptureFixture) -> None:
    """SQLite: another process holds the write lock (within the busy timeout, so no outage): the worker, blocked
    in a write, says what it waits on at a quarter of --stall-s, is stalled at --stall-s, and once the lock goes
    stops (StalledError) with what it finished committed and the rest given back (no attempt spent)."""
    db = f"sqlite:///{tmp_path / 'stall.db'}"
    num_rows = 120
    make_job(tmp_path, tiny_model_dir, db, num_rows=num_rows, max_new=48)
    worker = Worker(open_store(db), EngineConfig(kv_cache_memory=16 * 2**20, max_num_seqs=8),
                    WorkerOptions(commit_every=4, commit_interval=0.2, lease_seconds=30, stall_s=2.0, progress=False))
    errors: list[BaseException] = []

    def run() -> None:
        try:
            worker.run()
        except BaseException as exc:  # noqa: BLE001 - the test reports it
            errors.append(exc)

    thread = threading.Thread(target=run)
    thread.start()
    wait_until(lambda: num_results(db) > 0 or not thread.is_alive(), "a first commit")
    locker = subprocess.Popen([sys.executable, "-c", "import sqlite3, sys; c = sqlite3.connect(sys.argv[1]); "
                               "c.isolation_level = None; c.execute('BEGIN IMMEDIATE'); print('locked', flush=True); "
                               "sys.stdin.readline(); c.execute('ROLLBACK')", str(tmp_path / "stall.db")],
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert locker.stdout.readline().strip() == "locked"
        with caplog.at_level(logging.WARNING, logger="bulkgen"):
            wait_until(lambda: worker.liveness.stalled is not None or not thread.is_alive(), "the stall")
        assert thread.is_alive(), errors
    finally:
        locker.communicate("\n", timeout=30)
    thread.join(timeout=120)
    assert len(errors) == 1 and isinstance(errors[0], StalledError), errors
    said = [r.getMessage() for r in caplog.records if "no progress for" in r.getMessage()]
    assert len(said) == 1 and "waiting on a database call (" in said[0] and "--stall-s" in said[0], said
    assert "stalled: no progress for" in str(errors[0]) and "a database call" in str(errors[0])
    left = states(db)
    assert "running" not in left and left.get("pending", 0) > 0, left  # given back, nothing left leased
    with open_store(db).session_scope() as session:
        assert session.scalar(select(func.max(Request.attempts)).where(Request.state == "pending")) == 0
    finish_and_check_exactly_once(db, num_rows)


def test_a_worker_that_cannot_come_back_ends_itself_and_status_shows_it_stalled(
        tmp_path: Path, tiny_model_dir: Path, own_postgres: OwnDatabase) -> None:
    """PostgreSQL: another session holds the results table locked; the worker's commit waits (the lock's bound,
    30 s, is past --stall-s). `status` shows the worker stalled while it lasts; the watchdog ends the process
    (exit 1, one error line saying where it was) a lease after the stall; its leases, no longer renewed, expire,
    and another worker finishes the job exactly once."""
    db = own_postgres.url
    num_rows = 120
    job_id = make_job(tmp_path, tiny_model_dir, db, num_rows=num_rows, max_new=48)
    proc = start_worker(db, "--max-num-seqs", "8", "--stall-s", "4", "--commit-every", "4")
    wait_until(lambda: num_results(db) > 0, "a first commit")
    locker = open_store(db).engine.connect()
    try:
        locker.execute(text("LOCK TABLE results IN EXCLUSIVE MODE"))
        lines: list[str] = []

        def read() -> None:
            lines.extend(proc.stderr)

        reader = threading.Thread(target=read, daemon=True)
        reader.start()
        wait_until(lambda: any(line.startswith("bulkgen: no progress for") for line in lines),
                   "the line that says what it waits on")
        shown = invoke_json("status", job_id, "--db", db)["workers"]
        assert [w["state"] for w in shown] == ["stalled"], shown
        proc.wait(timeout=60)
        reader.join(timeout=10)
    finally:
        locker.rollback()
        locker.close()
    assert proc.returncode == 1, lines
    said = [line for line in lines if line.startswith("bulkgen: no progress for")]
    assert len(said) == 1 and "a database call (commit)" in said[0], lines
    errors = [line for line in lines if line.startswith("error: ")]
    assert len(errors) == 1 and "stalled: no progress for" in errors[0] and "did not stop within" in errors[0], lines
    finish_and_check_exactly_once(db, num_rows)


class PollCountingWorker(Worker):
    """A worker whose idle polls can be awaited (the test waits on them, not on a clock)."""

    num_waits = 0

    def _say_waiting(self, job_ids: list[int]) -> None:
        super()._say_waiting(job_ids)
        self.num_waits += 1


def test_a_worker_waiting_on_others_says_so_once_not_at_every_poll(
        tmp_path: Path, tiny_model_dir: Path, capsys: pytest.CaptureFixture) -> None:
    """Worker A holds requests and is paused (SIGSTOP, leases long); worker B runs the rest, then waits on A's:
    its start line and its waiting line are said once over many polls, and it ends once A finishes."""
    import os
    import signal

    from tests.test_worker_process import pause_between_transactions

    db = f"sqlite:///{tmp_path / 'wait.db'}"
    make_job(tmp_path, tiny_model_dir, db, num_rows=40, max_new=16)
    first = start_worker(db, "--max-num-seqs", "4", "--lease-seconds", "300")
    wait_until(lambda: num_results(db) > 0, "the first worker's first commit")
    # paused while it holds requests (not between a commit and its next claim)
    pause_between_transactions(db, first.pid, time.monotonic() + 60, also=lambda: states(db).get("running", 0) > 0)
    try:
        assert states(db).get("running", 0) > 0, "the paused worker holds requests"
        worker = PollCountingWorker(open_store(db), EngineConfig(kv_cache_memory=16 * 2**20, max_num_seqs=8),
                                    WorkerOptions(commit_interval=0.2, poll_s=0.02, lease_seconds=300))
        thread = threading.Thread(target=worker.run)
        thread.start()
        wait_until(lambda: worker.num_waits >= 10 or not thread.is_alive(), "ten polls of the waiting worker")
        assert thread.is_alive()
    finally:
        os.kill(first.pid, signal.SIGCONT)
    assert first.wait(timeout=120) == 0
    thread.join(timeout=120)
    assert not thread.is_alive() and worker.summary.num_completed > 0
    said = capsys.readouterr().err.splitlines()
    assert sum(line.startswith("bulkgen run: tiny") or " · jobs 1: " in line for line in said) == 1, said
    waiting = [line for line in said if line.startswith("bulkgen run: waiting: ")]
    assert len(waiting) == 1 and f":{first.pid}:" in waiting[0], said
