"""Health, metrics and the page over HTTP. Off unless http_port is set.

Observes the daemon; never steers it. Whatever clients send, the endpoint
holds bounded memory, threads and file descriptors, and the probes answer:

- One thread runs an asyncio loop that does all of the endpoint's network
  I/O. It reads each request under the budgets of `scheduler.config.budgets`
  before anything parses it (`read_request`): the head within
  `REQUEST_HEAD_BYTES` and `REQUEST_HEAD_LINES`, a POST body within
  `REQUEST_BODY_BYTES`, all of it within `REQUEST_TIMEOUT` however slowly it
  trickles in (else the connection is dropped unanswered); each reply is
  given `REPLY_TIMEOUT` to be taken. A client that sends nothing holds a
  socket, never a thread.
- The probes (`PROBES`: /healthz, /readyz, /metrics) are answered on that
  loop at once. The page and the API run on a pool of `ROUTE_WORKERS`
  threads; a request that finds them all busy is answered 503 at once.
- At most `OPEN_CONNECTIONS` connections are held (fewer under a low
  RLIMIT_NOFILE); a new one beyond that closes the oldest that is not being
  answered, so idle or slow clients never keep a probe out.

One request per connection (HTTP/1.0). A route is an exact path, or a
prefix ending in `/*` (`/jobs/*`) that answers every path under it; the
page's routes are in `scheduler.web`. A client of the API (a path under
`/api/`, or a POST with a bearer token) is answered its errors as JSON
(`answered_as`), whichever route made them; a request refused before it is
read whole (malformed, too large) is answered one line of text.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import json
import logging
import re
import resource
import socket
import threading
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from http import HTTPStatus

from prometheus_client import CONTENT_TYPE_LATEST

from scheduler.config.budgets import (
    FD_SHARE,
    LINGER_BYTES,
    LINGER_TIMEOUT,
    OPEN_CONNECTIONS,
    PROBES,
    REPLY_TIMEOUT,
    REQUEST_BODY_BYTES,
    REQUEST_HEAD_BYTES,
    REQUEST_HEAD_LINES,
    REQUEST_TIMEOUT,
    ROUTE_WORKERS,
)
from scheduler.errors import ConfigError

log = logging.getLogger("scheduler.http")

MAX_BODY = REQUEST_BODY_BYTES  # the name the page's tests know it by
JSON = "application/json"
API = "/api/"
_TOKEN = re.compile(r"[!#$%&'*+.^_`|~0-9A-Za-z-]+")  # a method or a header's name (RFC 9110)
_VERSION = re.compile(r"HTTP/1\.[0-9]")


@dataclass(frozen=True)
class Request:
    method: str
    path: str
    query: str
    headers: Mapping[str, str] = field(default_factory=dict)  # names in lower case
    body: bytes = b""
    client: str = ""  # the peer's address
    root: str = ""  # the prefix the page is mounted under in a host's app ("" on its own port)


@dataclass(frozen=True)
class Reply:
    status: int
    body: bytes
    content_type: str = "text/plain; charset=utf-8"
    headers: tuple[tuple[str, str], ...] = ()


Route = Callable[[Request], Reply]

BUSY = Reply(503, b"busy\n", headers=(("Retry-After", "1"),))


class Refused(Exception):
    """A request answered with a 4xx before any route sees it."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.reply = Reply(status, message.encode() + b"\n")


