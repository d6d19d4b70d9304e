"""The HTTP endpoint under abuse: idle and slow clients, floods of headers, busy routes, a busy
port, a bad host (docs/operating.md: Health and metrics, Network budgets)."""

from __future__ import annotations

import os
import selectors
import socket
import threading
import time
import tracemalloc
from collections.abc import Iterator

import pytest

from scheduler.config.budgets import OPEN_CONNECTIONS, ROUTE_WORKERS
from scheduler.errors import ConfigError
from scheduler.web.server import HealthServer, Reply
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


def send(port: int, raw: bytes, timeout: float = 10) -> bytes:
    """The raw reply to `raw` (b"" when the server closes the connection unanswered)."""
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=timeout) as sock:
            sock.sendall(raw)
            return read_all(sock)
    except OSError:
        return b""


def probe(port: int, path: str = "/healthz") -> tuple[bytes, float]:
    """One probe's status line and how long it took to be answered."""
    started = time.monotonic()
    reply = get(port, path)
    return reply.split(b"\r\n", 1)[0], time.monotonic() - started


def test_idle_connections_hold_no_thread_and_never_keep_a_probe_out(server):
    threads, fds = threading.active_count(), open_fds()
    clients = [socket.create_connection(("127.0.0.1", server.port), timeout=10) for _ in range(400)]
    try:
        # Each connection is closed unanswered: the oldest as newer ones come (beyond the
        # cap), the rest when their request has not arrived in time; all within a few timeouts.
        answered = [probe(server.port) for _ in range(5)]
        ended: dict[socket.socket, bytes] = {}
        selector = selectors.DefaultSelector()
        for client in clients:
            selector.register(client, selectors.EVENT_READ)
        deadline = time.monotonic() + 4 * REQUEST_TIMEOUT + 10
        most_threads, most_fds = 0, 0
        while len(ended) < len(clients) and time.monotonic() < deadline:
            most_threads = max(most_threads, threading.active_count() - threads)
            most_fds = max(most_fds, open_fds() - fds - len(clients))
            for key, _ in selector.select(timeout=0.2):
                ended[key.fileobj] = read_all(key.fileobj)
                selector.unregister(key.fileobj)
        selector.close()
        assert len(ended) == len(clients), f"{len(clients) - len(ended)} never ended"
        assert set(ended.values()) == {b""}
        assert most_threads <= 2, most_threads  # the loop's thread does all the reading
        assert most_fds <= OPEN_CONNECTIONS + 4, most_fds  # also the selector and the listener
        assert [line for line, _ in answered] == [b"HTTP/1.0 200 OK"] * 5, answered
    finally:
        for client in clients:
            client.close()


def test_probes_answer_at_once_while_100_slow_clients_hold_connections(server):
    slow = []
    for _ in range(100):
        client = socket.create_connection(("127.0.0.1", server.port), timeout=10)
        client.sendall(b"GET / HTTP/1.0\r\nHost: x\r\n")  # and never the end of the head
        slow.append(client)
    try:
        probes = [probe(server.port, path) for path in ("/healthz", "/readyz", "/metrics") * 5]
    finally:
        for client in slow:
            client.close()
    assert [line for line, _ in probes] == [b"HTTP/1.0 200 OK"] * 15, probes
    assert max(took for _, took in probes) < 1.0, probes


def test_probes_answer_while_every_route_worker_is_busy(server):
    release, entered = threading.Event(), []

    def slow(_: object) -> Reply:
        entered.append(1)
        release.wait(30)
        return Reply(200, b"late\n")

    server.routes[("GET", "/slow")] = slow
    busy = [
        threading.Thread(target=get, args=(server.port, "/slow"), daemon=True)
        for _ in range(ROUTE_WORKERS)
    ]
    for thread in busy:
        thread.start()
    try:
        wait_for(lambda: len(entered) == ROUTE_WORKERS, 10, "every worker in a slow route")
        assert get(server.port, "/slow").startswith(b"HTTP/1.0 503")
        probes = [probe(server.port, path) for path in ("/healthz", "/readyz", "/metrics") * 5]
    finally:
        release.set()
        for thread in busy:
            thread.join(10)
    assert [line for line, _ in probes] == [b"HTTP/1.0 200 OK"] * 15, probes
    assert max(took for _, took in probes) < 1.0, probes
    assert get(server.port, "/slow").startswith(b"HTTP/1.0 200")


