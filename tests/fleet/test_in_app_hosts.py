"""Replicas inside an application's web workers (docs/in-your-application.md), on two hosts.

Each "host" is one web server with 4 worker processes that share a `host_lock` file;
both serve one PostgreSQL database: FastAPI under `uvicorn --workers 4`, and Flask under
`gunicorn -w 4`, one host with preload_app and one without. Each test starts its two
servers once and plays its scenarios on them in turn, while a job every second and one
every 3 s (that runs 1.5 s) run:

- the page under the prefix, every link on it, and /healthz: ok on the active worker,
  standby on the others;
- uvicorn: SIGKILL of a host's active worker mid-run; gunicorn: max_requests replaces
  the workers of the preload_app host. Another worker of that host takes over, while
  the other host runs the ticks;
- a run asked for by a script (a bearer POST, answered JSON), then SIGTERM to both
  masters: the run is told `stopping`, and each server exits within shutdown_grace.

Throughout, every tick of both jobs starts once (the jobs' own evidence), no two runs of
a job overlap, and no host holds more than 2 database sessions (pg_stat_activity,
sampled, by the worker pid in each replica's application_name; a page read on a standby
opens one more for the request). Timings are printed, and asserted only generously.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import psycopg
import pytest

from scheduler.fleet.host_lock import standbys
from tests.support import Fleet, assert_exactly_once, free_port, wait_for

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
pytest.importorskip("flask")
pytest.importorskip("gunicorn")

pytestmark = pytest.mark.fleet

APPS = Path(__file__).resolve().parent / "apps"  # the two apps and gunicorn's config
JOBS = ["in_app.py"]  # every_second (runs 0.3 s), every_three_seconds (runs 1.5 s)
SCHEDULES = {"every_second": {"interval": "1s"}, "every_three_seconds": {"interval": "3s"}}
EVERY = {"every_second": 1, "every_three_seconds": 3}  # seconds between ticks
GRACE = 8  # shutdown_grace, seconds
TOKEN = "in-app-test-token-0123456789"
WORKERS = 4
SESSIONS = 2  # a host's sessions at most: its active replica's lock and ledger sessions
WAIT = 60  # seconds: generous, for a loaded machine
WINDOW = timedelta(seconds=8)  # the ticks checked span this at least: 2 of the 3 s job's
READING = ("pages", "act")  # the phases in which the test itself reads pages or acts
PID = re.compile(r"-([0-9]+)$")  # of a replica's default name, `<hostname>-<pid>`
HREF = re.compile(r'(?:href|src)="([^"]*)"')


def get(url: str) -> tuple[int, str, int]:
    """(status, body, the answering worker's pid) of one GET on a connection of its own."""
    try:
        with urllib.request.urlopen(url, timeout=10) as reply:
            return reply.status, reply.read().decode(), int(reply.headers.get("X-Worker", 0))
    except urllib.error.HTTPError as error:
        return error.code, error.read().decode(), int(error.headers.get("X-Worker", 0))
    except OSError:
        return 0, "", 0


def children(pid: int) -> set[int]:
    """A server's worker processes (not multiprocessing's resource tracker)."""
    try:
        found = Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
    except OSError:
        return set()
    return {int(child) for child in found if b"resource_tracker" not in _cmdline(int(child))}


def _cmdline(pid: int) -> bytes:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return b""


@dataclass
class Host:
    """One web server and its workers; each worker's replica is named `<hostname>-<pid>`."""

    name: str
    process: subprocess.Popen[bytes]
    port: int
    log_path: Path
    pids: set[int] = field(default_factory=set)  # every worker seen, gone ones too

    @property
    def lock(self) -> Path:
        return self.log_path.with_suffix(".lock")

    def url(self, path: str) -> str:
        return f"http://127.0.0.1:{self.port}{path}"

    def workers(self) -> set[int]:
        found = children(self.process.pid)
        self.pids |= found
        return found

    def kill(self) -> None:
        """Every process of the server at once (the test is over, or failed midway)."""
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.process.pid, signal.SIGKILL)
        self.process.wait(10)

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")[-6000:]


@dataclass
class Sample:
    at: float  # time.monotonic()
    phase: str
    sessions: dict[str, Counter[int]]  # host -> worker pid -> its sessions
    active: dict[str, set[int]]  # host -> workers whose lock session is up


