"""Progress that tells the truth: tokens counted as generated, an ETA from the tokens still to generate,
and a first line as soon as the run starts."""

from __future__ import annotations

import io
import os
import re
import signal
import sqlite3
import subprocess
import threading
import time
from pathlib import Path

import pytest

from bulkgen.progress import Progress
from tests.helpers import invoke_json, write_parquet
from tests.zygote import run_bulkgen


def test_tokens_count_as_generated_and_the_eta_follows_them() -> None:
    stream = io.StringIO()
    progress = Progress(total=10, done=0, budget_left=10 * 100, log_every_s=0.0, stream=stream)
    time.sleep(0.05)
    progress.generated(50)  # no request has finished yet: the rate and the ETA still show
    line = stream.getvalue().splitlines()[-1]
    assert "0/10 requests · 50 tokens generated" in line and " 0.0 output tok/s" not in line
    assert progress.output_rate > 0 and progress.eta_s is not None
    # 950 budget tokens left to go at the current rate
    assert abs(progress.eta_s - 950 / progress.output_rate) < 1e-6
    assert "ETA <=" in progress.line(), "an upper bound until a request shows it uses its whole budget"
    # Two requests finish having used their whole budgets: the budgets are what is left to generate
    progress.generated(150)
    progress.finished(2, 200, 200)
    assert progress.budget_left == 800 and "ETA <=" not in progress.line()
    assert abs(progress.eta_s - (800 - 0) / progress.output_rate) < 1e-6
    # One ends early (EOS): from now on the ETA is an upper bound again
    progress.generated(10)
    progress.finished(1, 10, 100)
    assert "ETA <=" in progress.line() and abs(progress.eta_s - 700 / progress.output_rate) < 1e-6
    progress.finished(7, 0, 700)
    assert progress.eta_s is None and "10/10 requests" in progress.line()


def test_a_run_off_a_terminal_says_what_it_starts_with_and_shows_tokens_before_any_finish(
        tmp_path: Path, db_url: str, tiny_model_dir: Path) -> None:
    data = write_parquet(tmp_path / "in.parquet", {"prompt": [f"Count to {i}." for i in range(6)]})
    job_id = invoke_json("submit", data, "--model", tiny_model_dir, "--max-new-tokens", 300, "--ignore-eos")["job_id"]
    # --log-every 0: a line every step. 300 tokens with EOS ignored are 300 steps before any request can
    # finish, so the lines before the first finish are there by construction, on a machine of any speed.
    done = run_bulkgen(["run", "--log-every", "0", "--kv-cache-memory", "4MiB"], timeout=300,
                       env={**os.environ, "BULKGEN_DB": db_url})
    assert done.returncode == 0, done.stderr
    lines = done.stderr.splitlines()
    first = lines[0]
    assert first.startswith("bulkgen run: model ") and "KV cache" in first and "tokens)" in first
    assert f"jobs {job_id}: 6 requests queued" in first
    assert "C:" in first or "torch:" in first, "the kernel paths taken"
    early = [line for line in lines if line.startswith("bulkgen run: 0/6 requests")]
    with_tokens = [line for line in early if " 0 tokens generated" not in line and "ETA -" not in line]
    assert len(with_tokens) >= 299, lines[:8]  # a line each decode step before the last
    # --ignore-eos: every request runs to its budget, so the ETA is exact, not an upper bound; and the report does
    # not warn that outputs were cut by max_new_tokens, which the job asked for
    assert not [line for line in lines if "ETA <=" in line], [line for line in lines if "ETA <=" in line][:3]
    report = invoke_json("report", job_id, "--json", "--db", db_url)["jobs"][0]
    assert report["finish_reasons"]["counts"] == {"length": 6} and report["finish_reasons"]["warning"] is None


def test_the_job_and_this_workers_share_when_another_worker_runs_it_too() -> None:
    stream = io.StringIO()
    progress = Progress(total=40, done=0, budget_left=40 * 10, log_every_s=0.0, stream=stream)
    progress.generated(5)
    progress.finished(2, 20, 20)
    progress.sync(done=18, total=40, budget_left=22 * 10)  # another worker committed 16 of the job's requests
    line = progress.line()
    assert "18/40 requests (2 by this worker)" in line, line
    assert progress.others_done == 16


