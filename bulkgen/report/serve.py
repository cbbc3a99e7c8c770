"""`bulkgen report --serve`: the report page served from the database, its figures read again on each load
(at most once a second), so a page open in a browser follows the workers as they run. Bound to 127.0.0.1
unless asked otherwise; read-only."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import urlparse

from bulkgen.errors import BulkgenError
from bulkgen.report.figures import build_report, current_jobs
from bulkgen.report.page import render
from bulkgen.store.db import Store


class ReportServer:
    def __init__(self, store: Store, job_ids: list[int], host: str = "127.0.0.1", port: int = 8765,
                 refresh_s: float = 5.0, num_examples: int = 5) -> None:
        self.store, self.job_ids, self.refresh_s, self.num_examples = store, job_ids, refresh_s, num_examples
        self._lock = threading.Lock()
        self._cached: tuple[float, dict[str, Any]] | None = None
        self.httpd = ThreadingHTTPServer((host, port), _handler(self))

    @property
    def url(self) -> str:
        host, port = self.httpd.server_address[:2]
        return f"http://{host}:{port}/"

    def report(self) -> dict[str, Any]:
        with self._lock:
            if self._cached is None or time.monotonic() - self._cached[0] >= 1.0:
                job_ids = self.job_ids or current_jobs(self.store)  # none named: whatever runs now
                self._cached = (time.monotonic(), build_report(self.store, job_ids, self.num_examples))
            return self._cached[1]

    def serve_forever(self) -> None:
        try:
            self.httpd.serve_forever()
        finally:
            self.httpd.server_close()


def _handler(server: ReportServer) -> type[BaseHTTPRequestHandler]:
    pages: dict[str, tuple[str, Callable[[], str]]] = {
        "/": ("text/html; charset=utf-8", lambda: render(server.report(), refresh_s=server.refresh_s)),
        "/report.json": ("application/json", lambda: json.dumps(server.report(), indent=1, default=str)),
    }

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 (http.server's name)
            path = urlparse(self.path).path
            path = "/" if path == "/index.html" else path
            if path not in pages:
                self._send(404, "text/plain", f"no page {path}: the report is at / and its figures at /report.json")
                return
            content_type, make = pages[path]
            try:
                body = make()
            except BulkgenError as exc:  # the database away, a job deleted: say so, keep serving
                self._send(503, "text/plain", f"the report cannot be read now: {exc}")
                return
            self._send(200, content_type, body)

        def _send(self, code: int, content_type: str, body: str) -> None:
            data = body.encode()
            self.send_response(code)
            self.send_header("Content-Type", content_type)
            self.send_header("Content-Length", str(len(data)))
            self.send_header("Cache-Control", "no-store")
            self.end_headers()
            self.wfile.write(data)

        def log_message(self, format: str, *args: Any) -> None:  # quiet: one line per load would drown the terminal
            pass

    return Handler
