"""Scale-out on a local Ray cluster (one per test session): workers as Ray
actors sharing one queue, an actor killed with SIGKILL, two drivers on one PostgreSQL queue, cancel and
SIGTERM while they run, and the flags refused before anything starts."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from sqlalchemy import func, select

from bulkgen.store import open_store
from bulkgen.store.models import Request, Result, Worker
from tests.helpers import invoke, invoke_json
from tests.test_worker_process import (
    NUM_ROWS,
    RUN_FLAGS,
    export_rows,
    make_job,
    make_two_work,
    num_results,
    uninterrupted_run,
)

ray = pytest.importorskip("ray")

postgres_only = pytest.mark.parametrize("backend", ["postgresql"], indirect=True)


@pytest.fixture(scope="session")
def ray_address() -> str:
    """A local Ray cluster of 4 logical CPUs (actors take 1 each), owned by this test session (shut down at
    its end, leaving any other cluster on the machine alone); drivers started by the tests join it."""
    # a throwaway cluster on loopback: no token to hand to every driver the tests start
    os.environ["RAY_AUTH_MODE"] = "disabled"
    os.environ["RAY_USAGE_STATS_ENABLED"] = "0"
    ray.init(num_cpus=4, num_gpus=0, include_dashboard=False, logging_level="WARNING")
    yield ray.get_runtime_context().gcs_address
    ray.shutdown()


def ray_run(db: str, address: str, *extra: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "bulkgen", "run", "--ray", "--ray-address", address, "--db", db,
                             *RUN_FLAGS, *extra], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "PYTHONUNBUFFERED": "1"})


def wait_for(predicate, proc: subprocess.Popen, timeout: float = 180) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        if proc.poll() is not None:
            raise AssertionError(f"the driver ended first: {proc.communicate()}")
        time.sleep(0.01)
    raise AssertionError("timed out")


def test_two_actors_share_one_job_and_no_request_runs_twice(tmp_path: Path, tiny_model_dir: Path, make_db,
                                                            ray_address: str) -> None:
    db = make_db("two")
    job_id = make_job(tmp_path, tiny_model_dir, db)
    # leases long enough to outlast make_two_work's pause: a paused actor's requests stay its own
    proc = ray_run(db, ray_address, "--workers", "2", "--max-num-seqs", "8", "--lease-seconds", "120", "--json")
    make_two_work(db, lambda: proc.poll() is None)
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == 0, err
    summary = json.loads(out)
    assert summary["workers"] == 2 and summary["completed"] == NUM_ROWS and summary["errors"] == []
    assert all(w["completed"] > 0 for w in summary["per_worker"]), summary["per_worker"]  # both did work
    with open_store(db).session_scope() as session:
        assert session.scalar(select(func.count()).select_from(Result)) == NUM_ROWS
        assert session.scalar(select(func.max(Request.attempts))) == 1
        assert session.scalar(select(func.count(func.distinct(Result.worker_id)))) == 2
    assert invoke_json("status", job_id, "--db", db)["status"] == "completed"


@postgres_only
def test_an_actor_killed_mid_job_is_restarted_and_the_export_equals_one_worker(tmp_path: Path, tiny_model_dir: Path,
                                                                               make_db, ray_address: str) -> None:
    reference = uninterrupted_run(tmp_path, tiny_model_dir, make_db("reference"))

    db = make_db("killed")
    job_id = make_job(tmp_path, tiny_model_dir, db, max_new=24)
    proc = ray_run(db, ray_address, "--workers", "2", "--max-num-seqs", "8")
    wait_for(lambda: num_results(db) > 20, proc)
    with open_store(db).session_scope() as session:
        pids = session.scalars(select(Worker.pid).where(Worker.status == "running")).all()
    assert pids
    os.kill(pids[0], signal.SIGKILL)
    _, err = proc.communicate(timeout=300)
    assert proc.returncode == 0, err
    rows = export_rows(db, job_id, tmp_path / "out.parquet")
    assert [r["row"] for r in rows] == list(range(NUM_ROWS))  # each row once
    assert [r["output"] for r in rows] == [r["output"] for r in reference]
    with open_store(db).session_scope() as session:
        assert session.scalar(select(func.count()).select_from(Result)) == NUM_ROWS
        assert session.scalar(select(func.count()).select_from(Worker)) >= 3  # the restarted actor's worker too


@postgres_only
def test_two_drivers_on_one_postgresql_queue(tmp_path: Path, tiny_model_dir: Path, make_db, ray_address: str) -> None:
    db = make_db("drivers")
    job_id = make_job(tmp_path, tiny_model_dir, db)
    drivers = [ray_run(db, ray_address, "--workers", "1", "--max-num-seqs", "8", "--json") for _ in range(2)]
    outputs = [d.communicate(timeout=300) for d in drivers]
    assert all(d.returncode == 0 for d in drivers), [err for _, err in outputs]
    assert sum(json.loads(out)["completed"] for out, _ in outputs) == NUM_ROWS
    with open_store(db).session_scope() as session:
        assert session.scalar(select(func.count()).select_from(Result)) == NUM_ROWS
        assert session.scalar(select(func.max(Request.attempts))) == 1
    assert invoke_json("status", job_id, "--db", db)["status"] == "completed"


@postgres_only
def test_cancel_while_ray_workers_run_then_sigterm_drains(tmp_path: Path, tiny_model_dir: Path, make_db,
                                                          ray_address: str) -> None:
    db = make_db("cancel")
    num_rows = 1200  # each run stops early: rows past the stop cost only their submit, and keep work left
    job_id = make_job(tmp_path, tiny_model_dir, db, num_rows=num_rows, max_new=64)
    proc = ray_run(db, ray_address, "--workers", "2", "--lease-seconds", "2")
    wait_for(lambda: num_results(db) > 3, proc)
    invoke("cancel", job_id, "--db", db)
    proc.communicate(timeout=120)
    assert proc.returncode == 0
    status = invoke_json("status", job_id, "--db", db)
    assert status["status"] == "cancelled" and status["counts"]["running"] == 0 and status["counts"]["pending"] == 0
    assert status["counts"]["cancelled"] > 0

    other = make_job(tmp_path, tiny_model_dir, db, num_rows=num_rows, max_new=64)
    proc = ray_run(db, ray_address, "--workers", "2")
    wait_for(lambda: num_results(db) > status["counts"]["completed"] + 5, proc)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, err
    assert "stopped by SIGTERM" in err
    counts = invoke_json("status", other, "--db", db)["counts"]
    assert counts["running"] == 0 and 0 < counts["completed"] < num_rows  # drained: nothing left leased
