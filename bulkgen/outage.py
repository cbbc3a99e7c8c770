"""A database outage as a worker lives through it: weather, not the end.

A transient store error (db.is_transient: the server restarting, a failover, a dropped connection, a lock held past
the busy timeout) starts an outage: the worker keeps generating what it holds, claims nothing new, keeps finished
rows in memory (past a bound it pauses the engine rather than grow) and tries the database again with backoff and
jitter. The first call that succeeds ends the outage. One line when it starts, one when it ends; past the limit
(--db-outage-s) the error is raised as any other and the worker stops as before. Exactly-once does not rest on
this: the store's commit writes only onto requests this worker still leases (queue.commit_results), so a commit
that landed before its acknowledgement was lost, or a lease taken elsewhere meanwhile, is never written twice.
"""

from __future__ import annotations

import logging
import random
import time
from datetime import UTC, datetime

from bulkgen.errors import StoreError, UnreachableError
from bulkgen.store.db import Store, open_store

log = logging.getLogger(__name__)

FIRST_DELAY_S = 0.5
MAX_DELAY_S = 5.0  # a worker back within seconds of its database; a few workers are no load on a server starting


class Outage:
    def __init__(self, limit_s: float, first_delay_s: float = FIRST_DELAY_S, max_delay_s: float = MAX_DELAY_S,
                 say: bool = True) -> None:
        self.limit_s = limit_s
        self.say = say  # its two lines (a Ray driver shows the outage on its progress line instead)
        self.first_delay_s, self.max_delay_s = first_delay_s, max_delay_s
        self.since: float | None = None  # monotonic start of the current outage
        self.since_wall: datetime | None = None
        self.next_try = 0.0
        self._delay = first_delay_s
        self.num_outages = 0
        self.seconds_down = 0.0  # over the run, outages ended

    @property
    def down(self) -> bool:
        return self.since is not None

    def due(self) -> bool:
        """Whether to try the database now (always, when it is up)."""
        return self.since is None or time.monotonic() >= self.next_try

    def failed(self, exc: StoreError) -> None:
        """A call failed: re-raise what is not transient, or what outlasts the limit; else wait and say so once."""
        if not exc.transient:
            raise exc
        now = time.monotonic()
        if self.since is None:
            if self.limit_s <= 0:  # --db-outage-s 0: the first database error stops the run
                raise exc
            self.since, self.since_wall, self._delay = now, datetime.now(UTC), self.first_delay_s
            self.num_outages += 1
            if self.say:
                log.warning("bulkgen: database unavailable since %s (%s); generation goes on, results are kept and "
                            "committed when it is back (waiting up to %.0fs)", self.since_wall.strftime("%H:%M:%S"),
                            _cause(exc), self.limit_s)
        elif now - self.since > self.limit_s:
            raise StoreError(f"database unavailable for {now - self.since:.0f}s, past --db-outage-s "
                             f"{self.limit_s:.0f}: {exc}") from exc
        self.next_try = now + self._delay * random.uniform(0.5, 1.5)  # jitter: workers do not return in step
        self._delay = min(self._delay * 2, self.max_delay_s)

    def ok(self) -> None:
        """A call succeeded: the outage, if any, is over."""
        if self.since is not None:
            down = time.monotonic() - self.since
            self.seconds_down += down
            if self.say:
                log.warning("bulkgen: database back after %.1fs; committing what was kept", down)
            self.since = self.since_wall = None

    def status(self) -> str | None:
        """For a progress line: 'database unavailable since HH:MM:SS', or None."""
        if self.since_wall is None:
            return None
        return f"database unavailable since {self.since_wall.strftime('%H:%M:%S')}"

    def wait(self) -> None:
        """Sleep until the next try (a worker with nothing else to do)."""
        time.sleep(max(0.0, min(self.next_try - time.monotonic(), self.max_delay_s)))


def open_store_waiting(url: str, limit_s: float) -> Store:
    """A worker's first contact with its database: a database that does not answer yet, for a reason that may pass
    (a worker restarted while its server restarts), is waited for as an outage is, up to limit_s (--db-outage-s),
    said in one line that names the URL (a typo in it looks the same, and Ctrl-C ends the wait)."""
    outage = Outage(limit_s, say=False)
    while True:
        try:
            store = open_store(url)
        except UnreachableError as exc:
            first = not outage.down
            try:
                outage.failed(StoreError(str(exc), transient=True))
            except StoreError:
                raise exc from None  # past the limit (or --db-outage-s 0): the first contact's own error
            if first:
                log.warning("bulkgen: %s; waiting for it up to %.0fs (--db-outage-s)", str(exc).split("; ")[0],
                            limit_s)
            outage.wait()
            continue
        if outage.since is not None:
            log.warning("bulkgen: database reached after %.1fs", time.monotonic() - outage.since)
        return store


def _cause(exc: StoreError) -> str:
    text = str(exc)
    return text.split(": ", 1)[1] if text.startswith("database error on ") and ": " in text else text
