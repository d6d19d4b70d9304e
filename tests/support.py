"""Helpers shared by the tests: URLs, and a fleet of real `scheduler run` processes."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Any

import psycopg
import yaml

if TYPE_CHECKING:
    from scheduler.registry.catalog import CatalogJob

SERVER_URL_ENV = "SCHEDULER_TEST_DATABASE_URL"
ROOT = Path(__file__).resolve().parent.parent


def faketime_library() -> str:
    """Debian's libfaketime (package faketime), for replicas with skewed clocks."""
    found = sorted(Path("/usr/lib").glob("*/faketime/libfaketimeMT.so.1"))
    if not found:
        raise AssertionError("libfaketime is required: apt-get install faketime")
    return str(found[0])


def host_port(url: str) -> tuple[str, int]:
    from urllib.parse import urlsplit

    parts = urlsplit(url)
    return parts.hostname or "127.0.0.1", parts.port or 5432


def with_database(url: str, name: str) -> str:
    base, _, _ = url.rpartition("/")
    return f"{base}/{name}"


def sessions_named(url: str, name: str) -> int:
    """Sessions on the server whose application_name is `name` (a replica's, by default)."""
    with psycopg.connect(url, autocommit=True) as conn:
        row = conn.execute(
            "SELECT count(*) FROM pg_stat_activity WHERE application_name = %s", (name,)
        ).fetchone()
    assert row is not None
    return int(row[0])


def wait_for(condition: Callable[[], Any], timeout: float, what: str, every: float = 0.1) -> Any:
    """Poll until `condition()` is truthy; generous timeouts, never tight timings."""
    deadline = time.monotonic() + timeout
    while True:
        value = condition()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:g} s waiting for {what}")
        time.sleep(every)


# The job modules fleet tests pick from (`Fleet(job_files=...)`), and their helper
# `_evidence.py`: each run appends one JSON line of evidence, written by the job
# itself, independent of the ledger under test.
FLEET_JOBS = Path(__file__).resolve().parent / "fleet" / "jobs"
EVIDENCE_HELPER = "_evidence.py"