class Gone(Exception):
    """The client closed its end before its request was whole."""


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
        workers: int = ROUTE_WORKERS,
        request_timeout: float = REQUEST_TIMEOUT,
    ) -> None:
        self.routes: dict[tuple[str, str], Route] = {
            ("GET", "/healthz"): lambda _: _check(live()),
            ("GET", "/readyz"): lambda _: _check(ready()),
            ("GET", "/metrics"): lambda _: Reply(200, metrics(), CONTENT_TYPE_LATEST),
        }
        self.request_timeout = request_timeout
        self.cap = connection_cap(OPEN_CONNECTIONS, _descriptor_limit())
        self.workers = max(1, min(workers, self.cap // 2))  # so a connection can always be freed
        self.listener = _listen(host, port)
        self.port: int = self.listener.getsockname()[1]
        self._pool = ThreadPoolExecutor(self.workers, thread_name_prefix="http-route")
        self._busy = 0  # route workers in use; like everything below, touched by the loop only
        self._open: dict[asyncio.StreamWriter, bool] = {}  # oldest first: True if evictable
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._run, name="http", daemon=True)

    def start(self) -> None:
        self._thread.start()
        page = "the page (/), " if ("GET", "/") in self.routes else ""
        log.info("serving %s/healthz, /readyz and /metrics on port %d", page, self.port)

    def stop(self) -> None:
        if self._thread.is_alive():
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(10)
        else:
            self.listener.close()
            self._loop.close()
        self._pool.shutdown(wait=False, cancel_futures=True)

    # -- the loop's thread --------------------------------------------------------------

    def _run(self) -> None:
        loop = self._loop
        asyncio.set_event_loop(loop)
        try:
            server = loop.run_until_complete(
                asyncio.start_server(
                    self._connection, sock=self.listener, limit=REQUEST_HEAD_BYTES, backlog=128
                )
            )
            loop.run_forever()
            server.close()
            tasks = asyncio.all_tasks(loop)
            for task in tasks:
                task.cancel()
            loop.run_until_complete(asyncio.gather(*tasks, return_exceptions=True))
        finally:
            loop.close()

    async def _connection(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if len(self._open) >= self.cap and not self._evict_one():
            writer.transport.abort()
            return
        self._open[writer] = True
        try:
            await self._exchange(reader, writer)
        except (OSError, Gone, TimeoutError, asyncio.IncompleteReadError):
            pass  # a client that went away, or was too slow: dropped, not news
        except Exception:
            log.debug("HTTP connection failed", exc_info=True)
        finally:
            self._open.pop(writer, None)
            if not writer.transport.is_closing():
                writer.transport.abort()  # dropped, evicted or timed out: nothing more is sent

    def _evict_one(self) -> bool:
        """Close the oldest connection not being answered by a route (a slow or idle one)."""
        oldest = next((w for w, evictable in self._open.items() if evictable), None)
        if oldest is None:
            return False
        del self._open[oldest]
        oldest.transport.abort()
        return True

    async def _exchange(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            peer = writer.get_extra_info("peername")
            client = str(peer[0]) if isinstance(peer, tuple) and peer else ""
            async with asyncio.timeout(self.request_timeout):
                request, route = await read_request(reader, self.routes, client)
        except Refused as refused:
            await _write(writer, refused.reply)
            await _linger(reader, writer)
            writer.close()
            return
        if route is None:
            reply = _not_routed(self.routes, request)
        elif request.path in PROBES:
            reply = _answer(route, request)
        elif self._busy >= self.workers:
            reply = BUSY
        else:
            reply = await self._on_worker(writer, route, request)
        await _write(writer, answered_as(request, reply))
        writer.close()

    async def _on_worker(
        self, writer: asyncio.StreamWriter, route: Route, request: Request
    ) -> Reply:
        self._busy += 1
        if writer in self._open:
            self._open[writer] = False
        try:
            return await self._loop.run_in_executor(self._pool, _answer, route, request)
        finally:
            self._busy -= 1
            if writer in self._open:
                self._open[writer] = True


# -- reading a request: the one guarded reader of the endpoint's input ------------------


async def read_request(
    reader: asyncio.StreamReader, routes: Mapping[tuple[str, str], Route], client: str = ""
) -> tuple[Request, Route | None]:
    """The request within the budgets, and its route (the body is read only for a route)."""
    lines = await _read_head(reader)
    method, target = _request_line(lines[0])
    headers = _headers(lines[1:])
    path, _, query = target.partition("?")
    route = find_route(routes, method, path)
    body = b""
    if route is not None and method == "POST":
        length = _content_length(headers)
        body = await reader.readexactly(length)
    return Request(method, path, query, headers, body, client), route


async def _read_head(reader: asyncio.StreamReader) -> list[bytes]:
    """The request line and header lines, never more than the head's budgets."""
    lines: list[bytes] = []
    size = 0
    while True:
        try:
            line = await reader.readline()
        except ValueError:  # one line beyond the whole head's budget
            raise _too_large() from None
        if not line.endswith(b"\n"):
            raise Gone()
        size += len(line)
        if size > REQUEST_HEAD_BYTES or len(lines) >= REQUEST_HEAD_LINES:
            raise _too_large()
        line = line.rstrip(b"\r\n")
        if line:
            lines.append(line)
        elif lines:
            return lines


def _too_large() -> Refused:
    return Refused(
        431,
        f"request head too large: at most {REQUEST_HEAD_BYTES} bytes"
        f" and {REQUEST_HEAD_LINES} lines",
    )


def _request_line(line: bytes) -> tuple[str, str]:
    parts = line.decode("latin-1").split(" ")
    if len(parts) != 3 or not _TOKEN.fullmatch(parts[0]) or not _VERSION.fullmatch(parts[2]):
        raise Refused(400, "malformed request line")
    method, target, _ = parts
    if not target.startswith("/"):
        raise Refused(400, "the request's target must be a path")
    if method not in ("GET", "POST"):
        raise Refused(501, "only GET and POST are served")
    return method, target


def _headers(lines: list[bytes]) -> dict[str, str]:
    """Names in lower case; the last of repeated names wins, except Content-Length."""
    headers: dict[str, str] = {}
    for raw in lines:
        line = raw.decode("latin-1")
        name, colon, value = line.partition(":")
        if not colon or not _TOKEN.fullmatch(name):
            raise Refused(400, "malformed header line")
        name, value = name.lower(), value.strip(" \t")
        if name == "content-length" and headers.get(name, value) != value:
            raise Refused(400, "conflicting Content-Length headers")
        headers[name] = value
    return headers


def _content_length(headers: Mapping[str, str]) -> int:
    if "transfer-encoding" in headers:
        raise Refused(411, "a Content-Length is needed")
    value = headers.get("content-length", "0")
    if not (value.isascii() and value.isdigit()):
        raise Refused(400, "Content-Length must be a number of bytes")
    digits = value.lstrip("0") or "0"  # never int() of thousands of digits
    if len(digits) > len(str(REQUEST_BODY_BYTES)) or int(digits) > REQUEST_BODY_BYTES:
        raise Refused(413, f"at most {REQUEST_BODY_BYTES} bytes")
    return int(digits)


# -- answering --------------------------------------------------------------------------


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


def speaks_json(request: Request) -> bool:
    """A client of the API: a path under /api/, or a POST with a bearer token (a script)."""
    if request.path.startswith(API):
        return True
    scheme = request.headers.get("authorization", "").partition(" ")[0]
    return request.method == "POST" and scheme.lower() == "bearer"


def answered_as(request: Request, reply: Reply) -> Reply:
    """The reply, its error as `{"error": "<the line>"}` for a client of the API."""
    if reply.status < 400 or not speaks_json(request):
        return reply
    if not reply.content_type.startswith("text/plain"):
        return reply  # JSON already
    line = reply.body.decode("utf-8", "replace").strip()
    return Reply(reply.status, json.dumps({"error": line}).encode(), JSON, reply.headers)


def _not_routed(routes: Mapping[tuple[str, str], Route], request: Request) -> Reply:
    allowed = sorted({m for m in ("GET", "POST") if find_route(routes, m, request.path)})
    if allowed:
        return Reply(405, b"method not allowed\n", headers=(("Allow", ", ".join(allowed)),))
    return Reply(404, b"not found\n")


def _answer(route: Route, request: Request) -> Reply:
    try:
        return route(request)
    except Exception:
        log.exception("%s %s failed", request.method, request.path)
        return Reply(500, b"internal error\n")


def _check(ok: bool) -> Reply:
    return Reply(200, b"ok\n") if ok else Reply(503, b"unavailable\n")


def encode(reply: Reply) -> bytes:
    """The reply's bytes; a header that cannot be sent as it is makes it a 500."""
    try:
        phrase = HTTPStatus(reply.status).phrase
    except ValueError:
        phrase = ""
    head = [
        f"HTTP/1.0 {reply.status} {phrase}",
        "Server: scheduler",
        f"Content-Type: {reply.content_type}",
        f"Content-Length: {len(reply.body)}",
        "Connection: close",
        *(f"{name}: {value}" for name, value in reply.headers),
    ]
    if any("\r" in line or "\n" in line for line in head):
        return _unsendable(reply, "a line break")
    text = "\r\n".join(head) + "\r\n\r\n"
    try:
        return text.encode("latin-1") + reply.body
    except UnicodeEncodeError:
        return _unsendable(reply, "a character outside latin-1")


def header_pairs(reply: Reply) -> list[tuple[str, str]]:
    """Every header of the reply, as a host's server sends them (`scheduler.web.hosted`)."""
    return [
        ("Server", "scheduler"),
        ("Content-Type", reply.content_type),
        ("Content-Length", str(len(reply.body))),
        *reply.headers,
    ]


def sendable(reply: Reply) -> Reply:
    """The reply, or a 500 if one of its headers cannot be sent as it is (as `encode` does)."""
    for name, value in header_pairs(reply):
        line = f"{name}: {value}"
        if "\r" in line or "\n" in line:
            encode(reply)  # logs what was wrong
            return Reply(500, b"internal error\n")
        try:
            line.encode("latin-1")
        except UnicodeEncodeError:
            encode(reply)
            return Reply(500, b"internal error\n")
    return reply


def _unsendable(reply: Reply, what: str) -> bytes:
    names = ", ".join(name for name, _ in reply.headers)
    log.error("a %d reply's headers (%s) hold %s: answered 500 instead", reply.status, names, what)
    return encode(Reply(500, b"internal error\n"))


async def _write(writer: asyncio.StreamWriter, reply: Reply) -> None:
    """The whole reply handed to the kernel within its timeout (or the connection dropped)."""
    writer.transport.set_write_buffer_limits(high=0)  # drain() waits for every byte
    writer.write(encode(reply))
    async with asyncio.timeout(REPLY_TIMEOUT):
        await writer.drain()


async def _linger(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    """After refusing a request not read whole: say we are done, and read a little of what
    the client is still sending, so the refusal reaches it rather than a reset."""
    if not writer.can_write_eof():
        return
    writer.write_eof()
    with contextlib.suppress(TimeoutError, OSError):
        async with asyncio.timeout(LINGER_TIMEOUT):
            dropped = 0
            while dropped < LINGER_BYTES and (data := await reader.read(LINGER_BYTES)):
                dropped += len(data)


# -- listening ----------------------------------------------------------------------------


def connection_cap(requested: int, descriptor_limit: int | None) -> int:
    """At most `requested` connections, and never more than a small share of the fd limit."""
    if descriptor_limit is None:
        return max(2, requested)
    return max(2, min(requested, descriptor_limit // FD_SHARE))


def _descriptor_limit() -> int | None:
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    return None if soft == resource.RLIM_INFINITY else soft


def _listen(host: str, port: int) -> socket.socket:
    family, address = _address(host, port)
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(address)
        sock.listen(128)
    except OSError as exc:
        sock.close()
        raise _bind_error(exc, host, port) from None
    return sock


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
