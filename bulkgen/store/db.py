"""Opening a database: engine settings per dialect, the schema brought to head, one session scope."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from sqlalchemy import create_engine, event, text
from sqlalchemy.engine import Engine, make_url
from sqlalchemy.exc import ArgumentError, SQLAlchemyError
from sqlalchemy.orm import Session, sessionmaker

from bulkgen.config import Paths
from bulkgen.errors import BulkgenError, ConfigError, StoreError, UnreachableError
from bulkgen.store import migrate

# Every wait on a database has a bound (a wait that reaches it is a transient error: an outage, waited out up to
# --db-outage-s, never a hang). SQLite: a write lock held by another process. PostgreSQL: the connect, a lock, a
# statement, a transaction another client left open, and a connection whose server went away without a word
# (TCP keepalives while idle, a user timeout while an answer is awaited).
SQLITE_BUSY_TIMEOUT_MS = 60_000
PG_CONNECT_TIMEOUT_S = 5  # an unreachable server is said in seconds, not after TCP's minutes
PG_LOCK_TIMEOUT_S = 30  # the queue's own transactions hold row locks for milliseconds
PG_STATEMENT_TIMEOUT_S = 600  # a cancel or retry of a job of millions of rows is one UPDATE; migrations: none
PG_IDLE_IN_TRANSACTION_S = 300  # a client stopped inside a transaction (SIGSTOP, a debugger) frees its locks
PG_KEEPALIVE = {"keepalives": 1, "keepalives_idle": 10, "keepalives_interval": 5, "keepalives_count": 3}
PG_TCP_USER_TIMEOUT_MS = 30_000  # data unacknowledged this long: the connection is dead


class Store:
    """An open job store. `session_scope()` is the only way code talks to the database."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self._sessions = sessionmaker(engine, expire_on_commit=False)
        # SQLite has one writer at a time: a claim takes the write lock up front (BEGIN IMMEDIATE)
        # instead of failing half-way when a read turns into a write.
        self._write_sessions = sessionmaker(
            engine.execution_options(sqlite_begin="IMMEDIATE") if self.is_sqlite else engine,
            expire_on_commit=False,
        )

    @property
    def is_sqlite(self) -> bool:
        return self.engine.dialect.name == "sqlite"

    @property
    def url(self) -> str:
        return self.engine.url.render_as_string(hide_password=True)

    @contextmanager
    def session_scope(self, write: bool = False) -> Iterator[Session]:
        """A transaction: committed on success, rolled back and re-raised as StoreError on failure."""
        session = (self._write_sessions if write else self._sessions)()
        try:
            yield session
            session.commit()
        except BulkgenError:
            session.rollback()
            raise
        except SQLAlchemyError as exc:
            try:
                session.rollback()
            except SQLAlchemyError:  # the connection is gone: nothing to roll back on it
                pass
            raise StoreError(f"database error on {self.url}: {_reason(exc)}", transient=is_transient(exc)) from exc
        except BaseException:
            session.rollback()
            raise
        finally:
            session.close()

    def ping(self) -> None:
        """One round trip to the database (StoreError where it is away)."""
        with self.session_scope() as session:
            session.execute(text("SELECT 1"))

    def close(self) -> None:
        self.engine.dispose()


def open_store(url: str, upgrade: bool = True) -> Store:
    """Open (creating if needed) the database at `url` and bring its schema to head."""
    engine = create_db_engine(url)
    store = Store(engine)
    if upgrade:
        with opening(engine):
            migrate.ensure_head(engine)
    return store


@contextmanager
def opening(engine: Engine) -> Iterator[None]:
    """First contact with a database: what fails here (not a database, not writable, unreachable) is the
    --db setting's fault, said in one line."""
    try:
        yield
    except BulkgenError:
        raise
    except (SQLAlchemyError, OSError) as exc:
        hint = ("give --db (or BULKGEN_DB) a bulkgen database, or a new file in a directory you can write"
                if engine.dialect.name == "sqlite" else
                "check the host, port, user and database name of --db (or BULKGEN_DB); the database must exist "
                "(createdb NAME), its schema is made on first use")
        error = UnreachableError if isinstance(exc, SQLAlchemyError) and is_transient(exc) else ConfigError
        raise error(f"cannot open the database {engine.url.render_as_string(hide_password=True)}: "
                    f"{_reason(exc)}; {hint}") from exc


def create_db_engine(url: str) -> Engine:
    try:
        parsed = make_url(url)
    except (ArgumentError, ValueError) as exc:
        raise ConfigError(f"cannot read database URL {url!r}: use sqlite:///path/to/file.db "
                          "or postgresql+psycopg://user:pass@host/db") from exc
    if parsed.get_backend_name() == "sqlite":
        return _sqlite_engine(parsed)
    is_postgres = parsed.get_backend_name() == "postgresql"
    connect_args = {"connect_timeout": PG_CONNECT_TIMEOUT_S, **PG_KEEPALIVE,
                    "tcp_user_timeout": PG_TCP_USER_TIMEOUT_MS} if is_postgres else {}
    try:
        engine = create_engine(parsed, pool_pre_ping=True, connect_args=connect_args)
    except Exception as exc:  # a missing driver surfaces here as ImportError / NoSuchModuleError
        raise ConfigError(f"cannot open {parsed.render_as_string(hide_password=True)}: {exc}; "
                          "for PostgreSQL install bulkgen[postgres]") from exc
    if is_postgres:
        event.listen(engine, "connect", _bound_postgres_session)
    return engine


