"""A worker's liveness: what proves it alive is progress, not a running process.

The main thread marks progress (an engine step that computed tokens, a claim, a commit, requests given back) and
names what it is doing while it does it (`doing`: an engine step, a database call and which). A watchdog thread
looks every few seconds. A worker that holds requests or uncommitted rows, is not waiting out a database outage
(bounded by --db-outage-s on its own) and has made no progress

- for a quarter of --stall-s says so, once, in one line: what it holds and what it is waiting on;
- for --stall-s is stalled: the heartbeat stops renewing its leases (they return to the queue within a lease),
  and the main thread is asked to stop: at its next turn it raises StalledError (exit 1, its requests given
  back). Where it does not come back within a lease (a call that never returns), the watchdog says where it is
  and ends the process with exit 1; its leases, no longer renewed, expire as after a crash.

A worker that holds nothing waits on other workers (whose own watchdogs bound them) and is never stalled.
"""

from __future__ import annotations

import logging
import os
import sys
import threading
import time
import traceback
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from datetime import datetime

from bulkgen.errors import BulkgenError
from bulkgen.store.models import utcnow

log = logging.getLogger(__name__)

WARN_SHARE = 0.25  # of --stall-s without progress: the line that says what the worker waits on
MIN_GRACE_S = 5.0  # at least this long for a stalled main thread to stop on its own before the process ends


class StalledError(BulkgenError):
    """The worker made no progress for --stall-s while holding work (exit 1; its requests go back)."""


class Liveness:
    def __init__(self, stall_s: float, lease_s: float, holding: Callable[[], tuple[int, int]],
                 waiting_out: Callable[[], bool]) -> None:
        """holding(): (requests held, rows not committed); waiting_out(): whether a database outage is being
        waited out (its own bound applies)."""
        self.stall_s = stall_s
        self.grace_s = max(lease_s, MIN_GRACE_S)
        self._holding, self._waiting_out = holding, waiting_out
        self.last_progress = time.monotonic()
        self.progress_at: datetime = utcnow()  # the same moment on the wall clock (the heartbeat records it)
        self.activity, self.activity_since = "starting", time.monotonic()
        self.stalled: str | None = None  # the line that said so, once stalled
        self._warned = False
        self._stalled_at = 0.0
        self._stop = threading.Event()
        self._main = threading.current_thread()
        self._thread: threading.Thread | None = None

    # ------------------------------------------------------------------ the main thread

    def progressed(self) -> None:
        self.last_progress = time.monotonic()
        self.progress_at = utcnow()
        self._warned = False

    @contextmanager
    def doing(self, what: str) -> Iterator[None]:
        """Name what the main thread is doing (what a stall line says it waits on)."""
        before = self.activity, self.activity_since
        self.activity, self.activity_since = what, time.monotonic()
        try:
            yield
        finally:
            self.activity, self.activity_since = before

    def check(self) -> None:
        """Called at each turn of the worker's loop: raises StalledError once the watchdog found it stalled."""
        if self.stalled is not None:
            raise StalledError(self.stalled)

    # ------------------------------------------------------------------ the watchdog

    def start(self) -> None:
        """Watch the calling thread (the one that runs the worker's loop)."""
        self._main = threading.current_thread()
        self._thread = threading.Thread(target=self._watch, name="bulkgen-watchdog", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()

    @property
    def interval_s(self) -> float:
        return min(5.0, max(0.05, self.stall_s / 20))

    def _watch(self) -> None:
        while not self._stop.wait(self.interval_s):
            self.look()

    def look(self) -> None:
        """One look (the watchdog's, every interval_s)."""
        now = time.monotonic()
        if self.stalled is not None:
            # only a process of its own (the CLI's, a Ray actor's) is ended: a worker run in a thread of a program
            # (the Python API) leaves that program to decide; its leases lapse all the same
            if now - self._stalled_at > self.grace_s and not self._stop.is_set() \
                    and self._main is threading.main_thread():
                self._end_process()
            return
        num_held, num_rows = self._holding()
        if (num_held == 0 and num_rows == 0) or self._waiting_out():
            self.last_progress = now  # nothing of its own to make progress on, or a bound of its own applies
            return
        idle = now - self.last_progress
        holds = f"holding {num_held} request(s)" + (f", {num_rows} result(s) not committed" if num_rows else "")
        waiting = f"{self.activity} (for {now - self.activity_since:.0f}s)"
        if idle >= self.stall_s:
            self.stalled = (f"stalled: no progress for {idle:.0f}s while {holds}, in {waiting}; stopping (exit 1): "
                            f"its requests return to the queue (--stall-s {self.stall_s:g})")
            self._stalled_at = now  # the main thread says it (StalledError), or _end_process where it cannot
        elif idle >= WARN_SHARE * self.stall_s and not self._warned:
            self._warned = True
            log.warning("bulkgen: no progress for %.0fs while %s: waiting on %s; the worker stops if this lasts "
                        "%.0fs (--stall-s)", idle, holds, waiting, self.stall_s)

    def _end_process(self) -> None:
        """The main thread did not come back from where it stalled: say where, and end (exit 1)."""
        frame = sys._current_frames().get(self._main.ident or -1)
        stack = traceback.extract_stack(frame) if frame else []
        ours = [f for f in stack if f"{os.sep}bulkgen{os.sep}" in f.filename][-3:]  # bulkgen's innermost frames
        where = " <- ".join(f"{os.path.basename(f.filename)}:{f.lineno} {f.name}" for f in reversed(ours)) or "?"
        if stack and (not ours or stack[-1] is not ours[-1]):
            where += f", inside {os.path.basename(stack[-1].filename)}:{stack[-1].lineno} {stack[-1].name}"
        log.error("error: %s; the worker did not stop within %.0fs (at %s): ending it; its leases expire",
                  self.stalled, self.grace_s, where)
        logging.shutdown()
        os._exit(1)
