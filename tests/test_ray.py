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

from bulkgen.store.db import open_store
from bulkgen.store.models import Request, Result, Worker
from tests.helpers import invoke, invoke_json
from tests.test_db_outage import assert_exactly_once, outages
from tests.test_worker_process import (
    NUM_ROWS,
    RUN_FLAGS,
    export_rows,
    make_job,
    make_two_work,
    num_results,
)

ray = pytest.importorskip("ray")
# The PostgreSQL databases of these tests are on the session's own server (own_postgres): drivers and actors hold
# many connections, and the shared server's 100 are shared with the other xdist worker. (The suite runs a file on
# one xdist worker, --dist loadfile: the module's cluster is started once.)

sqlite_only = pytest.mark.parametrize("backend", ["sqlite"], indirect=True)


@pytest.fixture(scope="module")
def ray_address() -> str:
    """A local Ray cluster of 4 logical CPUs (actors take 1 each), owned by this module's tests (shut down after
    them, leaving any other cluster on the machine alone: its idle processes would take a share of the two
    cores from every later test); drivers started by the tests join it."""
    # a throwaway cluster on loopback: no token to hand to every driver the tests start
    before = dict(os.environ)
    os.environ["RAY_AUTH_MODE"] = "disabled"
    os.environ["RAY_USAGE_STATS_ENABLED"] = "0"
    # Ray starts its workers at nice 15: beside the other xdist worker's tests they got a fraction of a core (the
    # module took 2.5x as long as alone)
    os.environ["RAY_worker_niceness"] = "0"
    ray.init(num_cpus=4, num_gpus=0, include_dashboard=False, logging_level="WARNING")
    yield ray.get_runtime_context().gcs_address
    ray.shutdown()
    # ray.init leaves PYTHONBREAKPOINT set in this process: every later test's `bulkgen` processes would differ from
    # the fork server's environment and start as plain subprocesses (tests/zygote.py), 5x slower each
    os.environ.clear()
    os.environ.update(before)


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


@sqlite_only  # two actors of one driver on one file; on PostgreSQL two drivers share the queue (below)
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


def test_an_actor_killed_mid_job_is_restarted_and_the_export_equals_one_worker(tmp_path: Path, tiny_model_dir: Path,
                                                                               own_postgres, ray_address: str,
                                                                               standard_reference: list[dict]) -> None:
    reference = standard_reference

    db = own_postgres.url
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


def test_two_drivers_on_one_postgresql_queue(tmp_path: Path, tiny_model_dir: Path, own_postgres,
                                             ray_address: str) -> None:
    db = own_postgres.url
    job_id = make_job(tmp_path, tiny_model_dir, db)
    # leases long enough to outlast make_two_work's pause: a paused actor's requests stay its own
    drivers = [ray_run(db, ray_address, "--workers", "1", "--max-num-seqs", "8", "--lease-seconds", "120", "--json")
               for _ in range(2)]
    make_two_work(db, lambda: all(d.poll() is None for d in drivers))
    outputs = [d.communicate(timeout=300) for d in drivers]
    assert all(d.returncode == 0 for d in drivers), [err for _, err in outputs]
    completed = [json.loads(out)["completed"] for out, _ in outputs]
    assert sum(completed) == NUM_ROWS and all(n > 0 for n in completed), completed  # both did work
    with open_store(db).session_scope() as session:
        assert session.scalar(select(func.count()).select_from(Result)) == NUM_ROWS
        assert session.scalar(select(func.max(Request.attempts))) == 1
        assert session.scalar(select(func.count(func.distinct(Result.worker_id)))) == 2
    assert invoke_json("status", job_id, "--db", db)["status"] == "completed"


def test_cancel_while_ray_workers_run_then_sigterm_drains(tmp_path: Path, tiny_model_dir: Path, own_postgres,
                                                          ray_address: str) -> None:
    db = own_postgres.url
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


