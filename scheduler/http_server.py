"""Health, metrics and the page over HTTP. Off unless http_port is set.

Observes the daemon; never steers it. Whatever clients do, the endpoint holds
a bounded number of threads and file descriptors, so the lock session and the
ledger never run short of them: at most `MAX_CONNECTIONS` connections are
served at once (fewer under a low RLIMIT_NOFILE), each on its own thread; one
beyond that is answered 503 by the accepting thread and closed at once; and a
request must arrive whole within `REQUEST_TIMEOUT` seconds, however slowly it
trickles in, or its connection is dropped; a POST body is read under the same
deadline and refused beyond `MAX_BODY` bytes. One request per connection
(HTTP/1.0), so an idle keep-alive client holds nothing.

A route is an exact path, or a prefix ending in `/*` (`/jobs/*`) that
answers every path under it; the page's routes are in `scheduler.web`.
"""

from __future__ import annotations

import contextlib
import errno
import io
import logging
import resource
import socket
import socketserver
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler

from prometheus_client import CONTENT_TYPE_LATEST

from scheduler.errors import ConfigError

log = logging.getLogger("scheduler.http")

MAX_CONNECTIONS = 32
REQUEST_TIMEOUT = 5.0
MAX_BODY = 16 * 1024  # bytes of a POST body: the page's forms send a few dozen
# The share of the process's descriptor limit the endpoint may use at most.
FD_SHARE = 16

BUSY = (
    b"HTTP/1.0 503 Service Unavailable\r\n"
    b"Content-Type: text/plain; charset=utf-8\r\n"
    b"Content-Length: 5\r\n"
    b"Retry-After: 1\r\n"
    b"Connection: close\r\n"
    b"\r\n"
    b"busy\n"
)


@dataclass(frozen=True)
class Request:
    method: str
    path: str
    query: str
    headers: Mapping[str, str] = field(default_factory=dict)  # names in lower case
    body: bytes = b""
    client: str = ""  # the peer's address


@dataclass(frozen=True)
class Reply:
    status: int
    body: bytes
    content_type: str = "text/plain; charset=utf-8"
    headers: tuple[tuple[str, str], ...] = ()


Route = Callable[[Request], Reply]


class HealthServer:
    """`live()`: the scheduler loop runs. `ready()`: jobs loaded, lock session up.

    `routes` maps (method, path) to the function that answers it; more pages
    are more entries.
    """

    def __init__(
        self,
        host: str,
        port: int,
        *,
        live: Callable[[], bool],
        ready: Callable[[], bool],
        metrics: Callable[[], bytes],
        max_connections: int = MAX_CONNECTIONS,
        request_timeout: float = REQUEST_TIMEOUT,
    ) -> None:
        self.routes: dict[tuple[str, str], Route] = {
            ("GET", "/healthz"): lambda _: _check(live()),
            ("GET", "/readyz"): lambda _: _check(ready()),
            ("GET", "/metrics"): lambda _: Reply(200, metrics(), CONTENT_TYPE_LATEST),
        }
        self.server = _Server(
            _address(host, port),
            _handler(self.routes, request_timeout),
            connection_cap(max_connections, _descriptor_limit()),
            host=host,
            port=port,
        )
        self.port: int = self.server.server_address[1]
        self._thread = threading.Thread(target=self.server.serve_forever, name="http", daemon=True)

    def start(self) -> None:
        self._thread.start()
        page = "the page (/), " if ("GET", "/") in self.routes else ""
        log.info("serving %s/healthz, /readyz and /metrics on port %d", page, self.port)

    def stop(self) -> None:
        if self._thread.is_alive():
            self.server.shutdown()
        self.server.server_close()


def find_route(routes: Mapping[tuple[str, str], Route], method: str, path: str) -> Route | None:
    """The exact path's route, else the longest `/prefix/*` route the path is under."""
    exact = routes.get((method, path))
    if exact is not None:
        return exact
    under = [
        (len(pattern), route)
        for (m, pattern), route in routes.items()
        if m == method and pattern.endswith("/*") and path.startswith(pattern[:-1])
    ]
    return max(under, key=lambda found: found[0])[1] if under else None


def _allowed(routes: Mapping[tuple[str, str], Route], path: str) -> list[str]:
    return sorted({m for m in ("GET", "POST") if find_route(routes, m, path) is not None})


def _check(ok: bool) -> Reply:
    return Reply(200, b"ok\n") if ok else Reply(503, b"unavailable\n")


