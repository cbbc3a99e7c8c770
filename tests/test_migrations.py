"""The schema exists only through migrations, and the migrations match the models."""

from __future__ import annotations

import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
from alembic.autogenerate import compare_metadata
from alembic.migration import MigrationContext
from sqlalchemy import create_engine, inspect

from bulkgen.store import migrate
from bulkgen.store.db import open_store
from bulkgen.store.models import Base
from tests.conftest import REPO
from tests.helpers import invoke


def test_migrations_from_empty_to_head_match_the_models(make_db) -> None:
    engine = create_engine(make_db("m"))
    migrate.upgrade(engine)
    with engine.connect() as conn:
        diff = compare_metadata(MigrationContext.configure(conn, opts={"compare_type": True}), Base.metadata)
    assert diff == []
    assert migrate.current_revision(engine) == migrate.head_revision()


def test_open_applies_migrations_and_uses_wal(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The default database, its folder made on first use (a folder the user names must exist: test_cli)."""
    from bulkgen.config import Paths

    monkeypatch.delenv("BULKGEN_DB", raising=False)
    monkeypatch.setenv("BULKGEN_HOME", str(tmp_path / "sub" / "home"))
    store = open_store(Paths().default_db_url)
    assert (tmp_path / "sub" / "home" / "bulkgen.db").is_file()
    assert set(inspect(store.engine).get_table_names()) >= {"jobs", "requests", "results", "workers",
                                                            "alembic_version"}
    with store.engine.connect() as conn:
        assert conn.exec_driver_sql("PRAGMA journal_mode").scalar() == "wal"
        assert conn.exec_driver_sql("PRAGMA busy_timeout").scalar() >= 1000


def test_downgrade_to_base_and_back(make_db) -> None:
    """Upgrading in place: from base (and from any revision between) to head."""
    from alembic import command

    engine = create_engine(make_db("d"))
    migrate.upgrade(engine)
    with engine.begin() as conn:
        command.downgrade(migrate.alembic_config(conn), "base")
    assert "jobs" not in inspect(engine).get_table_names()
    migrate.upgrade(engine)
    assert "jobs" in inspect(engine).get_table_names()


def test_db_commands(make_db) -> None:
    url = make_db("c")
    assert "(empty)" in invoke("db", "current", "--db", url).output
    invoke("db", "upgrade", "--db", url)
    out = invoke("db", "current", "--db", url).output
    assert migrate.head_revision() in out and "up to date" in out


def test_wheel_ships_the_migrations(tmp_path: Path) -> None:
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
                    "-w", str(tmp_path), str(REPO)], check=True, capture_output=True)
    wheel = next(tmp_path.glob("bulkgen-*.whl"))
    names = zipfile.ZipFile(wheel).namelist()
    assert "bulkgen/migrations/env.py" in names
    assert "bulkgen/migrations/script.py.mako" in names
    assert any(n.startswith("bulkgen/migrations/versions/0001_") for n in names)
    # Installed from the wheel (not editable), the store still finds its migrations.
    site = tmp_path / "site"
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", str(site), str(wheel)],
                   check=True, capture_output=True)
    code = ("import bulkgen, sys; from bulkgen.store import migrate; from bulkgen.store.db import open_store; "
            f"open_store('sqlite:///{tmp_path / 'w.db'}'); print(bulkgen.__file__, migrate.script_location())")
    done = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True,
                          env={"PYTHONPATH": str(site), "PATH": "/usr/bin:/bin"})
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith(str(site)) and "site/bulkgen/migrations" in done.stdout


def test_many_workers_opening_a_new_database_at_once_migrate_it_once(make_db) -> None:
    """Workers started together on an empty database: one applies the migrations, the rest wait and find the
    schema at head (SQLite: its write lock; PostgreSQL: an advisory lock)."""
    url = make_db("race")
    code = "import sys; from bulkgen.store.db import open_store; open_store(sys.argv[1]); print('ok')"
    procs = [subprocess.Popen([sys.executable, "-c", code, url], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True) for _ in range(4)]
    results = [p.communicate(timeout=120) for p in procs]
    assert all(p.returncode == 0 for p in procs), [err for _, err in results]
    assert migrate.current_revision(create_engine(url)) == migrate.head_revision()


def test_requests_queued_before_the_lpt_rank_are_ranked_as_their_claims_ordered_them(make_db) -> None:
    """A database of 0006 with a job's requests: upgraded, each request's lpt_rank is its place in plain lpt order
    (most output tokens, then the longest prompt, then the latest row), per job."""
    from sqlalchemy import text

    engine = create_engine(make_db("r"))
    migrate.upgrade(engine, "0006_model_revision")
    budgets = [(16, 100), (256, 10), (64, 500), (256, 50), (16, 500), (64, 500)]  # (max_new, prompt tokens)
    with engine.begin() as conn:
        for job in (1, 2):
            conn.execute(text("INSERT INTO jobs (id, status, model, model_path, input_path, input_fingerprint, "
                              "input_columns, spec, num_requests, created_at) VALUES (:id, 'queued', 'm', 'm', '-', "
                              "'-', '[]', '{}', 6, '2026-01-01')"), {"id": job})
            for row, (max_new, prompt) in enumerate(budgets):
                conn.execute(text("INSERT INTO requests (job_id, row, sample, num_prompt_tokens, max_new_tokens, "
                                  "seed, state, attempts, updated_at) VALUES (:job, :row, 0, :prompt, :max_new, 0, "
                                  "'pending', 0, '2026-01-01')"),
                             {"job": job, "row": row, "prompt": prompt, "max_new": max_new})
    migrate.upgrade(engine)
    with engine.connect() as conn:
        ranks = conn.execute(text("SELECT job_id, row, lpt_rank FROM requests ORDER BY job_id, lpt_rank")).all()
        ungrouped = conn.execute(text("SELECT COUNT(*) FROM requests WHERE lpt_group_end = lpt_rank + 1")).scalar()
    assert ungrouped == 12, "no request of theirs is in a group"
    assert [(job, row) for job, row, _ in ranks] == [(job, row) for job in (1, 2) for row in (3, 1, 5, 2, 4, 0)]
    assert [rank for _, _, rank in ranks] == [0, 1, 2, 3, 4, 5] * 2
