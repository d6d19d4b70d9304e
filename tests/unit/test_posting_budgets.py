"""A POST's reply has a budget in bytes and in time; redirects are not followed; a URL's
user and password are sent as Basic auth (docs/operating.md: Network budgets)."""

from __future__ import annotations

import base64
import socket
import time
import tracemalloc
from collections.abc import Callable, Iterator

import pytest

from scheduler.observers.posting import post
from tests.support import RawReceiver

SHORT = 1.5  # seconds: an attempt's deadline in these tests (the budget's is 5 s)
CHUNK = b"10000\r\n" + b"x" * 65536 + b"\r\n"  # one chunk of a chunked body
OFFERED_AT_MOST = 256 * 1024 * 1024  # what a hostile receiver offers before it gives up

Answer = Callable[[RawReceiver, socket.socket, bytes], None]


@pytest.fixture
def serve() -> Iterator[Callable[[Answer], RawReceiver]]:
    receivers: list[RawReceiver] = []

    def make(answer: Answer) -> RawReceiver:
        receivers.append(RawReceiver(answer))
        return receivers[-1]

    yield make
    for receiver in receivers:
        receiver.close()


def endless(receiver: RawReceiver, conn: socket.socket, _: bytes) -> None:
    receiver.send(conn, b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n")
    while receiver.sent < OFFERED_AT_MOST:
        receiver.send(conn, CHUNK)


def drip(receiver: RawReceiver, conn: socket.socket, _: bytes) -> None:
    """Each read is answered quickly; the whole reply takes 40 s."""
    for byte in b"HTTP/1.1 200 OK\r\n" + b"X-Slow: " + b"y" * 120:
        receiver.send(conn, bytes([byte]))
        time.sleep(0.3)


def test_an_endless_reply_body_is_read_only_up_to_the_budget(serve):
    receiver = serve(endless)
    post("http://127.0.0.1:1/warm-up", b"{}", 1)  # the client's modules, imported once
    tracemalloc.start()
    try:
        reason = post(receiver.url(), b"{}", SHORT)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 1024 * 1024, f"{peak} bytes held while reading an endless reply"
    assert reason is None  # the status answers; the rest of the body is left unread


def test_a_reply_dripping_a_byte_at_a_time_fails_at_the_attempts_deadline(serve):
    receiver = serve(drip)
    started = time.monotonic()
    reason = post(receiver.url(), b"{}", SHORT)
    took = time.monotonic() - started
    assert reason is not None and "1.5 s" in reason, reason
    assert took < SHORT + 3, f"the attempt took {took:.1f} s"


def test_reply_headers_beyond_the_budget_fail_the_attempt(serve):
    def big_headers(receiver: RawReceiver, conn: socket.socket, _: bytes) -> None:
        header = b"X-Big: " + b"h" * 2000 + b"\r\n"
        receiver.send(conn, b"HTTP/1.1 200 OK\r\n" + header * 60 + b"Content-Length: 0\r\n\r\n")

    reason = post(serve(big_headers).url(), b"{}", SHORT)
    assert reason is not None and "bytes" in reason, reason


def test_a_redirect_is_a_failed_attempt_and_is_not_followed(serve):
    elsewhere = serve(lambda r, conn, _: r.send(conn, b"HTTP/1.0 200 OK\r\n\r\n"))

    def redirect(receiver: RawReceiver, conn: socket.socket, _: bytes) -> None:
        location = elsewhere.url("/taken").encode()
        receiver.send(conn, b"HTTP/1.1 303 See Other\r\nLocation: " + location + b"\r\n\r\n")

    assert post(serve(redirect).url(), b"{}", SHORT) == "HTTP 303"
    time.sleep(0.2)
    assert elsewhere.requests == []


def test_a_user_and_password_in_the_url_are_sent_as_basic_auth(serve):
    receiver = serve(lambda r, conn, _: r.send(conn, b"HTTP/1.0 204 No Content\r\n\r\n"))
    reason = post(receiver.url(userinfo="ops%40team:p%3Ass@"), b'{"a": 1}', SHORT)
    assert reason is None, reason
    ((_, request),) = receiver.requests
    expected = base64.b64encode(b"ops@team:p:ss")
    assert b"Authorization: Basic " + expected + b"\r\n" in request
    assert b"team" not in request.split(b"\r\n")[0]  # nor in the request line