class Sessions:
    """Samples pg_stat_activity every 0.1 s: which worker of which host holds sessions, and
    whose lock session is up (it holds the fleet's shared advisory lock)."""

    def __init__(self, database_url: str, hosts: list[Host]) -> None:
        self.url = database_url
        self.hosts = hosts
        self.samples: list[Sample] = []
        self.worst: dict[str, Sample] = {}  # of each host, the sample with the most sessions
        self.phase = "start"
        self.phases: list[tuple[str, float]] = [("start", time.monotonic())]
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)

    def __enter__(self) -> Sessions:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(10)

    def enter(self, phase: str) -> None:
        self.phase = phase
        self.phases.append((phase, time.monotonic()))

    def _sample(self) -> None:
        with psycopg.connect(self.url, autocommit=True) as conn:
            while not self._stop.wait(0.1):
                rows = conn.execute(
                    "SELECT a.application_name, EXISTS (SELECT 1 FROM pg_locks l"
                    "  WHERE l.pid = a.pid AND l.locktype = 'advisory'"
                    "    AND l.mode = 'ShareLock' AND l.granted)"
                    " FROM pg_stat_activity a"
                    " WHERE a.datname = current_database() AND a.pid <> pg_backend_pid()"
                ).fetchall()
                for host in self.hosts:
                    host.workers()
                sample = Sample(time.monotonic(), self.phase, {}, {})
                for host in self.hosts:
                    sample.sessions[host.name], sample.active[host.name] = Counter(), set()
                for name, lock_session in rows:
                    found = PID.search(name)
                    pid = int(found.group(1)) if found else 0
                    for host in self.hosts:
                        if pid in host.pids:  # else the test's own reads
                            sample.sessions[host.name][pid] += 1
                            if lock_session:
                                sample.active[host.name].add(pid)
                self.samples.append(sample)

    def active(self, host: Host) -> set[int]:
        """The workers of `host` whose lock session is up now (its active replica)."""
        count = len(self.samples)
        wait_for(lambda: len(self.samples) > count, 10, "a fresh sample of the sessions")
        return set(self.samples[-1].active[host.name])

    def one_active(self, host: Host) -> int:
        (pid,) = wait_for(
            lambda: len(found := self.active(host)) == 1 and found, WAIT, f"{host.name}'s active"
        )
        return int(pid)

    def first_active(self, host: Host, besides: int, after: float) -> float:
        """When another worker than `besides` first had its lock session up, after `after`."""
        for sample in self.samples:
            if sample.at > after and sample.active[host.name] - {besides}:
                return sample.at
        raise AssertionError(f"{host.name}: no other worker became active")

    def last_active(self, host: Host, pid: int) -> float:
        return max(s.at for s in self.samples if pid in s.active[host.name])

    def most(self, pages: bool) -> dict[str, int]:
        """The most sessions each host held at once, while the test read pages or not."""
        found = dict.fromkeys((h.name for h in self.hosts), 0)
        for sample in self.samples:
            if (sample.phase in READING) == pages:
                for name, counts in sample.sessions.items():
                    if sum(counts.values()) > found[name]:
                        found[name] = sum(counts.values())
                        self.worst[name] = sample
        return found

    def check(self) -> None:
        """At most 2 sessions per host; 3 while a page is read (on a standby, one for it)."""
        most, reading = self.most(pages=False), self.most(pages=True)
        ended = self.phases[-1][1]
        timings = ", ".join(
            f"{name} {end - start:.1f} s"
            for (name, start), (_, end) in zip(
                self.phases, [*self.phases[1:], ("end", ended)], strict=True
            )
        )
        print(f"sessions per host at most: {most}; while reading pages: {reading}")
        print(f"phases: {timings}")
        worst = {name: (s.phase, dict(s.sessions[name])) for name, s in self.worst.items()}
        assert all(n <= SESSIONS for n in most.values()), (most, worst)
        assert all(n <= SESSIONS + 1 for n in reading.values()), reading
        assert all(n >= 1 for n in most.values()), most  # the sampling saw them at all


def application(root: Path, database_url: str, *files: str) -> Fleet:
    """config.yaml, the jobs, and the app's files, in one folder both hosts serve from."""
    fleet = Fleet(root, database_url, SCHEDULES, job_files=JOBS)
    for name in files:
        shutil.copyfile(APPS / name, root / name)
    return fleet


