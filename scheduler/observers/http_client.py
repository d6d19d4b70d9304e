"""The one HTTP client: a POST whose reply is read under a budget in bytes and in time.

Imported on the first POST (`scheduler.observers.posting`): most replicas never send one.

- One deadline for the whole attempt (connecting, the TLS handshake, sending,
  and every read of the reply): a receiver that drips a byte at a time meets
  it like one that never answers. Only the DNS lookup is bounded by the
  system's resolver instead.
- At most `REPLY_BYTES` of the reply are read: its status answers, and the
  rest of a long or endless body is left unread.
- Redirects are not followed: a 3xx is a failed attempt (a 303 would turn
  the POST into a GET to wherever it points).
- A URL's `user:password@` is sent as HTTP Basic auth; proxies named in the
  environment (`https_proxy`, `no_proxy`) are used, as urllib does.
"""

from __future__ import annotations

import base64
import functools
import http.client
import io
import socket
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from typing import Any
from urllib.parse import unquote, urlsplit

from scheduler.config.budgets import REPLY_BYTES

Clock = Callable[[], float]


class OverBudget(Exception):
    """More of a reply than the budget allows."""


def post(
    url: str,
    body: bytes,
    deadline_s: float,
    content_type: str | None = None,
    clock: Clock = time.monotonic,
) -> str | None:
    """None when the receiver answered 2xx in time, else why not (never with the URL)."""
    deadline = clock() + deadline_s
    try:
        target, headers = _target(url)
        if content_type:
            headers["Content-Type"] = content_type
        request = urllib.request.Request(target, data=body, headers=headers, method="POST")
        with _opener(deadline, clock).open(request, timeout=deadline_s) as response:
            _read_body(response)
    except urllib.error.HTTPError as exc:
        exc.close()
        return f"HTTP {exc.code}"
    except urllib.error.URLError as exc:
        return _reason(exc.reason, deadline_s) if not isinstance(exc.reason, str) else "unreachable"
    except Exception as exc:
        return _reason(exc, deadline_s)
    return None


def _reason(exc: object, deadline_s: float) -> str:
    if isinstance(exc, TimeoutError):
        return f"no whole answer within {deadline_s:g} s"
    if isinstance(exc, OverBudget):
        return f"a reply's head over {REPLY_BYTES} bytes"
    # A bad URL (ValueError), a broken answer (http.client.HTTPException), a refused connection.
    return type(exc).__name__


def _target(url: str) -> tuple[str, dict[str, str]]:
    """The URL without its user and password, and the headers that carry them instead."""
    parts = urlsplit(url)
    if parts.scheme.lower() not in ("http", "https"):
        raise ValueError("not an http(s) URL")
    headers = {"User-Agent": "scheduler"}
    userinfo, at, host = parts.netloc.rpartition("@")
    if at:
        user, _, password = userinfo.partition(":")
        token = base64.b64encode(f"{unquote(user)}:{unquote(password)}".encode()).decode()
        headers["Authorization"] = f"Basic {token}"
        url = parts._replace(netloc=host).geturl()
    return url, headers


def _read_body(response: http.client.HTTPResponse) -> None:
    """Read the body within the budget; a body cut short of its length is a failed attempt."""
    try:
        while response.read(4096):
            pass
    except OverBudget:
        return  # the status has answered; the rest is not read
    if response.length:
        raise http.client.IncompleteRead(b"", response.length)


def _opener(deadline: float, clock: Clock) -> urllib.request.OpenerDirector:
    """urllib's, with connections under the deadline and the budget, and no redirects."""
    connect = functools.partial(_connection, deadline=deadline, clock=clock)
    return urllib.request.build_opener(_Plain(connect), _Secure(connect), _NoRedirects)


class _Plain(urllib.request.HTTPHandler):
    def __init__(self, connect: Callable[..., http.client.HTTPConnection]) -> None:
        super().__init__()
        self.connect = connect

    def http_open(self, req: urllib.request.Request) -> http.client.HTTPResponse:
        return self.do_open(functools.partial(self.connect, http.client.HTTPConnection), req)


class _Secure(urllib.request.HTTPSHandler):
    def __init__(self, connect: Callable[..., http.client.HTTPConnection]) -> None:
        super().__init__()
        self.connect = connect

    def https_open(self, req: urllib.request.Request) -> http.client.HTTPResponse:
        kind = http.client.HTTPSConnection
        return self.do_open(functools.partial(self.connect, kind), req)  # the default context


class _NoRedirects(urllib.request.HTTPRedirectHandler):
    def redirect_request(self, *args: Any, **kwargs: Any) -> None:
        return None  # the 3xx goes on to be an HTTPError: a failed attempt


def _connection(
    kind: type[http.client.HTTPConnection],
    host: str,
    *,
    deadline: float,
    clock: Clock,
    **kwargs: Any,
) -> http.client.HTTPConnection:
    connection = kind(host, **kwargs)
    # CPython's hook for opening the socket, which the stubs do not declare.
    connection._create_connection = functools.partial(  # type: ignore[attr-defined]
        _connect, deadline=deadline, clock=clock
    )
    reply = functools.partial(_Reply, deadline=deadline, clock=clock)
    # The stubs want a class; a partial that builds one is called the same way.
    connection.response_class = reply  # type: ignore[assignment]
    return connection


def _left(deadline: float, clock: Clock) -> float:
    left = deadline - clock()
    if left <= 0:
        raise TimeoutError("the attempt's deadline passed")
    return left


def _connect(
    address: tuple[str, int],
    timeout: object = None,
    source_address: object = None,
    *,
    deadline: float,
    clock: Clock,
) -> socket.socket:
    """Like socket.create_connection, but every address tried shares the one deadline."""
    host, port = address
    error: OSError | None = None
    for family, kind, proto, _, where in socket.getaddrinfo(host, port, type=socket.SOCK_STREAM):
        sock = socket.socket(family, kind, proto)
        try:
            sock.settimeout(_left(deadline, clock))
            sock.connect(where)
            # The TLS handshake and the request's send wait at most this long, all told.
            sock.settimeout(_left(deadline, clock))
            return sock
        except OSError as exc:
            sock.close()
            error = exc
    raise error or OSError("the host has no address")


class _Reply(http.client.HTTPResponse):
    """http.client's reply, reading its socket under the attempt's deadline and the budget."""

    def __init__(
        self, sock: socket.socket, *args: Any, deadline: float, clock: Clock, **kwargs: Any
    ) -> None:
        super().__init__(sock, *args, **kwargs)
        raw = self.fp.detach()  # the socket's file: it keeps the socket open while read
        self.fp = io.BufferedReader(BudgetedReader(raw, sock, deadline, clock, REPLY_BYTES))


class BudgetedReader(io.RawIOBase):
    """A socket's input: at most `limit` bytes in all, and nothing after `deadline`."""

    def __init__(
        self, raw: io.RawIOBase, sock: socket.socket, deadline: float, clock: Clock, limit: int
    ) -> None:
        self.raw = raw
        self.sock = sock
        self.deadline = deadline
        self.clock = clock
        self.limit = limit
        self.left = limit

    def readable(self) -> bool:
        return True

    def readinto(self, buffer: Any) -> int:
        if self.left <= 0:
            raise OverBudget(f"more than the budget of {self.limit} bytes")
        self.sock.settimeout(_left(self.deadline, self.clock))
        count = self.raw.readinto(memoryview(buffer)[: self.left]) or 0
        self.left -= count
        return count

    def close(self) -> None:
        self.raw.close()
        super().close()
