"""Health and metrics over HTTP: /healthz, /readyz, /metrics. Off unless http_port is set.

Observes the daemon; never steers it.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from prometheus_client import CONTENT_TYPE_LATEST

log = logging.getLogger("scheduler.http")


class HealthServer:
    """`live()`: the scheduler loop runs. `ready()`: jobs loaded, lock session up."""

    def __init__(
        self,
        host: str,
        port: int,
        *,
        live: Callable[[], bool],
        ready: Callable[[], bool],
        metrics: Callable[[], bytes],
    ) -> None:
        checks = {"/healthz": live, "/readyz": ready}

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                path = self.path.split("?", 1)[0]
                if path == "/metrics":
                    self._send(200, metrics(), CONTENT_TYPE_LATEST)
                elif path in checks:
                    ok = checks[path]()
                    self._send(200 if ok else 503, b"ok\n" if ok else b"unavailable\n")
                else:
                    self._send(404, b"not found\n")

            def _send(self, code: int, body: bytes, kind: str = "text/plain") -> None:
                self.send_response(code)
                self.send_header("Content-Type", kind)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args: object) -> None:
                pass  # probes every few seconds are not news

        self.server = ThreadingHTTPServer((host, port), Handler)
        self.server.daemon_threads = True
        self.port = self.server.server_address[1]
        self._thread = threading.Thread(target=self.server.serve_forever, name="http", daemon=True)

    def start(self) -> None:
        self._thread.start()
        log.info("serving /healthz, /readyz and /metrics on port %d", self.port)

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()