def serve(fleet: Fleet, name: str, command: list[str], port: int) -> Host:
    """One host: `python -m <command>` with the host's own lock file."""
    env = fleet.env(name)
    del env["SCHEDULER_INSTANCE_NAME"]  # each worker's replica is named after its pid
    env.update(
        SCHEDULER_HOST_LOCK=str(fleet.root / f"{name}.lock"),  # Host.lock
        SCHEDULER_SHUTDOWN_GRACE=str(GRACE),
        SCHEDULER_HTTP_TOKEN=TOKEN,
        PYTHONPATH=str(fleet.root),
    )
    log_path = fleet.root / f"{name}.log"
    with open(log_path, "wb") as log:
        process = subprocess.Popen(
            [sys.executable, "-m", *command],
            cwd=fleet.root,
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,  # its own process group: killed whole if the test fails
        )
    return Host(name, process, port, log_path)


def uvicorn(fleet: Fleet, name: str) -> Host:
    port = free_port()
    command = ["uvicorn", "asgi_host:app", "--workers", str(WORKERS), "--port", str(port)]
    # uvicorn replaces a worker that does not answer its ping within 5 s: on a loaded
    # machine, a worker still importing.
    return serve(fleet, name, [*command, "--timeout-worker-healthcheck", "60"], port)


def gunicorn(fleet: Fleet, name: str, *options: str) -> Host:
    port = free_port()
    command = ["gunicorn", "-c", "gunicorn_host.py", "-w", str(WORKERS), "-b", f"127.0.0.1:{port}"]
    return serve(fleet, name, [*command, *options, "wsgi_host:create_app()"], port)


def ready(hosts: list[Host], sessions: Sessions, fleet: Fleet) -> None:
    """Every host serves with its 4 workers, one of them active; the jobs run."""
    for host in hosts:
        wait_for(
            lambda h=host: get(h.url("/scheduler/healthz"))[0] == 200 or h.process.poll(),
            WAIT,
            f"host {host.name} to serve",
        )
        assert host.process.poll() is None, host.log()
        whole(host, sessions)
    wait_for(fleet.ends, WAIT, "the first runs")


def whole(host: Host, sessions: Sessions) -> None:
    """The host's 4 workers have started their replicas: one active, 3 standing by (they
    announce themselves beside the host lock, as `scheduler status` reads them)."""
    wait_for(lambda: len(standbys(host.lock)) == WORKERS - 1, WAIT, f"{host.name}'s standbys")
    sessions.one_active(host)


def running_on(fleet: Fleet, pids: set[int], job: str | None = None) -> list[dict[str, Any]]:
    """The runs going now in these processes (started, not ended), oldest first."""
    ended = {e["run_id"] for e in fleet.ends()}
    return [
        e
        for e in fleet.starts()
        if e["pid"] in pids and e["run_id"] not in ended and job in (None, e["job"])
    ]


def pages_and_probes(host: Host, sessions: Sessions) -> None:
    """The page under the prefix, every link on it answered; /healthz 200 on each worker it
    reaches (all 4, as a rule): `ok` on the active one, `standby` on the others."""
    status, page, _ = get(host.url("/scheduler/"))
    assert status == 200, page
    links = set(HREF.findall(page))
    assert {"/scheduler/jobs/every_second", "/scheduler/jobs/every_three_seconds"} <= links
    local = {link.replace("&amp;", "&") for link in links if link.startswith("/")}
    assert all(link.startswith("/scheduler/") for link in local), local
    for link in sorted(local):
        assert get(host.url(link))[0] == 200, link
    assert get(host.url("/scheduler/api/status"))[0] == 200
    said: dict[int, set[str]] = {}
    deadline = time.monotonic() + 20
    while len(said) < WORKERS and time.monotonic() < deadline:
        status, body, pid = get(host.url("/scheduler/healthz"))
        assert status == 200, body
        said.setdefault(pid, set()).add(body)
    active = sessions.one_active(host)
    assert said.get(active, {"ok\n"}) == {"ok\n"}, said
    assert all(bodies == {"standby\n"} for pid, bodies in said.items() if pid != active), said
    assert len(said) >= 2, said  # the active worker and a standby at least
    print(f"{host.name}: {len(local)} links answered; /healthz of {len(said)} workers: {said}")