def flood(port: int, lines: int, line_bytes: int) -> bytes:
    """A request head of `lines` header lines of `line_bytes` each; the reply, if any."""
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        try:
            sock.sendall(b"GET /healthz HTTP/1.0\r\n")
            for n in range(lines):
                sock.sendall(b"X-Flood-%d: " % n + b"f" * line_bytes + b"\r\n")
            sock.sendall(b"\r\n")
        except OSError:
            pass  # the server stopped reading, answered and closed
        try:
            return read_all(sock)
        except OSError:
            return b""


def test_a_request_head_has_a_byte_budget_before_any_parsing(server):
    flood(server.port, 1, 10)  # the server's first request, outside the measure
    tracemalloc.start()
    try:
        replies = [flood(server.port, 99, 65_000) for _ in range(4)]
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 2 * 1024 * 1024, f"{peak} bytes held for four floods of headers"
    for reply in replies:  # refused (the reply may be lost to a reset while the flood goes on)
        assert reply == b"" or reply.startswith(b"HTTP/1.0 431"), reply[:100]
    assert flood(server.port, 1, 20_000).startswith(b"HTTP/1.0 431")
    assert healthy(server.port)


def test_a_request_head_has_a_line_budget(server):
    assert flood(server.port, 80, 10).startswith(b"HTTP/1.0 431")
    assert flood(server.port, 40, 10).startswith(b"HTTP/1.0 200")


@pytest.mark.parametrize(
    ("length", "status"),
    [
        ("\u00b2", b"400"),  # read as latin-1, a digit to str.isdigit()
        ("\u00b9\u00b3", b"400"),
        ("-1", b"400"),
        ("1e3", b"400"),
        ("9" * 5000, b"413"),
        ("99999999999999999999", b"413"),
    ],
)
def test_a_content_length_that_is_not_a_small_ascii_number_is_refused(server, length, status):
    server.routes[("POST", "/echo")] = lambda r: Reply(200, r.body)
    raw = b"POST /echo HTTP/1.0\r\nContent-Length: " + length.encode("latin-1") + b"\r\n\r\n"
    assert send(server.port, raw).startswith(b"HTTP/1.0 " + status)
    assert send(server.port, b"POST /echo HTTP/1.0\r\nContent-Length: 2\r\n\r\nok").endswith(
        b"\r\n\r\nok"
    )


@pytest.mark.parametrize(
    "raw",
    [
        b"GET\r\n\r\n",
        b"GET /healthz\r\n\r\n",
        b"GET /healthz HTTP/1.0 extra\r\n\r\n",
        b"GET /healthz HTTP/1.0\r\nno colon here\r\n\r\n",
        b"GET /healthz HTTP/1.0\r\n folded: header\r\n\r\n",
        b"GET healthz HTTP/1.0\r\n\r\n",
        b"\xff\xfe /healthz HTTP/1.0\r\n\r\n",
    ],
)
def test_a_malformed_request_is_a_400(server, raw):
    assert send(server.port, raw).startswith(b"HTTP/1.0 400")


def test_a_reply_header_that_cannot_be_sent_is_a_500_not_a_silent_close(server):
    server.routes[("GET", "/odd")] = lambda _: Reply(
        302, b"", headers=(("Location", "/jobs/\u20ac"),)
    )
    server.routes[("GET", "/split")] = lambda _: Reply(200, b"", headers=(("X-A", "a\r\nX-B: b"),))
    assert get(server.port, "/odd").startswith(b"HTTP/1.0 500")
    assert get(server.port, "/split").startswith(b"HTTP/1.0 500")


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