NUM = 12


@pytest.mark.parametrize("backend", ["sqlite"], indirect=True)
def _can_write(path: str) -> bool:
    """Whether a SQLite database's write lock is free now."""
    conn = sqlite3.connect(path, timeout=0.2)
    try:
        conn.execute("BEGIN IMMEDIATE")
        conn.rollback()
        return True
    except sqlite3.OperationalError:
        return False
    finally:
        conn.close()


def test_a_worker_shows_what_all_workers_committed(tmp_path: Path, db_url: str, tiny_model_dir: Path) -> None:
    """Worker A claims and is paused (SIGSTOP); worker B runs the rest; A resumes and its progress lines count the
    job's committed requests, B's included, with A's own share beside them."""
    from sqlalchemy import func, select

    from bulkgen.store.db import open_store
    from bulkgen.store.models import Request
    from tests.zygote import bulkgen_process

    data = write_parquet(tmp_path / "in.parquet", {"prompt": [f"Count to {i}." for i in range(NUM)]})
    job_id = invoke_json("submit", data, "--model", tiny_model_dir, "--max-new-tokens", 64, "--ignore-eos")["job_id"]
    flags = ["run", "--db", db_url, "--kv-cache-memory", "4MiB", "--max-num-seqs", "2", "--lease-seconds", "120",
             "--commit-every", "1", "--commit-interval", "0.1"]
    store = open_store(db_url)

    def count(*where) -> int:
        with store.session_scope() as session:
            return session.scalar(select(func.count()).select_from(Request).where(Request.job_id == job_id, *where))

    def wait(condition, what: str, *procs) -> None:
        deadline = time.monotonic() + 120
        while not condition():
            assert all(p.poll() is None for p in procs) and time.monotonic() < deadline, what
            time.sleep(0.05)

    a = bulkgen_process([*flags, "--log-every", "0"], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    b = None
    a_lines: list[str] = []
    stepped = threading.Event()

    def read_a() -> None:  # A's stderr as it comes: A is stopped at a step's line, its work still ahead
        for line in a.stderr:
            a_lines.append(line)
            if "tokens generated" in line:
                stepped.set()

    def stop_a() -> None:
        """SIGSTOP A after a step, at a moment it holds no SQLite write lock (else B could never write)."""
        while True:
            stepped.clear()
            assert stepped.wait(120), "worker A ran no step"
            a.send_signal(signal.SIGSTOP)
            while Path(f"/proc/{a.pid}/stat").read_text().split(")")[-1].split()[0] != "T":
                time.sleep(0.01)  # the kernel has not stopped it yet: no event to await for that
            if not db_url.startswith("sqlite:") or _can_write(db_url.removeprefix("sqlite:///")):
                return
            a.send_signal(signal.SIGCONT)

    reader = threading.Thread(target=read_a, daemon=True)
    reader.start()
    try:
        stop_a()
        held = count(Request.lease_owner.like(f"%:{a.pid}:%"))
        assert held > 0
        b = bulkgen_process([*flags, "--no-progress"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        wait(lambda: count(Request.state == "completed") >= NUM - held, "worker B did not run the rest", b)
        a.send_signal(signal.SIGCONT)
        a.wait(timeout=120)
        reader.join(timeout=120)
        a_err = "".join(a_lines)
        _, b_err = b.communicate(timeout=120)
    finally:
        for proc in (a, b):
            if proc is not None and proc.poll() is None:
                proc.send_signal(signal.SIGCONT)
                proc.kill()
                proc.wait()
    assert a.returncode == 0 and b.returncode == 0, a_err + b_err
    shares = [tuple(map(int, m.groups())) for m in re.finditer(r"run: (\d+)/12 requests \((\d+) by this worker\)",
                                                               a_err)]
    assert shares, a_err[-2000:]
    assert all(done >= NUM - held + mine for done, mine in shares), shares  # B's commits counted, and A's own
    assert [done for done, _ in shares] == sorted(done for done, _ in shares)