@dataclass
class Replica:
    name: str
    process: subprocess.Popen[bytes]
    log_path: Path

    def log(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    @property
    def pid(self) -> int:
        return self.process.pid

    def signal(self, signum: int) -> None:
        if self.process.poll() is None:
            os.kill(self.process.pid, signum)

    def wait(self, timeout: float) -> int:
        return self.process.wait(timeout=timeout)


@dataclass
class Fleet:
    """A folder with config.yaml and jobs/, and the replicas started from it.

    `jobs` are the schedules; `job_files` name the modules of tests/fleet/jobs
    that the fleet's jobs/ folder gets, with the `_evidence.py` they import.
    Only those: the daemon imports every module in jobs/, so modules that use
    one key for different jobs must never share a folder.
    """

    root: Path
    database_url: str | None
    jobs: dict[str, dict[str, Any]]
    settings: dict[str, Any] = field(default_factory=dict)
    replicas: dict[str, Replica] = field(default_factory=dict)
    job_files: Sequence[str] = field(kw_only=True)

    def __post_init__(self) -> None:
        folder = self.root / "jobs"
        folder.mkdir(parents=True, exist_ok=True)
        for name in (EVIDENCE_HELPER, *self.job_files):
            source = FLEET_JOBS / name
            if Path(name).name != name or not source.is_file():
                raise AssertionError(f"no job module {name!r} in {FLEET_JOBS}")
            shutil.copyfile(source, folder / name)
        document = {"scheduler": self.settings, "jobs": self.jobs}
        (self.root / "config.yaml").write_text(yaml.safe_dump(document, sort_keys=False))
        self.evidence_path.touch()

    @property
    def evidence_path(self) -> Path:
        return self.root / "evidence.jsonl"

    def env(self, name: str, extra: dict[str, str] | None = None) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if not k.startswith("SCHEDULER_")}
        env.update(
            SCHEDULER_CONFIG=str(self.root / "config.yaml"),
            SCHEDULER_INSTANCE_NAME=name,
            SCHEDULER_TEST_EVIDENCE=str(self.evidence_path),
            PYTHONUNBUFFERED="1",
        )
        if self.database_url:
            env["SCHEDULER_DATABASE_URL"] = self.database_url
        env.update(extra or {})
        return env

    def start(
        self,
        name: str,
        *,
        clock_offset: str | None = None,
        env: dict[str, str] | None = None,
        args: Iterable[str] = (),
    ) -> Replica:
        command = [sys.executable, "-m", "scheduler", "run", *args]
        extra = dict(env or {})
        if clock_offset is not None:
            # libfaketime preloaded into the replica itself (the `faketime` wrapper
            # forks, and would swallow the signals the tests send).
            # Only the wall clock is skewed, as between hosts; timers stay real.
            extra.update(
                LD_PRELOAD=faketime_library(),
                FAKETIME=clock_offset,
                FAKETIME_DONT_FAKE_MONOTONIC="1",
            )
        log_path = self.root / f"{name}.log"
        with open(log_path, "wb") as log:
            process = subprocess.Popen(
                command,
                cwd=self.root,
                env=self.env(name, extra),
                stdout=log,
                stderr=subprocess.STDOUT,
            )
        replica = Replica(name, process, log_path)
        self.replicas[name] = replica
        return replica

    def wait_ready(self, timeout: float = 60) -> None:
        """Every replica has its lock session up (it logs so)."""
        for replica in self.replicas.values():
            wait_for(
                lambda r=replica: "lock session up" in r.log() or r.process.poll() is not None,
                timeout,
                f"{replica.name} to start",
            )
            assert replica.process.poll() is None, f"{replica.name} exited:\n{replica.log()}"

    def stop(self, timeout: float = 60) -> dict[str, int]:
        for replica in self.replicas.values():
            replica.signal(signal.SIGTERM)
        codes = {}
        for replica in self.replicas.values():
            try:
                codes[replica.name] = replica.wait(timeout)
            except subprocess.TimeoutExpired:
                replica.signal(signal.SIGKILL)
                codes[replica.name] = replica.wait(10)
        return codes

    def kill_all(self) -> None:
        for replica in self.replicas.values():
            replica.signal(signal.SIGCONT)
            replica.signal(signal.SIGKILL)
            with contextlib.suppress(subprocess.TimeoutExpired):
                replica.wait(10)

    def logs(self) -> str:
        return "\n".join(f"--- {r.name} ---\n{r.log()[-6000:]}" for r in self.replicas.values())

    def evidence(self) -> list[dict[str, Any]]:
        """Every whole line the jobs wrote (a line being written as we read is left out)."""
        text = self.evidence_path.read_text()
        whole = text[: text.rfind("\n") + 1]
        return [json.loads(line) for line in whole.splitlines() if line.strip()]

    def starts(self, instance: str | None = None) -> list[dict[str, Any]]:
        """Runs that started (on `instance`), from the jobs' own evidence."""
        return self._events("start", instance)

    def ends(self, instance: str | None = None) -> list[dict[str, Any]]:
        """Runs of `exclusive` jobs that ended (on `instance`)."""
        return self._events("end", instance)

    def _events(self, kind: str, instance: str | None) -> list[dict[str, Any]]:
        return [
            e
            for e in self.evidence()
            if e.get("event", "start") == kind and instance in (None, e["instance"])
        ]

    def ledger(self, job: str | None = None) -> list[dict[str, Any]]:
        assert self.database_url
        with psycopg.connect(self.database_url) as conn:
            conn.execute("SET TimeZone = 'UTC'")
            cur = conn.cursor(row_factory=psycopg.rows.dict_row)
            query = "SELECT * FROM scheduler_ticks"
            params: tuple[Any, ...] = ()
            if job:
                query += " WHERE job_name = %s"
                params = (job,)
            return list(cur.execute(query + " ORDER BY scheduled_at, job_key", params))


def parse_tick(text: str) -> datetime:
    return datetime.fromisoformat(text).astimezone(UTC)


def whole_seconds(start: datetime, end: datetime) -> list[datetime]:
    """Every whole-second tick in [start, end]."""
    first = start.replace(microsecond=0) + (
        timedelta(seconds=1) if start.microsecond else timedelta()
    )
    ticks = []
    tick = first
    while tick <= end:
        ticks.append(tick)
        tick += timedelta(seconds=1)
    return ticks


def runs_per_tick(evidence: list[dict[str, Any]], job: str) -> Counter[datetime]:
    """How many times each tick of `job` started, from the jobs' own evidence."""
    return Counter(
        parse_tick(e["tick"])
        for e in evidence
        if e["job"] == job and e.get("event", "start") == "start"
    )


