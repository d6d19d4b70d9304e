"""The HTTP endpoint under abuse: idle and slow clients, a busy port, a bad host."""

from __future__ import annotations

import os
import selectors
import socket
import threading
import time
from collections.abc import Iterator

import pytest

from scheduler.errors import ConfigError
from scheduler.http_server import MAX_CONNECTIONS, HealthServer
from tests.support import wait_for

REQUEST_TIMEOUT = 1.5  # the endpoint's is 5 s; the mechanism is the same, the test shorter


@pytest.fixture
def server() -> Iterator[HealthServer]:
    health = HealthServer(
        "127.0.0.1",
        0,
        live=lambda: True,
        ready=lambda: True,
        metrics=lambda: b"# EOF\n",
        request_timeout=REQUEST_TIMEOUT,
    )
    health.start()
    yield health
    health.stop()


def get(port: int, path: str) -> bytes:
    """The raw reply to one GET (b"" when the server drops the connection unanswered)."""
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
            sock.sendall(f"GET {path} HTTP/1.0\r\n\r\n".encode())
            return read_all(sock)
    except OSError:
        return b""


def healthy(port: int) -> bool:
    return get(port, "/healthz").startswith(b"HTTP/1.0 200")


def read_all(sock: socket.socket) -> bytes:
    chunks = []
    while chunk := sock.recv(65536):
        chunks.append(chunk)
    return b"".join(chunks)


def open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def test_idle_connections_are_capped_and_dropped(server):
    threads, fds = threading.active_count(), open_fds()
    started = time.monotonic()
    clients = [socket.create_connection(("127.0.0.1", server.port), timeout=10) for _ in range(400)]
    # A slot is freed no sooner than a timeout after its connection came in.
    rounds = 2 + int((time.monotonic() - started) // REQUEST_TIMEOUT)
    try:
        # Each connection is either refused at once (503) or dropped at the timeout,
        # unanswered; all 400 end well within a few timeouts.
        replies: dict[socket.socket, bytes] = {}
        selector = selectors.DefaultSelector()
        for client in clients:
            selector.register(client, selectors.EVENT_READ)
        deadline = time.monotonic() + 4 * REQUEST_TIMEOUT + 10
        most_threads, most_fds = 0, 0
        while len(replies) < len(clients) and time.monotonic() < deadline:
            most_threads = max(most_threads, threading.active_count() - threads)
            most_fds = max(most_fds, open_fds() - fds - len(clients))
            for key, _ in selector.select(timeout=0.2):
                replies[key.fileobj] = read_all(key.fileobj)
                selector.unregister(key.fileobj)
        selector.close()
        assert len(replies) == len(clients), f"{len(clients) - len(replies)} never ended"
        busy = [r for r in replies.values() if r.startswith(b"HTTP/1.0 503")]
        dropped = [r for r in replies.values() if r == b""]
        assert len(busy) + len(dropped) == len(clients)
        assert len(dropped) <= MAX_CONNECTIONS * rounds, (len(dropped), rounds)
        assert most_threads <= MAX_CONNECTIONS + 4, most_threads  # threads may overlap as they end
        assert most_fds <= MAX_CONNECTIONS + 4, most_fds  # also the selector and the listener
        wait_for(lambda: healthy(server.port), 10, "/healthz to answer 200")
    finally:
        for client in clients:
            client.close()


def test_a_request_must_arrive_whole_within_the_timeout(server):
    half = socket.create_connection(("127.0.0.1", server.port), timeout=30)
    trickle = socket.create_connection(("127.0.0.1", server.port), timeout=0.2)
    started = time.monotonic()
    try:
        half.sendall(b"GET /healthz HTTP/1.0\r\nHost: x")
        request = b"GET /healthz HTTP/1.0\r\n" + b"X-Slow: y\r\n" * 20 + b"\r\n"
        answer = None
        for byte in request:  # one byte every 0.2 s: 50 s for the whole request
            try:
                trickle.send(bytes([byte]))
                answer = trickle.recv(65536)
            except TimeoutError:
                continue
            except OSError:
                answer = b""
            break
        assert answer == b"", answer  # dropped before the request was whole
        assert half.recv(65536) == b""
        assert time.monotonic() - started < 2 * REQUEST_TIMEOUT + 10
    finally:
        half.close()
        trickle.close()
    assert healthy(server.port)


def test_routes_answer_and_unknown_paths_are_404(server):
    assert get(server.port, "/readyz").startswith(b"HTTP/1.0 200")
    assert get(server.port, "/metrics?x=1").endswith(b"# EOF\n")
    assert get(server.port, "/nope").startswith(b"HTTP/1.0 404")


def test_an_unresolvable_host_is_a_config_error():
    with pytest.raises(ConfigError, match=r"http_host 'no-such-host\.invalid'"):
        HealthServer(
            "no-such-host.invalid", 0, live=lambda: True, ready=lambda: True, metrics=bytes
        )