def kill_active(host: Host, sessions: Sessions, fleet: Fleet) -> tuple[int, int, float]:
    """SIGKILL of the host's active worker mid-run: another worker of the host takes over
    (its lock session up). Returns the killed worker, its successor, and when (time.time())."""
    victim = sessions.one_active(host)
    wait_for(lambda: running_on(fleet, {victim}), WAIT, f"a run on {host.name}'s active worker")
    killed, wall = time.monotonic(), time.time()
    os.kill(victim, signal.SIGKILL)
    wait_for(lambda: sessions.active(host) - {victim}, WAIT, f"another {host.name} worker active")
    took_over = sessions.first_active(host, victim, killed) - killed
    successor = sessions.one_active(host)
    print(f"{host.name}: SIGKILL of the active worker: {successor} active after {took_over:.2f} s")
    assert took_over < 10, took_over  # the promise is 1 s: generous, for a loaded machine
    again = {
        job: wait_for(
            lambda j=job: [e for e in fleet.starts() if e["job"] == j and tick(e) > wall],
            WAIT,
            f"a tick of {job} after the kill",
        )[0]
        for job in EVERY
    }
    print(
        f"{host.name}: the first ticks after the SIGKILL started after "
        + ", ".join(f"{e['at'] - wall:.2f} s ({job})" for job, e in again.items())
    )
    return victim, successor, wall


def tick(event: dict[str, Any]) -> float:
    return datetime.fromisoformat(event["tick"]).timestamp()


def first_runs(fleet: Fleet, pid: int, since: float) -> str:
    """When the worker `pid` first started a run of each job, in seconds after `since`."""
    firsts = {}
    for event in fleet.starts():
        if event["pid"] == pid and event["job"] not in firsts:
            firsts[event["job"]] = f"{event['at'] - since:.2f} s"
    return ", ".join(f"{job} after {after}" for job, after in firsts.items()) or "none"


def recycle(host: Host, sessions: Sessions) -> None:
    """Requests until max_requests has replaced the host's active worker: another worker of
    the host takes over. A few requests between two looks at the sessions: sent on while
    the worker exits, they would soon replace every other worker of the host too."""
    first = sessions.one_active(host)
    asked = 0
    deadline = time.monotonic() + WAIT
    while first in sessions.active(host) and time.monotonic() < deadline:
        for _ in range(3):
            status, body, _ = get(host.url("/"))
            assert status in (200, 0), body  # 0: the connection of a worker going away
            asked += 1
    wait_for(lambda: first not in host.workers(), WAIT, f"{host.name}'s worker {first} to exit")
    wait_for(lambda: sessions.active(host) - {first}, WAIT, f"another {host.name} worker active")
    stopped = sessions.last_active(host, first)
    took_over = sessions.first_active(host, first, stopped) - stopped
    print(
        f"{host.name}: max_requests replaced the active worker after {asked} requests;"
        f" worker {sessions.one_active(host)} active {took_over:.2f} s after it stopped"
    )


def terminate(hosts: list[Host], sessions: Sessions, fleet: Fleet, start: datetime) -> datetime:
    """SIGTERM to every master while a run asked for by a script (a bearer POST, answered
    JSON) goes on: it is told `stopping`, and each server exits 0 within shutdown_grace.
    Returns when the signals were sent, `WINDOW` after `start` at the earliest."""
    wait_for(lambda: datetime.now(UTC) - start > WINDOW, WAIT, "ticks enough to check")
    sessions.enter("act")
    bearer = {"Authorization": f"Bearer {TOKEN}"}
    asked = urllib.request.Request(
        hosts[0].url("/scheduler/jobs/until_stopped/run"), data=b"", headers=bearer
    )
    with urllib.request.urlopen(asked, timeout=30) as reply:
        outcome = json.loads(reply.read())
    assert outcome["done"] == "run" and outcome["page"].startswith("/scheduler/jobs/"), outcome
    (run,) = wait_for(
        lambda: [e for e in fleet.starts() if e["job"] == "until_stopped"], WAIT, "the run"
    )
    sessions.enter("term")
    started, sent = time.monotonic(), datetime.now(UTC)
    for host in hosts:
        host.process.send_signal(signal.SIGTERM)
    for host in hosts:
        code = host.process.wait(GRACE + 30)
        took = time.monotonic() - started
        print(f"{host.name}: SIGTERM: exited {code} after {took:.2f} s (shutdown_grace {GRACE} s)")
        assert code == 0, host.log()
        assert took < GRACE + 5, host.log()  # + what the server itself takes to stop
    (row,) = [r for r in fleet.ledger() if r["run_id"] == run["run_id"]]
    assert (row["told"], row["manual"]) == ("stopping", True), row
    return sent