def connection_cap(requested: int, descriptor_limit: int | None) -> int:
    """At most `requested` connections, and never more than a small share of the fd limit."""
    if descriptor_limit is None:
        return max(1, requested)
    return max(1, min(requested, descriptor_limit // FD_SHARE))


def _descriptor_limit() -> int | None:
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    return None if soft == resource.RLIM_INFINITY else soft


def _address(host: str, port: int) -> tuple[socket.AddressFamily, tuple[object, ...]]:
    """Where to listen: IPv4 when the host has an IPv4 address (as before), else IPv6."""
    try:
        found = socket.getaddrinfo(
            host or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
        )
    except socket.gaierror as exc:
        raise ConfigError(f"http_host {host!r}: cannot be resolved ({exc.strerror})") from None
    except (OverflowError, UnicodeError) as exc:
        raise ConfigError(f"http_host {host!r}: not a host name ({exc})") from None
    found.sort(key=lambda info: info[0] != socket.AF_INET)
    family, _, _, _, address = found[0]
    return family, address


def _bind_error(exc: OSError, host: str, port: int) -> ConfigError:
    where = f"http_port {port} on {host}"
    if exc.errno == errno.EADDRINUSE:
        return ConfigError(f"{where}: already in use (another process is listening there)")
    if exc.errno == errno.EACCES and port < 1024:
        return ConfigError(f"{where}: permission denied (ports below 1024 need privileges)")
    if exc.errno == errno.EADDRNOTAVAIL:
        return ConfigError(f"http_host {host!r}: not an address of this host")
    return ConfigError(f"{where}: cannot listen ({exc.strerror or exc})")


class _Server(socketserver.TCPServer):
    """A thread per connection up to the cap; beyond it, 503 from the accepting thread."""

    allow_reuse_address = True
    request_queue_size = 128

    def __init__(
        self,
        address: tuple[socket.AddressFamily, tuple[object, ...]],
        handler: type[BaseHTTPRequestHandler],
        cap: int,
        *,
        host: str,
        port: int,
    ) -> None:
        self.address_family, bind_to = address
        self.slots = threading.BoundedSemaphore(cap)
        super().__init__(bind_to, handler, bind_and_activate=False)
        try:
            self.server_bind()
            self.server_activate()
        except OSError as exc:
            self.server_close()
            raise _bind_error(exc, host, port) from None

    def process_request(self, request: socket.socket, client_address: object) -> None:  # type: ignore[override]
        if not self.slots.acquire(blocking=False):
            _refuse(request)
            return
        try:
            threading.Thread(
                target=self._serve, args=(request, client_address), name="http-request", daemon=True
            ).start()
        except RuntimeError:  # no thread to be had: refuse rather than fail
            self.slots.release()
            _refuse(request)

    def _serve(self, request: socket.socket, client_address: object) -> None:
        try:
            self.finish_request(request, client_address)
        except Exception:
            self.handle_error(request, client_address)
        finally:
            self.shutdown_request(request)
            self.slots.release()

    def handle_error(self, request: object, client_address: object) -> None:
        log.debug("HTTP request from %s failed", client_address, exc_info=True)


def _refuse(sock: socket.socket) -> None:
    """503 and close, never waiting on the client: a new socket's send buffer is empty."""
    try:
        sock.setblocking(False)
        sock.send(BUSY)
        # Whatever already arrived is read, so closing sends FIN, not a reset that could
        # destroy the answer before the client reads it.
        with contextlib.suppress(OSError):
            sock.recv(65536)
        sock.shutdown(socket.SHUT_WR)
    except OSError:
        pass
    finally:
        sock.close()


class _DeadlineReader(io.RawIOBase):
    """A socket's input under one deadline for the whole request, however slowly it arrives."""

    def __init__(self, sock: socket.socket, deadline: float, clock: Callable[[], float]) -> None:
        self.sock = sock
        self.deadline = deadline
        self.clock = clock

    def readable(self) -> bool:
        return True

    def readinto(self, buffer: memoryview) -> int:  # type: ignore[override]
        left = self.deadline - self.clock()
        if left <= 0:
            raise TimeoutError("the request did not arrive in time")
        self.sock.settimeout(left)
        return self.sock.recv_into(buffer)


def _handler(
    routes: dict[tuple[str, str], Route],
    timeout: float,
    clock: Callable[[], float] = time.monotonic,
) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        server_version = "scheduler"
        sys_version = ""

        def setup(self) -> None:
            self.timeout = timeout
            super().setup()
            self.rfile.close()
            deadline = clock() + timeout
            self.rfile = io.BufferedReader(_DeadlineReader(self.connection, deadline, clock))

        def do_GET(self) -> None:
            self._dispatch("GET")

        def do_POST(self) -> None:
            self._dispatch("POST")

        def _dispatch(self, method: str) -> None:
            path, _, query = self.path.partition("?")
            route = find_route(routes, method, path)
            if route is None:
                allowed = _allowed(routes, path)
                if allowed:
                    self._send(Reply(405, b"method not allowed\n"), {"Allow": ", ".join(allowed)})
                else:
                    self._send(Reply(404, b"not found\n"))
                return
            body = self._body() if method == "POST" else b""
            if body is None:
                return
            headers = {name.lower(): value for name, value in self.headers.items()}
            try:
                reply = route(Request(method, path, query, headers, body, self.client_address[0]))
            except Exception:
                log.exception("%s %s failed", method, path)
                reply = Reply(500, b"internal error\n")
            self._send(reply)

        def _body(self) -> bytes | None:
            """The POST body, read under the request's deadline; None once refused."""
            length = self.headers.get("Content-Length", "0").strip()
            if not length.isdigit():
                self._send(Reply(411, b"a Content-Length is needed\n"))
                return None
            if int(length) > MAX_BODY:
                self._send(Reply(413, f"at most {MAX_BODY} bytes\n".encode()))
                return None
            body = self.rfile.read(int(length))
            if len(body) < int(length):
                return None  # the client went away mid-body
            return body

        def _send(self, reply: Reply, headers: dict[str, str] | None = None) -> None:
            self.connection.settimeout(timeout)  # the reply gets a timeout of its own
            self.send_response(reply.status)
            self.send_header("Content-Type", reply.content_type)
            self.send_header("Content-Length", str(len(reply.body)))
            for name, value in (headers or {}).items():
                self.send_header(name, value)
            for name, value in reply.headers:
                self.send_header(name, value)
            self.end_headers()
            self.wfile.write(reply.body)

        def log_message(self, *args: object) -> None:
            pass  # probes every few seconds, and dropped slow clients, are not news

    return Handler