def assert_exactly_once(
    evidence: list[dict[str, Any]], job: str, window: list[datetime], logs: str = ""
) -> None:
    counts = runs_per_tick(evidence, job)
    twice = {t.isoformat(): n for t, n in counts.items() if n > 1}
    missing = [t.isoformat() for t in window if counts[t] == 0]
    assert not twice, f"{job}: ticks run more than once: {twice}\n{logs}"
    assert not missing, f"{job}: ticks never run inside the window: {missing}\n{logs}"


class Receiver:
    """A local HTTP server that records what is POSTed or GETed to it.

    `delay`: seconds each answer waits (a slow service). `hold_first`: an event
    the first POST waits for before it is answered (a delivery in flight).
    """

    def __init__(self, port: int = 0, delay: float = 0.0) -> None:
        import http.server
        import threading

        received: list[dict[str, Any]] = []
        self.received = received
        self.hold_first: threading.Event | None = None
        receiver = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                length = int(self.headers.get("Content-Length") or 0)
                body = self.rfile.read(length)
                try:
                    parsed = json.loads(body) if body else None
                except ValueError:
                    parsed = body.decode(errors="replace")
                received.append(
                    {"method": "POST", "path": self.path, "body": parsed, "at": time.time()}
                )
                if len(received) == 1 and receiver.hold_first is not None:
                    receiver.hold_first.wait(120)
                self._answer()

            def do_GET(self) -> None:
                received.append(
                    {"method": "GET", "path": self.path, "body": None, "at": time.time()}
                )
                self._answer()

            def _answer(self) -> None:
                if delay:
                    time.sleep(delay)
                try:
                    self.send_response(200)
                    self.end_headers()
                except OSError:
                    pass  # the client gave up waiting

            def log_message(self, *args: object) -> None:
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", port), Handler)
        self.server.daemon_threads = True
        self.port = self.server.server_address[1]
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def url(self, path: str = "/") -> str:
        return f"http://127.0.0.1:{self.port}{path}"

    def bodies(self, event: str | None = None) -> list[dict[str, Any]]:
        out = [r["body"] for r in self.received if isinstance(r["body"], dict)]
        return [b for b in out if event is None or b.get("event") == event]

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def cli(fleet: Fleet, *args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    """Run a `scheduler` command against the fleet's config and database."""
    return subprocess.run(
        [sys.executable, "-m", "scheduler", *args],
        cwd=fleet.root,
        env=fleet.env("cli"),
        capture_output=True,
        text=True,
        timeout=timeout,
    )


class Proxy:
    """A TCP proxy in front of PostgreSQL that can black-hole its traffic, like a cut cable.

    While cut, nothing is forwarded either way and new connections hang; the
    sockets stay open, so neither side sees an error from the network itself.
    """

    def __init__(self, upstream_host: str, upstream_port: int, receive_buffer: int = 0) -> None:
        import socket
        import threading

        self.receive_buffer = receive_buffer  # bytes of the server's replies held in transit

        self.upstream = (upstream_host, upstream_port)
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        self.open = threading.Event()
        self.open.set()
        self.replies = threading.Event()  # cleared: the server's replies are not read
        self.replies.set()
        self.replied = 0  # bytes forwarded from the server to its clients
        self.pairs: list[tuple[socket.socket, socket.socket]] = []
        self.closed = False
        self.refusing = False  # down(): every connection is closed at once
        threading.Thread(target=self._accept, daemon=True).start()

    def url(self, database_url: str) -> str:
        from urllib.parse import urlsplit, urlunsplit

        parts = urlsplit(database_url)
        netloc = parts.netloc.rsplit("@", 1)
        auth = netloc[0] + "@" if len(netloc) == 2 else ""
        return urlunsplit(parts._replace(netloc=f"{auth}127.0.0.1:{self.port}"))

    def cut(self) -> None:
        self.open.clear()

    def stall_replies(self) -> None:
        """The client stops reading (a frozen process): requests still reach the server."""
        self.replies.clear()

    def down(self) -> None:
        """The database is down: open connections end, new ones are closed at once."""
        self.refusing = True
        self._drop_pairs()

    def restore(self) -> None:
        """The network is back: connections that were cut are gone; new ones flow."""
        self._drop_pairs()
        self.refusing = False
        self.open.set()

    def _drop_pairs(self) -> None:
        for a, b in self.pairs:
            for sock in (a, b):
                with contextlib.suppress(OSError):
                    sock.close()
        self.pairs.clear()

    def close(self) -> None:
        self.closed = True
        self.restore()
        self.listener.close()

    def _accept(self) -> None:
        import socket
        import threading

        while not self.closed:
            try:
                client, _ = self.listener.accept()
            except OSError:
                return
            self.open.wait()
            if self.refusing:
                client.close()
                continue
            server = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            try:
                if self.receive_buffer:
                    server.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, self.receive_buffer)
                server.connect(self.upstream)
            except OSError:  # the upstream is down (a failover): the client sees it closed
                server.close()
                client.close()
                continue
            pair = (client, server)
            self.pairs.append(pair)
            ended = self._when_both_end(pair)
            for a, b, gate in ((client, server, self.open), (server, client, self.replies)):
                threading.Thread(target=self._pump, args=(a, b, gate, ended), daemon=True).start()

    def _when_both_end(self, pair):
        """What each of a pair's two pumps calls as it ends: the second closes the pair (a
        proxy that outlives many connections, one per chore, keeps no socket of theirs)."""
        import threading

        lock, left = threading.Lock(), [2]

        def ended() -> None:
            with lock:
                left[0] -= 1
                if left[0]:
                    return
            for sock in pair:
                with contextlib.suppress(OSError):
                    sock.close()
            with contextlib.suppress(ValueError):
                self.pairs.remove(pair)

        return ended

    def _pump(self, source, target, gate, ended) -> None:
        try:
            self._forward(source, target, gate)
        finally:
            with contextlib.suppress(OSError):
                target.shutdown(2)  # the other direction's pump sees its end too
            ended()

    def _forward(self, source, target, gate) -> None:
        while True:
            self.open.wait()
            if gate is not None:
                gate.wait()
            try:
                data = source.recv(65536)
            except OSError:
                return
            if not data:
                return
            self.open.wait()  # data read just before a cut is held, not delivered
            if gate is self.replies:
                self.replied += len(data)
            try:
                target.sendall(data)
            except OSError:
                return