@sqlite_only  # flags and the data stage, not the store: one database
def test_bad_ray_flags_are_refused_before_anything_starts(tmp_path: Path, db_url: str, ray_address: str) -> None:
    assert "--workers must be at least 1" in invoke("run", "--ray", "--workers", "0", expect=2).output
    assert "go with --ray" in invoke("run", "--workers", "2", expect=2).output
    result = invoke("run", "--ray", "--ray-address", ray_address, "--gpus-per-worker", "1", expect=2)
    assert "GPUs; the Ray cluster has 0" in result.output
    result = invoke("run", "--ray", "--ray-address", ray_address, "--workers", "9", expect=2)
    assert "needs 9 CPUs; the Ray cluster has 4" in result.output
    # Ray missing: a package named ray that fails to import, first on the path
    (tmp_path / "noray" / "ray").mkdir(parents=True)
    (tmp_path / "noray" / "ray" / "__init__.py").write_text("raise ImportError('no ray here')\n")
    done = subprocess.run([sys.executable, "-m", "bulkgen", "run", "--ray", "--db", db_url], capture_output=True,
                          text=True, env={**os.environ, "PYTHONPATH": str(tmp_path / "noray")})
    assert done.returncode == 2 and "bulkgen[ray]" in done.stderr and "Traceback" not in done.stderr


@sqlite_only  # flags and the data stage, not the store: one database
def test_ray_data_stage_adds_exports_columns_equal_to_a_queue_run(tmp_path: Path, tiny_model_dir: Path,
                                                                  db_url: str, ray_address: str) -> None:
    """bulkgen.ray.generate over a Ray Dataset: export's output columns, the same greedy outputs as
    submit + run + export of the same rows, and a bad row carrying its error while the rest go on."""
    import pyarrow.parquet as pq

    from bulkgen.ray import generate
    from tests.helpers import write_parquet

    prompts = ["alpha beta gamma", "", "river stone river", "delta " * 30, "stone"]
    data = write_parquet(tmp_path / "in.parquet", {"prompt": prompts, "n": list(range(len(prompts)))})
    job_id = invoke_json("submit", data, "--model", tiny_model_dir, "--max-new-tokens", 12)["job_id"]
    invoke("run", "--kv-cache-memory", "16MiB", "--no-progress")
    invoke("export", job_id, "-o", tmp_path / "queue.parquet")
    queue = pq.read_table(tmp_path / "queue.parquet").to_pylist()

    dataset = ray.data.from_items([{"prompt": p, "n": i} for i, p in enumerate(prompts)])
    rows = generate(dataset, model=str(tiny_model_dir), sampling={"max_new_tokens": 12},
                    engine={"kv_cache_memory": "16MiB"}, batch_size=2).take_all()
    rows.sort(key=lambda r: r["n"])
    assert [r["n"] for r in rows] == list(range(len(prompts)))
    for got, want in zip(rows, queue, strict=True):
        for column in ("output", "finish_reason", "num_prompt_tokens", "num_output_tokens", "error"):
            assert got[column] == want[column], (column, got, want)
    assert rows[1]["error"] == "prompt is empty" and rows[1]["output"] is None


def test_actors_ride_out_a_database_restart_and_a_stop(tmp_path: Path, tiny_model_dir: Path, own_postgres,
                                                      ray_address: str, standard_reference: list[dict]) -> None:
    """Two actors on a PostgreSQL of the test's own, restarted twice and stopped for 6 s: the actors wait (no
    restart spent, no error), the driver says the database was away, every row once, as one worker's run."""
    reference = standard_reference
    db = own_postgres.url
    job_id = make_job(tmp_path, tiny_model_dir, db, max_new=24)
    proc = ray_run(db, ray_address, "--workers", "2", "--max-num-seqs", "4", "--json")
    outages(db, proc, own_postgres, stopped_s=6.0)
    out, err = proc.communicate(timeout=600)
    assert proc.returncode == 0, err
    summary = json.loads(out)
    assert summary["errors"] == [] and summary["completed"] == NUM_ROWS, summary
    assert summary["db_outages"] >= 1 and summary["db_outage_s"] > 0, summary
    assert_exactly_once(db, job_id, tmp_path, reference)
    with open_store(db).session_scope() as session:
        assert session.scalar(select(func.count()).select_from(Worker)) == 2, "no actor restarted"
