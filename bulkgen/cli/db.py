"""`bulkgen db`: the job database's schema (it is also upgraded automatically on open)."""

from __future__ import annotations

import click
from sqlalchemy.engine import make_url

from bulkgen.cli.options import CONTEXT, BulkgenGroup, db_option, emit_json, json_option
from bulkgen.store import migrate
from bulkgen.store.db import create_db_engine, opening


@click.group(cls=BulkgenGroup, context_settings=CONTEXT)
def db() -> None:
    """Manage the job database's schema (it is also upgraded automatically on open).

    \b
    Example:
      bulkgen db current
      bulkgen db upgrade --db postgresql+psycopg://user@host/bulkgen
    """


@db.command(context_settings=CONTEXT)
@db_option
def upgrade(db_url: str) -> None:
    """Bring the database schema to the newest revision.

    \b
    Example:
      bulkgen db upgrade
    """
    engine = create_db_engine(db_url)
    with opening(engine):
        migrate.upgrade(engine)
        revision = migrate.current_revision(engine)
    click.echo(f"{hide_password(db_url)}: at revision {revision}")


@db.command(context_settings=CONTEXT)
@json_option
@db_option
def current(as_json: bool, db_url: str) -> None:
    """Show the database's schema revision and the newest one this bulkgen knows.

    \b
    Example:
      bulkgen db current
    """
    engine = create_db_engine(db_url)
    with opening(engine):
        revision = migrate.current_revision(engine)
    head = migrate.head_revision()
    if as_json:
        emit_json({"url": hide_password(db_url), "current": revision, "head": head})
        return
    state = "up to date" if revision == head else f"behind head {head} (run `bulkgen db upgrade`)"
    click.echo(f"{hide_password(db_url)}: revision {revision or '(empty)'}, {state}")


def hide_password(url: str) -> str:
    try:
        return make_url(url).render_as_string(hide_password=True)
    except Exception:  # not a URL SQLAlchemy can read: shown as given
        return url