# -- driving a gate step by step (no dispatcher thread, a fake monotonic clock) --------


class FakeMonotonic:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def make_job(key: int, func, name: str | None = None, skip_alert_after: int = 3):
    """A catalog job on a 1 s grid, for tests that drive the gate or the backends."""
    from scheduler.config.settings import JobConfig
    from scheduler.registry.catalog import CatalogJob
    from scheduler.registry.jobs import JobSpec

    schedule = JobConfig(interval="1s", skip_alert_after=skip_alert_after)
    spec = JobSpec(
        key=key,
        name=name or func.__name__,
        func=func,
        takes_context=True,
        is_async=False,
        source="test",
    )
    return CatalogJob(
        spec=spec,
        schedule=schedule,
        timezone="UTC",
        skip_threshold=skip_alert_after,
        fail_threshold=3,
        misfire_grace=timedelta(seconds=30),
    )


class JobsDesk:
    """The replica's jobs as its run-now desk (scheduler.fleet.run_now.Desk) gives them to
    the gate, and no run-now request: for retries and reloads. `jobs` may be replaced."""

    def __init__(self, *jobs: CatalogJob) -> None:
        self.jobs = {job.key: job for job in jobs}

    def keys(self) -> list[int]:
        return list(self.jobs)

    def enabled_keys(self) -> list[int]:
        return [key for key, job in self.jobs.items() if job.enabled]

    def job(self, key: int) -> CatalogJob | None:
        return self.jobs.get(key)

    def settle(self, *args: object) -> None:
        return None


class Recorder:
    """A listener that keeps every event the gate reports."""

    def __init__(self) -> None:
        self.events: list[Any] = []

    def __call__(self, event: Any) -> None:
        self.events.append(event)

    def of(self, kind: type) -> list[Any]:
        return [e for e in self.events if isinstance(e, kind)]


def now_tick(offset: int = 0) -> datetime:
    return datetime.now(UTC).replace(microsecond=0) + timedelta(seconds=offset)


