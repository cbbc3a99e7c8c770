"""The soak: every fault at once, at random moments from a seeded generator, against `bulkgen run` workers on a
PostgreSQL server of its own, reached through a proxy that can drop a connection between a commit and its answer.

Faults: a worker killed (SIGKILL; restarted), a worker paused (SIGSTOP for up to twice its lease, between its
transactions), the server restarted (`pg_ctl restart -m fast`) or stopped for a few seconds, a claim's or a
commit's answer lost (the proxy), a job cancelled and retried. The jobs: greedy rows with a JSON-schema column
(half the rows constrained) and sampled rows (n=2, top-p) with the same column.

What must hold, each round: every worker exits 0 or was killed by the soak; the jobs end; every (row, sample) has
exactly one result; the outputs equal an uninterrupted run's (the same jobs, one worker, no fault); no worker says
it made no progress (--stall-s) and no wait for a new result while work was left outlasts its bound.

Short form: tests/test_soak.py (in the suite, one round). Long form, rounds until the time is up, the faults
survived counted at the end:

    python -m tests.soak --minutes 60 [--workers 3] [--seed 1] [--rows 150]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import signal
import subprocess
import tempfile
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import pyarrow.parquet as pq
from sqlalchemy import func, select

from bulkgen.store.db import Store, open_store
from bulkgen.store.models import Job, Request, Result
from tests.conftest import OwnDatabase, OwnPostgres, make_tiny_model
from tests.helpers import invoke, invoke_json, write_parquet
from tests.test_db_outage import DroppingProxy
from tests.test_worker_process import pause_between_transactions
from tests.zygote import bulkgen_process, run_bulkgen

SCHEMA = json.dumps({"type": "object", "properties": {"name": {"type": "string", "maxLength": 8},
                                                      "n": {"type": "integer", "minimum": 0, "maximum": 99}},
                     "required": ["name", "n"], "additionalProperties": False})
LEASE_S = 5
STALL_S = 60
WORKER_FLAGS = ["--kv-cache-memory", "16MiB", "--max-num-seqs", "8", "--commit-every", "8", "--commit-interval",
                "0.2", "--lease-seconds", str(LEASE_S), "--no-progress", "--json", "--max-attempts", "1000",
                "--stall-s", str(STALL_S)]
# between two results while work is left: the longest fault (a pause of two leases, a stop of 4 s) and the
# outage's backoff (5 s at most) and a lease for what a killed or paused worker held, with room
PROGRESS_BOUND_S = 45.0
FAULTS = {"kill": 3, "pause": 2, "restart": 2, "stop": 2, "drop": 3, "cancel_retry": 1}


@dataclass
class Round:
    """What one round survived, and how long it went at most without a new result."""

    faults: Counter = field(default_factory=Counter)
    longest_wait_s: float = 0.0
    seconds: float = 0.0


def make_jobs(folder: Path, model: Path, db: str, num_rows: int) -> list[int]:
    """A greedy job and a sampled one (n=2) over the same prompts, half of each row's schema set."""
    folder.mkdir(parents=True, exist_ok=True)
    rng = random.Random(0)
    prompts = [" ".join(rng.choice(["cat", "dog", "owl", "fox", "river", "stone"]) for _ in range(rng.randint(2, 40)))
               for _ in range(num_rows)]
    data = write_parquet(folder / "in.parquet", {"prompt": prompts, "schema": [SCHEMA, None] * (num_rows // 2)})
    common = ["--model", model, "--json-schema-column", "schema", "--max-new-tokens", 20, "--db", db]
    greedy = invoke_json("submit", data, *common)["job_id"]
    sampled = invoke_json("submit", data, *common, "--temperature", 0.8, "--top-p", 0.95, "--n", 2, "--seed", 3)
    return [greedy, sampled["job_id"]]


def outputs(db: str, job_ids: list[int], folder: Path) -> dict[int, list[tuple]]:
    """Each job's export: (row, sample, status, finish reason, output) in input order."""
    out = {}
    for job_id in job_ids:
        path = folder / f"export-{job_id}.parquet"
        invoke("export", job_id, "-o", path, "--db", db)
        out[job_id] = [(r["row"], r["sample"], r["status"], r["finish_reason"], r["output"])
                       for r in pq.read_table(path).to_pylist()]
    return out


def reference(folder: Path, model: Path, num_rows: int) -> list[list[tuple]]:
    """The uninterrupted run: one worker, SQLite, no fault."""
    db = f"sqlite:///{folder / 'reference.db'}"
    job_ids = make_jobs(folder, model, db, num_rows)
    done = run_bulkgen(["run", "--db", db, *WORKER_FLAGS], timeout=900)
    assert done.returncode == 0, done.stderr
    found = outputs(db, job_ids, folder)
    return [found[job_id] for job_id in job_ids]


class Soak:
    def __init__(self, root: Path, model: Path, server: OwnPostgres | OwnDatabase, num_workers: int, num_rows: int,
                 rng: random.Random, schedule: list[str] | None = None) -> None:
        """`schedule`: the faults of each round, in this order, back to back (the short form: every kind once);
        None: faults drawn by their weights every 1.5-4 s until the jobs end (the long form)."""
        self.root, self.model, self.server = root, model, server
        self.num_workers, self.num_rows, self.rng = num_workers, num_rows, rng
        self.schedule = schedule
        self.proxy = DroppingProxy(server.port, drops=0)
        self.proxy.start()
        self.expected = reference(root / "reference", model, num_rows)
        self.num_rounds = 0
        self.num_started = 0

    def round(self) -> Round:
        """One round: fresh jobs on a fresh database, workers and faults until the jobs end; checked."""
        self.num_rounds += 1
        folder = self.root / f"round-{self.num_rounds}"
        name = f"soak{self.num_rounds}"
        self.server.createdb(name)
        direct = self.server.url.rsplit("/", 1)[0] + f"/{name}"
        via_proxy = direct.replace(f":{self.server.port}/", f":{self.proxy.port}/")
        job_ids = make_jobs(folder, self.model, direct, self.num_rows)
        store = open_store(direct, upgrade=False)
        result = Round()
        started = time.monotonic()
        workers = [self._start(via_proxy, folder) for _ in range(self.num_workers)]
        killed: set[int] = set()
        last_count, last_change = 0, time.monotonic()
        to_come = list(self.schedule) if self.schedule is not None else None
        gap = (0.3, 1.0) if to_come is not None else (1.5, 4.0)
        next_fault = time.monotonic() + self.rng.uniform(*gap)
        while True:
            with store.session_scope() as session:
                count = session.scalar(select(func.count()).select_from(Result))
                statuses = set(session.scalars(select(Job.status).where(Job.id.in_(job_ids))))
            if count != last_count:
                last_count, last_change = count, time.monotonic()
            if statuses == {"completed"}:
                break
            waited = time.monotonic() - last_change
            result.longest_wait_s = max(result.longest_wait_s, waited)
            assert waited < PROGRESS_BOUND_S, f"no new result for {waited:.0f}s with work left: {self._logs(folder)}"
            for i, proc in enumerate(workers):
                if proc.poll() is not None:  # killed by us, or ended (its jobs were final): another takes its place
                    assert proc.returncode == 0 or proc.pid in killed, self._failure(folder, proc)
                    workers[i] = self._start(via_proxy, folder)
            if time.monotonic() >= next_fault and to_come != []:
                kind = to_come.pop(0) if to_come else None
                result.faults[self._fault(direct, job_ids, workers, killed, kind)] += 1
                next_fault = time.monotonic() + self.rng.uniform(*gap)
            time.sleep(0.05)
        for proc in workers:
            proc.wait(timeout=120)
            assert proc.returncode == 0 or proc.pid in killed, self._failure(folder, proc)
        result.seconds = time.monotonic() - started
        self._check(store, direct, job_ids, folder)
        store.close()
        return result

    # ------------------------------------------------------------------ the faults

    def _fault(self, db: str, job_ids: list[int], workers: list[subprocess.Popen], killed: set[int],
               kind: str | None = None) -> str:
        kind = kind or self.rng.choices(list(FAULTS), weights=list(FAULTS.values()))[0]
        alive = [p for p in workers if p.poll() is None]
        if kind in ("kill", "pause") and not alive:
            kind = "restart"
        if kind == "kill":
            victim = self.rng.choice(alive)
            killed.add(victim.pid)
            victim.send_signal(signal.SIGKILL)
            victim.wait()
        elif kind == "pause":
            victim = self.rng.choice(alive)
            pause_between_transactions(db, victim.pid, time.monotonic() + 60)
            try:
                time.sleep(self.rng.uniform(0.5, 2 * LEASE_S))  # the fault's own length: past the lease or not
            finally:
                os.kill(victim.pid, signal.SIGCONT)
        elif kind == "restart":
            self.server.restart()
        elif kind == "stop":
            self.server.stop()
            try:
                time.sleep(self.rng.uniform(1.0, 4.0))  # the fault's own length
            finally:
                self.server.start()
        elif kind == "drop":
            self.proxy.marker = self.rng.choice([b"INSERT INTO results", b"SKIP LOCKED"])
            self.proxy.drops = self.proxy.dropped + 1  # the next such transaction's answer is lost
        else:
            job_id = self.rng.choice(job_ids)
            invoke("cancel", job_id, "--db", db)
            invoke("retry", job_id, "--db", db)
        return kind

    # ------------------------------------------------------------------ workers and checks

    def _start(self, db: str, folder: Path) -> subprocess.Popen:
        self.num_started += 1
        log = open(folder / f"worker-{self.num_started:03d}.log", "w")  # noqa: SIM115 - the process owns it
        return bulkgen_process(["run", "--db", db, *WORKER_FLAGS], stdout=log, stderr=subprocess.STDOUT, text=True,
                               cwd=folder)

    def _failure(self, folder: Path, proc: subprocess.Popen) -> str:
        return f"a worker exited {proc.returncode}:\n{self._logs(folder)}"

    def _logs(self, folder: Path) -> str:
        return "\n".join(f"--- {p.name}\n{p.read_text()[-3000:]}" for p in sorted(folder.glob("worker-*.log")))

    def _check(self, store: Store, db: str, job_ids: list[int], folder: Path) -> None:
        found = outputs(db, job_ids, folder)
        for job_id, expected in zip(job_ids, self.expected, strict=True):
            got = found[job_id]
            assert [(r[0], r[1]) for r in got] == [(r[0], r[1]) for r in expected], f"job {job_id}: rows"
            assert all(r[2] == "completed" for r in got), [r for r in got if r[2] != "completed"][:3]
            differ = [(e, g) for e, g in zip(expected, got, strict=True) if e != g]
            assert not differ, f"job {job_id}: {len(differ)} outputs differ from the uninterrupted run: {differ[:2]}"
        with store.session_scope() as session:
            num_requests = session.scalar(select(func.count()).select_from(Request))
            assert session.scalar(select(func.count()).select_from(Result)) == num_requests
            assert session.scalar(select(func.count(func.distinct(Result.request_id)))) == num_requests
        logs = self._logs(folder)
        assert "no progress for" not in logs and "stalled" not in logs, logs
        assert "Traceback" not in logs, logs


def own_server(root: Path) -> OwnPostgres:
    root.mkdir(parents=True, exist_ok=True)
    root.chmod(0o755)  # the server runs as another user
    return OwnPostgres(root)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--minutes", type=float, default=60.0)
    parser.add_argument("--workers", type=int, default=3)
    parser.add_argument("--rows", type=int, default=150)
    parser.add_argument("--seed", type=int, default=1)
    args = parser.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    root = Path(tempfile.mkdtemp(prefix="bulkgen-soak-", dir="/tmp"))
    root.chmod(0o755)
    from bulkgen.resolve import DEFAULT_MODEL, resolve_model

    model = make_tiny_model(root / "model", resolve_model(DEFAULT_MODEL).path)
    server = own_server(root / "pg")
    total, longest, rounds = Counter(), 0.0, 0
    deadline = time.monotonic() + args.minutes * 60
    passed = False
    try:
        soak = Soak(root, model, server, args.workers, args.rows, random.Random(args.seed))
        while time.monotonic() < deadline:
            done = soak.round()
            rounds += 1
            total += done.faults
            longest = max(longest, done.longest_wait_s)
            print(f"round {rounds}: {done.seconds:.0f}s, faults {dict(done.faults)}, longest wait for a result "
                  f"{done.longest_wait_s:.1f}s: every row once, outputs equal the uninterrupted run", flush=True)
        passed = True
    finally:
        try:
            server.stop()
        except AssertionError:
            pass
        if passed:
            shutil.rmtree(root, ignore_errors=True)
        else:
            print(f"soak: failed; its files (worker logs, the server's log) are kept in {root}", flush=True)
    print(f"soak: {rounds} rounds in {args.minutes:g} min, {sum(total.values())} faults survived "
          f"({', '.join(f'{k} {v}' for k, v in sorted(total.items()))}); longest wait for a result {longest:.1f}s")


if __name__ == "__main__":
    main()
