"""Everything from the network has a budget in bytes and in time: real replicas against
hostile webhook receivers and HTTP clients (docs/operating.md: Network budgets)."""

from __future__ import annotations

import contextlib
import socket
import threading
import time

import psycopg
import pytest

from scheduler.config.budgets import ATTEMPT_DEADLINE
from tests.support import Fleet, RawReceiver, free_port, wait_for

pytestmark = pytest.mark.fleet

JOBS = ["budgets.py"]  # flip_flop: fails on odd seconds once the file `flip` exists
NOTICE_EVERY_RUN = {"flip_flop": {"interval": "1s", "fail_alert_after": 1}}
GROWTH_LIMIT = 50 * 1024 * 1024  # bytes a replica may grow by under each attack
OFFERED_AT_MOST = 256 * 1024 * 1024  # what the hostile receiver sends on one connection
CHUNK = b"10000\r\n" + b"x" * 65536 + b"\r\n"


def rss(pid: int) -> int:
    """The process's resident set size in bytes (VmRSS of /proc/<pid>/status)."""
    with open(f"/proc/{pid}/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise AssertionError(f"no VmRSS for {pid}")


class Sampler:
    """The highest RSS of a process, sampled every 0.1 s from a thread."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.before = rss(pid)
        self.peak = self.before
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(0.1):
            with contextlib.suppress(OSError, AssertionError):
                self.peak = max(self.peak, rss(self.pid))

    def stop(self) -> tuple[int, int, int]:
        """(before, peak, after) in bytes."""
        self._stop.set()
        self._thread.join(5)
        after = rss(self.pid)
        return self.before, max(self.peak, after), after


def mb(n: int) -> str:
    return f"{n / 1024 / 1024:.1f} MB"


def endless(receiver: RawReceiver, conn: socket.socket, _: bytes) -> None:
    """200, then a chunked body that never ends (until the client hangs up, or 256 MB)."""
    receiver.send(conn, b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n")
    sent = 0
    while sent < OFFERED_AT_MOST:
        receiver.send(conn, CHUNK)
        sent += len(CHUNK)


def drip(receiver: RawReceiver, conn: socket.socket, _: bytes) -> None:
    """A byte every second, for 30 s: every read is quick, the answer never whole."""
    for byte in (b"HTTP/1.1 200 OK\r\nX-Slow: " + b"y" * 30)[:30]:
        receiver.send(conn, bytes([byte]))
        time.sleep(1)


def webhook(receiver: RawReceiver) -> dict[str, str]:
    return {"alert_webhook_url": receiver.url()}


def flip(fleet: Fleet) -> None:
    """From now on a notice after every run."""
    (fleet.root / "flip").touch()


def notices(database_url: str) -> list[tuple[str, int, str | None]]:
    with psycopg.connect(database_url) as conn:
        rows = conn.execute(
            "SELECT event, attempts, outcome FROM scheduler_notices ORDER BY id"
        ).fetchall()
    return [tuple(row) for row in rows]


def test_a_webhook_answering_an_endless_body_costs_the_replica_no_memory(tmp_path, database_url):
    receiver = RawReceiver(endless)
    fleet = Fleet(
        tmp_path, database_url, NOTICE_EVERY_RUN, settings=webhook(receiver), job_files=JOBS
    )
    replica = fleet.start("r1")
    try:
        fleet.wait_ready()
        wait_for(lambda: len(fleet.starts()) >= 3, 30, "the first runs")
        assert not receiver.requests
        sampler = Sampler(replica.pid)
        flip(fleet)
        wait_for(lambda: len(receiver.requests) >= 12, 60, "a dozen notices POSTed")
        before, peak, after = sampler.stop()
        delivered = [n for n in notices(database_url) if n[2] == "delivered"]
        codes = fleet.stop()
    finally:
        fleet.kill_all()
        receiver.close()
    print(f"endless body: RSS before {mb(before)}, peak {mb(peak)}, after {mb(after)}")
    assert peak - before < GROWTH_LIMIT, (mb(before), mb(peak), mb(after))
    assert after - before < GROWTH_LIMIT, (mb(before), mb(peak), mb(after))
    assert len(delivered) >= 10, notices(database_url)  # a 200 is an answer, the rest unread
    assert codes == {"r1": 0}, fleet.logs()


def flood(port: int) -> None:
    """99 header lines of 65 KB: what the parser would have held, 6.4 MB a connection."""
    with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), 10) as sock:
        sock.sendall(b"GET /healthz HTTP/1.0\r\n")
        line = b"f" * 65_000 + b"\r\n"
        for n in range(99):
            sock.sendall(b"X-Flood-%d: " % n + line)
        sock.sendall(b"\r\n")
        while sock.recv(65536):
            pass


def healthz(port: int, timeout: float = 10) -> tuple[int, float]:
    """The status of one GET /healthz (0 when none came) and how long it took."""
    started = time.monotonic()
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=timeout) as sock:
            sock.sendall(b"GET /healthz HTTP/1.0\r\n\r\n")
            reply = b""
            while chunk := sock.recv(65536):
                reply += chunk
    except OSError:
        return 0, time.monotonic() - started
    status = int(reply.split(b" ", 2)[1]) if reply.startswith(b"HTTP/") else 0
    return status, time.monotonic() - started


def test_32_clients_flooding_request_headers_cost_the_replica_no_memory(tmp_path, database_url):
    http_port = free_port()
    fleet = Fleet(tmp_path, database_url, NOTICE_EVERY_RUN, job_files=JOBS)
    replica = fleet.start("r1", args=["--http-port", str(http_port)])
    try:
        fleet.wait_ready()
        wait_for(lambda: healthz(http_port)[0] == 200, 30, "/healthz")
        sampler = Sampler(replica.pid)
        for _ in range(3):  # three waves of 32 clients
            clients = [
                threading.Thread(target=flood, args=(http_port,), daemon=True) for _ in range(32)
            ]
            for client in clients:
                client.start()
            for client in clients:
                client.join(60)
        time.sleep(1)
        before, peak, after = sampler.stop()
        status, _ = healthz(http_port)
        codes = fleet.stop()
    finally:
        fleet.kill_all()
    print(f"header flood: RSS before {mb(before)}, peak {mb(peak)}, after {mb(after)}")
    assert peak - before < GROWTH_LIMIT, (mb(before), mb(peak), mb(after))
    assert after - before < GROWTH_LIMIT, (mb(before), mb(peak), mb(after))
    assert status == 200
    assert codes == {"r1": 0}, fleet.logs()


class SlowClients:
    """`count` connections that send a request head a byte at a time, reconnecting when
    dropped, until stopped: page clients that never finish asking."""

    def __init__(self, port: int, count: int) -> None:
        self.port = port
        self.stopping = threading.Event()
        self.threads = [threading.Thread(target=self._hold, daemon=True) for _ in range(count)]
        for thread in self.threads:
            thread.start()

    def _hold(self) -> None:
        while not self.stopping.is_set():
            with (
                contextlib.suppress(OSError),
                socket.create_connection(("127.0.0.1", self.port), 10) as sock,
            ):
                sock.sendall(b"GET / HTTP/1.0\r\n")
                while not self.stopping.wait(0.5):
                    sock.sendall(b"X")  # a header line that never ends

    def stop(self) -> None:
        self.stopping.set()
        for thread in self.threads:
            thread.join(10)


def test_probes_answer_within_a_second_while_100_slow_clients_hold_connections(
    tmp_path, database_url
):
    http_port = free_port()
    fleet = Fleet(tmp_path, database_url, NOTICE_EVERY_RUN, job_files=JOBS)
    fleet.start("r1", args=["--http-port", str(http_port)])
    try:
        fleet.wait_ready()
        wait_for(lambda: healthz(http_port)[0] == 200, 30, "/healthz")
        slow = SlowClients(http_port, 100)
        try:
            time.sleep(2)  # all 100 connected, and some already dropped and back
            probes = []
            for _ in range(15):
                probes.append(healthz(http_port))
                time.sleep(0.3)
        finally:
            slow.stop()
        codes = fleet.stop()
    finally:
        fleet.kill_all()
    print("probes (status, seconds):", [(s, round(t, 3)) for s, t in probes])
    assert [status for status, _ in probes] == [200] * 15, probes
    assert max(took for _, took in probes) < 1.0, probes
    assert codes == {"r1": 0}, fleet.logs()


def test_a_dripping_webhook_costs_each_notice_one_attempt_and_no_alert_goes_unlogged(
    tmp_path, database_url
):
    receiver = RawReceiver(drip)
    fleet = Fleet(
        tmp_path, database_url, NOTICE_EVERY_RUN, settings=webhook(receiver), job_files=JOBS
    )
    fleet.start("r1")
    flip(fleet)
    try:
        fleet.wait_ready()
        # While the receiver drips, every notice is logged as it is raised...
        wait_for(lambda: fleet.logs().count("ALERT job.") >= 6, 30, "six notices logged")
        # ...and each attempt fails at its deadline, counted towards giving up.
        wait_for(
            lambda: any(attempts >= 2 for _, attempts, _ in notices(database_url)),
            6 * ATTEMPT_DEADLINE,
            "a notice's second failed attempt",
        )
        codes = fleet.stop()
    finally:
        fleet.kill_all()
        receiver.close()
    logs = fleet.logs()
    assert f"no whole answer within {ATTEMPT_DEADLINE:g} s" in logs
    assert "delivered" not in {outcome for _, _, outcome in notices(database_url)}
    assert codes == {"r1": 0}, logs