def settle(gate: Any, until: Callable[[], Any], what: str) -> None:
    """Step the gate until `until()` holds (runs execute on the gate's worker threads)."""

    def stepped() -> Any:
        gate.step()
        return until()

    wait_for(stepped, 10, what, every=0.02)


def a_waiting_tick_still_runs(gate: Any, seen: Recorder, keys: tuple[int, int]) -> None:
    """Guarantee 1 through a gate with one worker: a tick waiting here is never dropped for
    its job's next one; both run, oldest first, and succeed (either backend)."""
    from scheduler.observers import events

    release = threading.Event()
    blocker = make_job(keys[0], lambda ctx: release.wait(10), name="blocker")
    late = make_job(keys[1], lambda ctx: None, name="late")
    first, second = now_tick(-3), now_tick(-2)
    gate.submit(blocker, first)
    settle(gate, lambda: seen.of(events.RunStarted), "the blocker's run")
    gate.submit(late, first)
    gate.step()
    gate.submit(late, second)  # its next tick comes while the first still waits
    gate.step()
    release.set()
    settle(gate, lambda: len(seen.of(events.RunFinished)) == 3, "both ticks of late to run")
    started = [e.scheduled_at for e in seen.of(events.RunStarted) if e.job == "late"]
    assert started == [first, second]
    assert {e.status for e in seen.of(events.RunFinished)} == {"succeeded"}
    assert not seen.of(events.TickSkipped)


def retried_claims_share_the_free_workers(gate: Any, seen: Recorder, keys: tuple[int, int]) -> None:
    """Through a gate with one worker: a failed batch of two is tried again an entry at a
    time, and the claims of that step share one budget of free workers (PostgreSQL
    refuses a claim asked for fewer than none)."""
    from scheduler.observers import events

    release = threading.Event()
    jobs = [make_job(key, lambda ctx: release.wait(10), name=f"b{key}") for key in keys]
    claim, batches = gate.backend.claim, []

    def failing_once(requests: Any, *args: Any) -> Any:
        batches.append(len(requests))
        if len(batches) == 1:
            raise RuntimeError("canceling statement due to lock timeout")
        return claim(requests, *args)

    gate.backend.claim = failing_once
    gate.submit_all(jobs, now_tick(-1))
    gate.step()  # fails: both go back, to be claimed one by one
    gate.step()
    assert batches == [2, 1, 1]
    assert len(seen.of(events.RunStarted)) == 1
    assert gate.table.free_slots() == 0
    release.set()
    settle(gate, lambda: len(seen.of(events.RunFinished)) == 2, "the other to run after")


class RawReceiver:
    """A local HTTP receiver at the socket's level, for hostile answers (endless, dripping).

    It reads each connection's request (head and Content-Length body), keeps it
    with the time it arrived, then leaves the connection to
    `answer(receiver, conn, request)`; `send` counts what it sends.
    """

    def __init__(self, answer: Callable[[RawReceiver, socket.socket, bytes], None]) -> None:
        self.answer = answer
        self.requests: list[tuple[float, bytes]] = []  # (time.monotonic(), request)
        self.sent = 0
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        threading.Thread(target=self._accept, daemon=True).start()

    def url(self, path: str = "/hook", userinfo: str = "") -> str:
        return f"http://{userinfo}127.0.0.1:{self.port}{path}"

    def bodies(self) -> list[bytes]:
        return [request.partition(b"\r\n\r\n")[2] for _, request in self.requests]

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self.listener.accept()
            except OSError:
                return
            threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        with conn:
            conn.settimeout(30)
            try:
                request = self._read(conn)
                if request is not None:
                    self.requests.append((time.monotonic(), request))
                    self.answer(self, conn, request)
            except OSError:
                pass

    @staticmethod
    def _read(conn: socket.socket) -> bytes | None:
        data = b""
        while b"\r\n\r\n" not in data:
            chunk = conn.recv(65536)
            if not chunk:
                return None
            data += chunk
        head, _, body = data.partition(b"\r\n\r\n")
        lengths = [
            line.partition(b":")[2].strip()
            for line in head.split(b"\r\n")
            if line.lower().startswith(b"content-length:")
        ]
        length = int(lengths[0]) if lengths else 0
        while len(body) < length:
            chunk = conn.recv(65536)
            if not chunk:
                return None
            body += chunk
        return head + b"\r\n\r\n" + body

    def send(self, conn: socket.socket, data: bytes) -> None:
        conn.sendall(data)
        self.sent += len(data)

    def close(self) -> None:
        self.listener.close()