def check_ticks(fleet: Fleet, start: datetime, end: datetime, killed: set[int]) -> None:
    """Inside [start, end] every tick of both jobs started once, no two runs of a job
    overlapped, and the ledger recorded each succeeded (or crashed: in a killed worker)."""
    evidence = fleet.evidence()
    for job, every in EVERY.items():
        first = int(start.timestamp()) // every * every + every
        ticks = range(first, int(end.timestamp()) + 1, every)
        window = [datetime.fromtimestamp(t, UTC) for t in ticks]
        assert len(window) >= 2, (job, start, end)
        assert_exactly_once(evidence, job, window, fleet.logs())
    overlaps = [e for e in evidence if e.get("overlap")]
    assert not overlaps, f"runs of one job overlapped: {overlaps}"
    for row in fleet.ledger():
        if start <= row["scheduled_at"] <= end and row["status"] != "succeeded":
            found = PID.search(str(row["instance"]))
            assert row["status"] == "crashed" and found and int(found.group(1)) in killed, row


def no_session_left(database_url: str, hosts: list[Host]) -> None:
    pids = {f"-{pid}" for host in hosts for pid in host.pids}

    def left() -> list[str]:
        with psycopg.connect(database_url, autocommit=True) as conn:
            names = conn.execute(
                "SELECT application_name FROM pg_stat_activity WHERE datname = current_database()"
            ).fetchall()
        return [name for (name,) in names if any(name.endswith(pid) for pid in pids)]

    wait_for(lambda: not left(), 20, "every session of the hosts closed")


@contextlib.contextmanager
def two_hosts(fleet: Fleet, hosts: list[Host]) -> Iterator[Sessions]:
    """The hosts ready, their sessions sampled; at the end, the sessions checked and every
    process of the hosts gone."""
    assert fleet.database_url
    try:
        with Sessions(fleet.database_url, hosts) as sessions:
            ready(hosts, sessions, fleet)
            yield sessions
            sessions.enter("end")
        sessions.check()
        no_session_left(fleet.database_url, hosts)
    finally:
        for host in hosts:
            host.kill()
            print(f"--- {host.name} ---\n{host.log()}")  # shown if the test failed


def test_fastapi_under_uvicorn_on_two_hosts(tmp_path, database_url):
    fleet = application(tmp_path, database_url, "asgi_host.py")
    with two_hosts(fleet, [uvicorn(fleet, "a"), uvicorn(fleet, "b")]) as sessions:
        a, start = sessions.hosts[0], datetime.now(UTC)
        sessions.enter("pages")
        pages_and_probes(a, sessions)
        sessions.enter("kill")
        killed, successor, at = kill_active(a, sessions, fleet)
        whole(a, sessions)  # uvicorn has replaced the killed worker
        end = terminate(sessions.hosts, sessions, fleet, start) - timedelta(seconds=1)
    check_ticks(fleet, start, end, {killed})  # on the other host, the ticks never stopped
    print(f"a: since the SIGKILL, runs on {successor}: {first_runs(fleet, successor, at)}")


def test_flask_under_gunicorn_on_two_hosts_recycling_workers(tmp_path, database_url):
    fleet = application(tmp_path, database_url, "wsgi_host.py", "gunicorn_host.py")
    # On the host with preload_app, each worker is replaced after 3 to 15 requests: seldom
    # all at once.
    recycling = ["--max-requests", "3", "--max-requests-jitter", "12", "--preload"]
    hosts = [gunicorn(fleet, "a", *recycling), gunicorn(fleet, "b")]
    with two_hosts(fleet, hosts) as sessions:
        start = datetime.now(UTC)
        sessions.enter("recycle")
        recycle(hosts[0], sessions)  # host b runs the ticks meanwhile
        sessions.enter("pages")
        pages_and_probes(hosts[1], sessions)
        whole(hosts[0], sessions)  # every worker replaced has started its replica
        end = terminate(hosts, sessions, fleet, start) - timedelta(seconds=1)
    check_ticks(fleet, start, end, set())
