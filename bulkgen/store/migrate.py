"""Alembic driven from code: the schema is brought to head when a store opens.

Developers add a revision with `python -m bulkgen.store.migrate revision "message"`.
"""

from __future__ import annotations

import importlib.resources
import sys
import tempfile
from pathlib import Path

from alembic import command
from alembic.config import Config
from alembic.runtime.migration import MigrationContext
from alembic.script import ScriptDirectory
from sqlalchemy import text
from sqlalchemy.engine import Connection, Engine

from bulkgen.errors import StoreError


def script_location() -> str:
    """The migrations folder: `bulkgen.migrations` when installed, `migrations/` in a checkout."""
    try:
        location = importlib.resources.files("bulkgen.migrations")
        if (Path(str(location)) / "env.py").is_file():
            return str(location)
    except ModuleNotFoundError:
        pass
    return str(Path(__file__).resolve().parents[2] / "migrations")


def alembic_config(connection: Connection | None = None) -> Config:
    config = Config()
    config.set_main_option("script_location", script_location())
    config.attributes["connection"] = connection
    return config


def head_revision() -> str:
    head = ScriptDirectory.from_config(alembic_config()).get_current_head()
    assert head is not None, "migrations/ holds no revision"
    return head


def current_revision(engine: Engine) -> str | None:
    with engine.connect() as conn:
        return MigrationContext.configure(conn).get_current_revision()


def ensure_head(engine: Engine) -> None:
    """Upgrade to head unless already there. Safe when several processes open a new database at once."""
    head = head_revision()
    current = current_revision(engine)
    if current == head:
        return
    known = {rev.revision for rev in ScriptDirectory.from_config(alembic_config()).walk_revisions()}
    if current is not None and current not in known:
        raise StoreError(f"the database is at schema revision {current!r}, which this bulkgen does not know: "
                         "it was written by a newer bulkgen; upgrade bulkgen")
    upgrade(engine)


def upgrade(engine: Engine, revision: str = "head") -> None:
    """Migrations run under a lock, so concurrent openers of a new database take turns (the later
    ones find the schema at head and do nothing)."""
    # SQLite: BEGIN IMMEDIATE takes the write lock up front (see db.py); the DDL is transactional.
    with engine.execution_options(sqlite_begin="IMMEDIATE").begin() as conn:
        if conn.dialect.name == "postgresql":
            # a migration may rewrite a large table (no statement bound), and may wait for another opener's
            conn.execute(text("SET LOCAL statement_timeout = 0; SET LOCAL lock_timeout = '600s'"))
            conn.execute(text("SELECT pg_advisory_xact_lock(7234001)"))
        command.upgrade(alembic_config(conn), revision)


def _revision(message: str) -> None:
    from sqlalchemy import create_engine

    slug = "_".join(message.lower().split())[:40]
    with tempfile.TemporaryDirectory() as tmp:
        engine = create_engine(f"sqlite:///{tmp}/head.db")
        upgrade(engine)
        script = ScriptDirectory.from_config(alembic_config())
        number = len(list(script.walk_revisions())) + 1
        with engine.begin() as conn:
            command.revision(alembic_config(conn), message=message, autogenerate=True,
                             rev_id=f"{number:04d}_{slug}")
        # Alembic appends the slug to the file name too; the id already holds it.
        for path in Path(script_location(), "versions").glob(f"{number:04d}_{slug}_*.py"):
            path.rename(path.with_name(f"{number:04d}_{slug}.py"))


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "revision":
        _revision(sys.argv[2])
    else:
        sys.exit('usage: python -m bulkgen.store.migrate revision "message"')