# -- runs won ahead of a free worker (scheduler/gate/ahead.py), on either backend --------


class HeldPool:
    """The gate's workers, held: each run handed over waits until the test lets it go
    (`go`), and then runs on this thread, as a worker would run it."""

    def __init__(self) -> None:
        self.tasks: list[tuple[Callable[..., None], tuple[object, ...]]] = []

    def submit_all(self, tasks: list[tuple[Callable[..., None], tuple[object, ...]]]) -> None:
        self.tasks += tasks

    def go(self, count: int | None = None) -> None:
        taken, self.tasks = self.tasks[:count], self.tasks[len(self.tasks[:count]) :]
        for fn, args in taken:
            fn(*args)

    def wait(self, timeout: float | None = None) -> bool:
        return not self.tasks

    def shutdown(self) -> None:
        return None


def claimed_ahead(gate: Any, clock: FakeMonotonic, keys: tuple[int, ...]) -> list[CatalogJob]:
    """One worker, runs known to last a millisecond: one claim wins every tick of `keys`,
    all but one ahead of a free worker, each with a lease; none has started yet."""
    from scheduler.gate.ahead import LEASE

    pool = HeldPool()
    gate.table.workers = pool
    gate.ahead = True
    gate.table.lengths.add(0.001)
    jobs = [make_job(key, lambda ctx: None, name=f"ahead{key}") for key in keys]
    gate.submit_all(jobs, now_tick(-1))
    gate.step()
    pool.tasks.sort(key=lambda task: task[1][0].job.key)  # the order of `keys`
    runs = gate.table.runs()
    assert len(runs) == len(keys) and gate.table.max_workers == 1
    assert all(run.lease_until == clock.now + LEASE for run in runs)
    return jobs


def a_run_won_ahead_past_its_lease_is_asked_again(
    gate: Any, seen: Recorder, clock: FakeMonotonic, keys: tuple[int, int, int]
) -> list[Any]:
    """The first run starts in its lease; the others, taken past it, are asked again (one
    recheck for both), started with a new lease, and every tick runs once. Returns the
    rechecks sent."""
    from scheduler.gate.ahead import LEASE
    from scheduler.observers import events

    claimed_ahead(gate, clock, keys)
    asked: list[Any] = []
    recheck = gate.backend.recheck
    gate.backend.recheck = lambda runs: asked.append(list(runs)) or recheck(runs)
    gate.table.workers.go(1)
    clock.now += LEASE + 0.01
    gate.table.workers.go()  # past their lease: handed back, not started
    assert len(seen.of(events.RunStarted)) == 1
    gate.step()
    assert [len(runs) for runs in asked] == [2]
    assert all(
        run.lease_until == clock.now + LEASE for run in gate.table.runs() if run.ended is None
    )
    gate.table.workers.go()
    settle(gate, lambda: len(seen.of(events.RunFinished)) == 3, "every tick to run once")
    assert sorted(e.key for e in seen.of(events.RunStarted)) == sorted(keys)
    return asked


def a_pause_meanwhile_stops_a_run_won_ahead(
    gate: Any, seen: Recorder, clock: FakeMonotonic, keys: tuple[int, int]
) -> None:
    """A job paused after its run was claimed ahead, before a worker took it: past its lease
    the run does not start; its tick is recorded paused, and its lock given back."""
    from scheduler.fleet import pauses
    from scheduler.gate.ahead import LEASE
    from scheduler.observers import events

    jobs = claimed_ahead(gate, clock, keys)
    with gate.backend.ledger_engine.begin() as conn:
        pauses.pause(conn, keys[1], jobs[1].name, by="test", reason=None, now=datetime.now(UTC))
    gate.table.workers.go(1)
    clock.now += LEASE + 0.01
    gate.table.workers.go()
    gate.step()
    gate.table.workers.go()
    settle(gate, lambda: seen.of(events.RunFinished), "the other job's run")
    assert [e.key for e in seen.of(events.RunStarted)] == [keys[0]]
    assert [e.key for e in seen.of(events.TickPaused)] == [keys[1]]
    assert keys[1] not in gate.backend.held_keys()
    assert not gate.table.running_keys()
