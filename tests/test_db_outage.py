"""Workers ride out a database that goes away: a PostgreSQL of the test's own (initdb + pg_ctl on a spare port)
restarted and stopped under real `bulkgen run` processes, a proxy that drops the connection between a commit and
its acknowledgement, and a SQLite write lock held past the busy timeout. Each run must finish on its own, with
every row exactly once and the outputs of an uninterrupted run; what is not transient still stops at once."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from sqlalchemy import func, select

from bulkgen.errors import StoreError
from bulkgen.store import db as store_db
from bulkgen.store.db import open_store
from bulkgen.store.models import Request, Result
from tests.conftest import OwnDatabase
from tests.test_worker_process import (
    NUM_ROWS,
    POLL_S,
    export_rows,
    make_job,
    num_results,
    start_worker,
)


def _wait_for(condition, proc: subprocess.Popen | None, what: str, timeout: float = 240) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert proc is None or proc.poll() is None, f"the worker ended before {what}: {proc.communicate()}"
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(POLL_S * 10)


def _finish(proc: subprocess.Popen) -> tuple[dict, str]:
    stdout, stderr = proc.communicate(timeout=600)
    assert proc.returncode == 0, stderr
    return json.loads(stdout), stderr


def assert_exactly_once(db: str, job_id: int, tmp_path: Path, reference: list[dict]) -> None:
    rows = export_rows(db, job_id, tmp_path / "out.parquet")
    assert [r["row"] for r in rows] == list(range(NUM_ROWS))
    assert all(r["status"] == "completed" for r in rows)
    assert [r["output"] for r in rows] == [r["output"] for r in reference]
    with open_store(db).session_scope() as session:
        assert session.scalar(select(func.count()).select_from(Result)) == NUM_ROWS
        assert session.scalar(select(func.count(func.distinct(Result.request_id)))) == NUM_ROWS


def outages(db: str, proc: subprocess.Popen, server: OwnDatabase, stopped_s: float) -> None:
    """Two restarts and a stop of stopped_s, each once the worker has committed more since the last."""
    for event in ("restart", "restart", "stop"):
        before = num_results(db)
        _wait_for(lambda n=before: num_results(db) > n, proc, f"results before the {event}")
        assert num_results(db) < NUM_ROWS - 40, "the job ended too soon to be interrupted: make it longer"
        if event == "restart":
            server.restart()
        else:
            server.stop()
            time.sleep(stopped_s)
            server.start()


def test_one_worker_rides_out_two_restarts_and_a_stop(tmp_path: Path, tiny_model_dir: Path,
                                                      own_postgres: OwnDatabase,
                                                      standard_reference: list[dict]) -> None:
    reference = standard_reference
    db = own_postgres.url
    job_id = make_job(tmp_path, tiny_model_dir, db)
    proc = start_worker(db, "--max-num-seqs", "8", "--json")
    outages(db, proc, own_postgres, stopped_s=6.0)  # past the backoff's first steps (0.5, 1, 2 s) and the lease
    summary, stderr = _finish(proc)
    # The stop is always seen (the worker commits many times in 6 s); a restart is seen only where the worker touched
    # the server while it was down: a pooled connection it broke is otherwise replaced by the next checkout's ping,
    # no error raised. So: at least one outage, every one said and its end said, as many as the summary counts.
    outages_seen = summary["db_outages"]
    assert summary["completed"] == NUM_ROWS and outages_seen >= 1 and summary["db_outage_s"] > 3, summary
    assert stderr.count("bulkgen: database unavailable since") == stderr.count("bulkgen: database back after") \
        == outages_seen, stderr
    assert_exactly_once(db, job_id, tmp_path, reference)


def test_two_workers_ride_out_a_restart_and_a_stop(tmp_path: Path, tiny_model_dir: Path,
                                                   own_postgres: OwnDatabase, standard_reference: list[dict]) -> None:
    reference = standard_reference
    db = own_postgres.url
    job_id = make_job(tmp_path, tiny_model_dir, db)
    procs = [start_worker(db, "--max-num-seqs", "4", "--json") for _ in range(2)]
    outages(db, procs[0], own_postgres, stopped_s=6.0)
    summaries = [_finish(p)[0] for p in procs]
    assert sum(s["completed"] for s in summaries) == NUM_ROWS, summaries
    assert_exactly_once(db, job_id, tmp_path, reference)


class DroppingProxy(threading.Thread):
    """A TCP proxy to the server that, `drops` times, forwards the COMMIT of a transaction that sent `marker` (by
    default: one that wrote result rows) and then closes the connection instead of passing the server's answer
    back: the transaction landed, the worker never heard."""

    def __init__(self, port: int, drops: int, marker: bytes = b"INSERT INTO results") -> None:
        super().__init__(daemon=True)
        self.server_port, self.drops, self.marker = port, drops, marker
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        self.dropped = 0

    def run(self) -> None:
        while True:
            try:
                client, _ = self.listener.accept()
            except OSError:
                return
            try:
                upstream = socket.create_connection(("127.0.0.1", self.server_port))
            except OSError:  # the server is down: so is this connection (the client sees it closed)
                client.close()
                continue
            state = {"results": False, "armed": False}
            threading.Thread(target=self._pipe, args=(client, upstream, state, True), daemon=True).start()
            threading.Thread(target=self._pipe, args=(upstream, client, state, False), daemon=True).start()

    def _pipe(self, source: socket.socket, target: socket.socket, state: dict, to_server: bool) -> None:
        try:
            while data := source.recv(65536):
                if to_server:
                    state["results"] |= self.marker in data
                    if b"COMMIT" in data and state["results"] and self.dropped < self.drops:
                        state["armed"] = True
                    elif b"COMMIT" in data:
                        state["results"] = False
                elif state["armed"]:  # the server's answer to that COMMIT: the connection drops instead
                    self.dropped += 1
                    break
                target.sendall(data)
        except OSError:
            pass
        for s in (source, target):
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            s.close()


def test_a_commit_whose_acknowledgement_is_lost_is_neither_lost_nor_doubled(tmp_path: Path, tiny_model_dir: Path,
                                                                            own_postgres: OwnDatabase,
                                                                            standard_reference: list[dict]) -> None:
    reference = standard_reference
    job_id = make_job(tmp_path, tiny_model_dir, own_postgres.url)
    proxy = DroppingProxy(own_postgres.port, drops=3)
    proxy.start()
    db = own_postgres.url.replace(f":{own_postgres.port}/", f":{proxy.port}/")
    summary, stderr = _finish(start_worker(db, "--max-num-seqs", "8", "--json"))
    proxy.listener.close()
    assert proxy.dropped == 3, "three commits landed unacknowledged"
    assert summary["completed"] == NUM_ROWS, summary  # each counted once: the retry found its rows there
    assert_exactly_once(own_postgres.url, job_id, tmp_path, reference)


def test_a_claim_whose_answer_is_lost_is_given_back_not_held_forever(tmp_path: Path, tiny_model_dir: Path,
                                                                     own_postgres: OwnDatabase,
                                                                     standard_reference: list[dict]) -> None:
    """The stall of issue 35: a claim commits, its answer is lost, and the requests stay leased under the worker's
    id without the worker knowing. Its heartbeat renewed every lease under its id, so they never expired, and the
    worker waited for them forever (as did every other). Now they are given back when the outage ends."""
    reference = standard_reference
    job_id = make_job(tmp_path, tiny_model_dir, own_postgres.url)
    proxy = DroppingProxy(own_postgres.port, drops=2, marker=b"SKIP LOCKED")
    proxy.start()
    db = own_postgres.url.replace(f":{own_postgres.port}/", f":{proxy.port}/")
    summary, stderr = _finish(start_worker(db, "--max-num-seqs", "8", "--json", "--stall-s", "60"))
    proxy.listener.close()
    assert proxy.dropped == 2, "two claims landed unanswered"
    assert stderr.count("that it did not know of") == 2, stderr
    assert summary["completed"] == NUM_ROWS, summary
    assert_exactly_once(own_postgres.url, job_id, tmp_path, reference)
    with open_store(own_postgres.url).session_scope() as session:
        assert session.scalar(select(func.max(Request.attempts))) == 1, "a claim never answered spends no attempt"


def test_a_dropped_table_still_stops_the_worker_at_once(tmp_path: Path, tiny_model_dir: Path,
                                                        own_postgres: OwnDatabase) -> None:
    db = own_postgres.url
    make_job(tmp_path, tiny_model_dir, db)
    proc = start_worker(db, "--max-num-seqs", "4")
    _wait_for(lambda: num_results(db) > 0, proc, "a first commit")
    with open_store(db).engine.begin() as conn:
        conn.exec_driver_sql("DROP TABLE results CASCADE")
    _, stderr = proc.communicate(timeout=120)
    assert proc.returncode == 1 and "Traceback" not in stderr, stderr
    errors = [line for line in stderr.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1 and 'relation "results" does not exist' in errors[0], stderr
    assert "database unavailable" not in stderr, "not transient: no waiting"


def test_a_server_down_for_longer_than_the_limit_stops_the_worker(tmp_path: Path, tiny_model_dir: Path,
                                                                  own_postgres: OwnDatabase) -> None:
    db = own_postgres.url
    make_job(tmp_path, tiny_model_dir, db)
    proc = start_worker(db, "--max-num-seqs", "4", "--db-outage-s", "3")
    _wait_for(lambda: num_results(db) > 0, proc, "a first commit")
    own_postgres.stop()
    started = time.monotonic()
    try:
        _, stderr = proc.communicate(timeout=120)
    finally:
        own_postgres.start()
    assert proc.returncode == 1 and time.monotonic() - started < 60, stderr
    assert "database unavailable since" in stderr and "past --db-outage-s 3" in stderr, stderr
    with open_store(db).session_scope() as session:
        assert session.scalar(select(func.count()).select_from(Result)) > 0  # what was committed stays


def test_transient_and_fatal_errors_are_told_apart(tmp_path: Path, own_postgres: OwnDatabase) -> None:
    def error_of(url: str) -> StoreError:
        store = store_db.Store(store_db.create_db_engine(url))
        with pytest.raises(StoreError) as caught, store.session_scope() as session:
            session.execute(select(func.count()).select_from(Request))
        return caught.value

    own_postgres.stop()
    try:
        assert error_of(own_postgres.url).transient, "a server that is down comes back"
    finally:
        own_postgres.start()
    assert not error_of(own_postgres.url.rsplit("/", 1)[0] + "/nosuchdb").transient
    assert not error_of(own_postgres.url).transient, "no table: a bulkgen schema was never made here"


def test_sqlite_locked_past_the_busy_timeout_is_waited_out(tmp_path: Path, tiny_model_dir: Path,
                                                           monkeypatch: pytest.MonkeyPatch,
                                                           standard_reference: list[dict]) -> None:
    """Another process holds SQLite's write lock past a busy timeout of 0.3 s: the worker waits it out."""
    from bulkgen.config import EngineConfig
    from bulkgen.worker import Worker, WorkerOptions

    reference = standard_reference
    monkeypatch.setattr(store_db, "SQLITE_BUSY_TIMEOUT_MS", 300)
    path = tmp_path / "locked.db"
    db = f"sqlite:///{path}"
    job_id = make_job(tmp_path, tiny_model_dir, db)
    worker = Worker(open_store(db), EngineConfig(kv_cache_memory=16 * 2**20, max_num_seqs=8),
                    WorkerOptions(commit_every=8, commit_interval=0.2, lease_seconds=5, progress=False))
    errors: list[BaseException] = []

    def run() -> None:
        try:
            worker.run()
        except BaseException as exc:  # noqa: BLE001 - the test reports it
            errors.append(exc)

    thread = threading.Thread(target=run)
    thread.start()
    _wait_for(lambda: num_results(db) > 0 or not thread.is_alive(), None, "a first commit")
    locker = subprocess.Popen([sys.executable, "-c", "import sqlite3, sys; c = sqlite3.connect(sys.argv[1]); "
                               "c.isolation_level = None; c.execute('BEGIN IMMEDIATE'); print('locked', flush=True); "
                               "sys.stdin.readline(); c.execute('ROLLBACK')", str(path)],
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert locker.stdout.readline().strip() == "locked"
        _wait_for(lambda: worker.outage.num_outages >= 1 or not thread.is_alive(), None, "the outage", timeout=60)
    finally:
        locker.communicate("\n", timeout=30)  # the lock goes once the worker waits it out
    thread.join(timeout=600)
    assert not errors, errors
    assert worker.outage.num_outages >= 1, "the lock outlasted the busy timeout: an outage, waited out"
    assert worker.summary.num_completed == NUM_ROWS
    assert_exactly_once(db, job_id, tmp_path, reference)


def test_an_outage_limit_of_zero_stops_at_the_first_error_and_fatal_errors_always_do() -> None:
    from bulkgen.outage import Outage

    weather = StoreError("database error on x: connection refused", transient=True)
    with pytest.raises(StoreError, match="connection refused"):
        Outage(0).failed(weather)
    with pytest.raises(StoreError, match="disk full"):
        Outage(900).failed(StoreError("database error on x: disk full"))
    outage = Outage(900)
    outage.failed(weather)
    assert outage.down and outage.status().startswith("database unavailable since ")
    outage.ok()
    assert not outage.down and outage.num_outages == 1