def _bound_postgres_session(dbapi_conn, _record) -> None:
    """Each new PostgreSQL connection's own bounds on waiting (set once; the pool keeps them)."""
    autocommit = dbapi_conn.autocommit
    dbapi_conn.autocommit = True
    with dbapi_conn.cursor() as cursor:
        cursor.execute(f"SET lock_timeout = '{PG_LOCK_TIMEOUT_S}s'")
        cursor.execute(f"SET statement_timeout = '{PG_STATEMENT_TIMEOUT_S}s'")
        cursor.execute(f"SET idle_in_transaction_session_timeout = '{PG_IDLE_IN_TRANSACTION_S}s'")
    dbapi_conn.autocommit = autocommit


def _sqlite_engine(url) -> Engine:
    if url.database and url.database != ":memory:":
        path = Path(url.database).expanduser()
        if path.is_dir():
            raise ConfigError(f"database {path} is a directory: give a file, such as {path / 'bulkgen.db'}")
        if not path.parent.is_dir():
            if path.parent.resolve() != Paths().data_dir.resolve():  # a place the user named: a typo, not a new queue
                raise ConfigError(f"the directory {path.parent} of database {path} does not exist: create it first, "
                                  "or give another --db")
            try:  # bulkgen's own data folder, made on first use
                path.parent.mkdir(parents=True, exist_ok=True)
            except OSError as exc:
                raise ConfigError(f"cannot create the directory for database {path}: {exc}") from exc
        url = url.set(database=str(path))
    engine = create_engine(url, connect_args={"timeout": SQLITE_BUSY_TIMEOUT_MS / 1000})

    @event.listens_for(engine, "connect")
    def _on_connect(dbapi_conn, _record) -> None:
        # We emit BEGIN ourselves (below), so that a writer can ask for BEGIN IMMEDIATE.
        dbapi_conn.isolation_level = None
        cursor = dbapi_conn.cursor()
        cursor.execute("PRAGMA journal_mode=WAL")  # readers never block the writer
        cursor.execute(f"PRAGMA busy_timeout={SQLITE_BUSY_TIMEOUT_MS}")
        cursor.execute("PRAGMA synchronous=FULL")  # a committed result survives a power cut too
        cursor.execute("PRAGMA foreign_keys=ON")
        cursor.close()

    @event.listens_for(engine, "begin")
    def _on_begin(conn) -> None:
        conn.exec_driver_sql(f"BEGIN {conn.get_execution_options().get('sqlite_begin', 'DEFERRED')}")

    return engine


# PostgreSQL's SQLSTATEs a worker waits out: the connection classes, the server shutting down or starting up,
# too many connections, a failover's read-only standby, a serialization failure or deadlock (a retry succeeds), and
# a bound of ours reached: a lock (55P03), a statement (57014), a transaction left idle (25P03)
TRANSIENT_SQLSTATE_CLASSES = ("08",)
TRANSIENT_SQLSTATES = {"57P01", "57P02", "57P03", "53300", "25006", "40001", "40P01", "55P03", "57014", "25P03"}
# what stops a worker at once, whatever else the message says: full disk, out of memory, files, I/O, credentials,
# a missing database, table or column
FATAL_SQLSTATE_CLASSES = ("53100", "53200", "58", "28", "3D", "42", "XX")
# a connection refused for what it is (said at connect, often without a SQLSTATE): credentials, a missing role or
# database, a server configured to refuse
FATAL_WORDS = ("authentication failed", "does not exist", "no pg_hba.conf entry", "permission denied",
               "no such table", "no such column", "disk i/o error", "not a database", "readonly database",
               "unsupported", "too new")
TRANSIENT_WORDS = ("connection refused", "connection failed", "could not connect", "server closed the connection",
                   "terminating connection", "the database system is", "connection reset", "connection timed out",
                   "consuming input failed", "connection is closed", "connection has been closed",
                   "ssl connection has been closed", "no connection to the server", "database is locked",
                   "database is busy", "read-only transaction", "connection not open", "broken pipe",
                   "lost synchronization", "timeout expired", "the connection is lost")


def is_transient(exc: BaseException) -> bool:
    """Whether a database error is the weather (wait and try again) or the end (stop now, with its message)."""
    orig = getattr(exc, "orig", None) or exc
    state = getattr(orig, "sqlstate", None) or getattr(getattr(orig, "diag", None), "sqlstate", None)
    if state:
        if state.startswith(FATAL_SQLSTATE_CLASSES):
            return False
        if state.startswith(TRANSIENT_SQLSTATE_CLASSES) or state in TRANSIENT_SQLSTATES:
            return True
    if getattr(exc, "connection_invalidated", False):
        return True
    text = str(orig).lower()
    if any(word in text for word in FATAL_WORDS) or "disk" in text and "full" in text:
        return False
    return any(word in text for word in TRANSIENT_WORDS)


def _reason(exc: BaseException) -> str:
    """The database's own words, on one line: the driver's message without SQLAlchemy's statement dump."""
    text = str(getattr(exc, "orig", None) or exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__
