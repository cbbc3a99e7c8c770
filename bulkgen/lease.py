"""A worker's lease on its requests, kept alive by a heartbeat, and the signals that end a run.

The heartbeat renews the leases of the requests the worker knows it holds, a quarter of a lease before they
would expire, from its own thread, so a long engine step never lets a lease lapse; a worker that dies, or that
its watchdog found stalled (liveness.py), stops renewing them and its requests return to the queue. Only what
the worker holds: a request leased under its id that it does not know of (a claim whose answer an outage lost)
is never kept alive by it, and the worker gives it back (queue.reconcile_leases).

SIGINT and SIGTERM ask the run to drain; a second SIGINT ends the process at once (the leases then expire as
after a crash).
"""

from __future__ import annotations

import logging
import os
import signal
import threading
from collections.abc import Callable
from typing import Any

from bulkgen.errors import StoreError
from bulkgen.liveness import Liveness
from bulkgen.store import queue as q
from bulkgen.store.db import Store

log = logging.getLogger(__name__)


class Heartbeat(threading.Thread):
    """Renews this worker's leases while the main thread computes."""

    def __init__(self, store: Store, worker_id: str, lease_s: float, held: Callable[[], list[int]],
                 liveness: Liveness) -> None:
        """held(): the ids of the requests the worker holds now (read from this thread: a copy the main thread
        cannot change half-way)."""
        super().__init__(name="bulkgen-heartbeat", daemon=True)
        self.store = store
        self.worker_id = worker_id
        self.lease_s = lease_s
        self.held = held
        self.liveness = liveness
        self._stopped = threading.Event()

    def run(self) -> None:
        while not self._stopped.wait(self.lease_s / 4):
            held = [] if self.liveness.stalled else self.held()  # a stalled worker's leases lapse
            try:
                with self.store.session_scope(write=True) as session:
                    q.heartbeat(session, self.worker_id, self.liveness.progress_at)
                with self.store.session_scope(write=True) as session:
                    q.renew_leases(session, self.worker_id, self.lease_s, held)
            except StoreError as exc:  # keep trying: a database away is the worker's outage to say (outage.py)
                (log.debug if exc.transient else log.warning)("bulkgen: heartbeat failed: %s", exc)
            except Exception as exc:
                log.warning("bulkgen: heartbeat failed: %s", exc)

    def stop(self) -> None:
        self._stopped.set()
        self.join(timeout=5)


def on_stop_signals(stop: Callable[[str], None], is_stopping: Callable[[], bool],
                    at_once: Callable[[], None] = lambda: None) -> Callable[[], None]:
    """Call stop(signal name) on SIGINT or SIGTERM (a drain: say so there); a second SIGINT calls at_once()
    and exits with status 130. The one handling of stop signals: a worker's and a Ray driver's. Returns a
    function that restores the previous handlers. Outside the main thread (where Python allows no handlers)
    a no-op."""
    if threading.current_thread() is not threading.main_thread():
        return lambda: None

    def handle(signum: int, _frame: Any) -> None:
        if is_stopping() and signum == signal.SIGINT:
            at_once()
            os._exit(130)
        stop(signal.Signals(signum).name)

    previous = {sig: signal.signal(sig, handle) for sig in (signal.SIGINT, signal.SIGTERM)}

    def restore() -> None:
        for sig, handler in previous.items():
            signal.signal(sig, handler)

    return restore
