"""The soak that crosses everything: one fleet, every kind of fault, in one window.

Not part of the default run. Run it with

    SOAK_TICKS=20000 SOAK_SEED=1 .venv/bin/pytest -m soak -s -n 0 -p no:randomly \\
        tests/fleet/test_soak_crossing.py

SOAK_TICKS (default 1500) sets how many ticks the window holds at least (about
23 ticks a second: 20,000 ticks take about 17 minutes in all); SOAK_SEED replays the
faults' choices; SOAK_REPORT names a JSON file to write the figures to.

Three replicas over a primary and its synchronous standby of the test's own
(tests/fleet/replication.py), every process of them under libfaketime, one
offset for all (the database's clock judges misfire grace, so it is faked
too; tests/fleet/faketime_waits.c, compiled here, keeps the server's
timeouts right under libfaketime): the window crosses the autumn change in
Europe/Berlin (2026-10-25 01:00Z) up to 4 minutes in. Besides the faults of
test_soak.py (SIGKILL, SIGSTOP, killed sessions, SIGTERM, a skewed clock, one
at a time, every 2-5 s, and an outside session holding rows of the ledger,
now of any of its tables), at set points of the window, one at a time:

- a reload: config.yaml changes `reshaped` from every 2 s to every 1 s, and
  every replica gets SIGHUP;
- `scheduler pause pausable`, and later `scheduler resume pausable`;
- a partition: the traffic between s3 and both database nodes stalls (a
  proxy stops forwarding, no reset) for longer than holder_timeout;
- a failover: the primary stops at once and the standby is promoted.

Jobs: eighteen every second, one whose runs last up to 1.5 s, `retrying`
(retries), `catching` (`catch_up: all`), `timing` (a 1 s timeout its runs
overrun now and then, and a retry), `wall` (cron every 2 s in Europe/Berlin:
real time, through the repeated hour) and `fixed` (`*/5 0-59 2 * * *` in
Europe/Berlin: a specific time, so every 5 s in the first 02:xx and never in
the repeated one).

Afterwards every tick the schedules in force asked for ran once or is
explained by the ledger (as in test_soak.py); no run or row exists for a tick
no schedule had (`fixed` in the repeated hour, `reshaped`'s odd seconds before
the reload); `pausable` starts no tick while paused; no lock was held in
pg_locks with no running row behind it (sampled through the window, and at
the end); every replica exits 0, and none exited on its own.
"""

from __future__ import annotations

import json
import math
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Callable
from contextlib import contextmanager
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any
from zoneinfo import ZoneInfo

import psycopg
import pytest
import yaml

from tests import clusters
from tests.fleet.replication import Pair
from tests.fleet.soaking import (
    HOLDER,
    Expected,
    RowLocks,
    account,
    every,
    log_lines,
    restart,
    sessions_lost,
    summary,
)
from tests.support import Fleet, Proxy, faketime_library, wait_for

pytestmark = [pytest.mark.soak, pytest.mark.fleet]

BERLIN = ZoneInfo("Europe/Berlin")
CHANGE = datetime(2026, 10, 25, 1, tzinfo=UTC)  # 03:00 CEST becomes 02:00 CET
QUICK = [f"quick_{i}" for i in range(18)]  # keys 600 .. 617 in jobs/crossing.py
KEYS = [600 + i for i in range(18)] + [620, 630, 631, 632, 640, 641, 650, 651]
SCHEDULES: dict[str, dict[str, Any]] = {
    **{name: {"interval": "1s"} for name in QUICK},
    "wobbly": {"interval": "1s"},
    "retrying": {"interval": "2s", "retries": 2, "retry_delay": "1s"},
    "catching": {
        "interval": "1s",
        "catch_up": "all",
        "catch_up_window": "20s",
        "catch_up_limit": 20,
    },
    "timing": {"interval": "3s", "timeout": "1s", "retries": 1, "retry_delay": "1s"},
    "wall": {"cron": "*/2 * * * * *", "timezone": "Europe/Berlin"},
    "fixed": {"cron": "*/5 0-59 2 * * *", "timezone": "Europe/Berlin"},
    "reshaped": {"interval": "2s"},
    "pausable": {"interval": "1s"},
}
PER_SECOND = 18 + 1 + 1 / 2 + 1 + 1 / 3 + 1 / 2 + 1 + 1  # `fixed` aside; `reshaped` at 1 s
REPLICAS = ("s1", "s2", "s3")  # s3 reaches the database through proxies
NAMESPACE = 4747
# A shared machine of two cores runs three replicas and two servers here: a claim
# may wait seconds for the CPU, so the statement timeout (a third of holder_timeout)
# and the misfire grace are wider than in test_soak.py.
SETTINGS = {
    "holder_timeout": 12,
    "misfire_grace": 10,
    "shutdown_grace": 5,
    "lock_namespace": NAMESPACE,
    "max_workers": 30,  # every job due at once fits one replica's claim
}
# After the chaos: a tick of `catching` with no row is recorded missed by a sweep
# (every 30 s) once older than catch_up_window (20 s) and a margin.
CALM_S = 70


class Clock:
    """The faked wall clock every process of the soak shares: real time plus one offset."""

    def __init__(self, fake_start: datetime) -> None:
        self.offset = round((fake_start - datetime.now(UTC)).total_seconds())

    def now(self) -> datetime:
        return datetime.now(UTC) + timedelta(seconds=self.offset)

    def env(self, skew: float = 0.0) -> dict[str, str]:
        return {
            "LD_PRELOAD": faketime_library(),
            "FAKETIME": f"{self.offset + skew:+.2f}s",
            "FAKETIME_DONT_FAKE_MONOTONIC": "1",
            "TZ": "UTC",
        }

    def server_env(self, folder: Path) -> dict[str, str]:
        """For PostgreSQL: libfaketime, and before it the waits that keep timeouts right."""
        waits = build_waits(folder)
        library = Path(faketime_library()).with_name("libfaketime.so.1")
        return {**self.env(), "LD_PRELOAD": f"{waits} {library}"}


def build_waits(folder: Path) -> Path:
    """tests/fleet/faketime_waits.c, compiled (a C compiler is needed: CI fails without)."""
    compiler = shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        if os.environ.get("CI"):
            pytest.fail("the crossing soak needs a C compiler (apt-get install gcc)")
        pytest.skip("the crossing soak needs a C compiler (apt-get install gcc)")
    built = folder / "faketime_waits.so"
    source = Path(__file__).with_name("faketime_waits.c")
    subprocess.run(
        [compiler, "-shared", "-fPIC", "-O2", "-o", str(built), str(source), "-ldl"], check=True
    )
    built.chmod(0o755)
    return built


@contextmanager
def environment(extra: dict[str, str]):
    """`extra` in os.environ for what starts meanwhile (the clusters' pg_ctl)."""
    saved = {name: os.environ.get(name) for name in extra}
    os.environ.update(extra)
    try:
        yield
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


@pytest.fixture
def pair_under():
    """A synchronous primary and standby whose clocks read `clock` (`pair_under(clock, folder)`)."""
    made: list[Pair] = []

    def build(clock: Clock, folder: Path) -> Pair:
        reason = clusters.available()
        if reason and os.environ.get("CI"):
            pytest.fail(f"CI needs the PostgreSQL server binaries: {reason}")
        if reason:
            pytest.skip(f"cannot build a primary and a standby here: {reason}")
        with environment(clock.server_env(folder)):
            made.append(Pair(synchronous=True))
        return made[-1]

    yield build
    for pair in made:
        pair.remove()


def direct_wal(pair: Pair) -> None:
    """The standby streams from the primary itself, not through the test's proxy: every
    commit waits for it (synchronous), and this process has its own work to do."""
    assert pair.standby is not None
    with psycopg.connect(pair.standby.url(), autocommit=True) as conn:
        conn.execute(
            f"ALTER SYSTEM SET primary_conninfo = 'host=127.0.0.1 port={pair.primary.port}"
            " user=postgres application_name=standby'"
        )
        conn.execute("SELECT pg_reload_conf()")
    assert pair.link is not None
    pair.link.close()  # no way is left through it
    pair.wait_streaming()


def multi_host(ports: list[int], database: str) -> str:
    hosts = ",".join(f"127.0.0.1:{port}" for port in ports)
    return f"postgresql://postgres@{hosts}/{database}?target_session_attrs=read-write"


def test_soak_crossing(tmp_path, pair_under, request):
    target = int(os.environ.get("SOAK_TICKS", "1500"))
    seed = int(os.environ.get("SOAK_SEED", str(int(time.time()))))
    seconds = max(60, math.ceil(target / PER_SECOND * 1.02) + 4)  # `reshaped` starts at 2 s
    lead = min(240.0, 0.3 * seconds)  # the change falls this far into the window
    clock = Clock(CHANGE - timedelta(seconds=lead + 25))  # + the set-up
    rng = random.Random(seed)
    tools = Path(tempfile.mkdtemp(prefix="scheduler-soak-"))  # the server's user reads it
    tools.chmod(0o755)
    request.addfinalizer(lambda: shutil.rmtree(tools, ignore_errors=True))
    pair = pair_under(clock, tools)
    assert pair.standby is not None
    direct_wal(pair)
    with psycopg.connect(pair.primary.url(), autocommit=True) as conn:
        conn.execute("CREATE DATABASE soak")
    url = pair.url("soak")
    links = [Proxy("127.0.0.1", port) for port in (pair.primary.port, pair.standby.port)]
    fleet = Fleet(tmp_path, url, SCHEDULES, SETTINGS, job_files=["crossing.py"])
    soak = Crossing(fleet, pair, clock, rng, links)
    rows = RowLocks(url, random.Random(seed + 1), KEYS, (631, "catching"), clock.now, True)
    strays = StraySampler(url, soak.impaired_until)
    try:
        for name in REPLICAS:
            soak.start(name)
        fleet.wait_ready()
        start = clock.now() + timedelta(seconds=2)
        began = time.monotonic()
        rows.start()
        strays.start()
        soak.run(seconds, began)
        end = clock.now() - timedelta(seconds=1)
        rows.finish()
        soak.settle()
        time.sleep(CALM_S)
        strays.finish()
        final_strays = strays.persistent_now()
        soak.check_alive()
        codes = fleet.stop()
    finally:
        rows.finish()
        strays.finish()
        fleet.kill_all()
        for link in links:
            link.close()
    assert start < CHANGE < end, (start, CHANGE, end)
    expected = soak.expected()
    report = {"seed": seed, "faked_offset_s": clock.offset, **account(fleet, start, end, expected)}
    report["pause_violations"] = soak.pause_violations(fleet)
    report["pause_window"] = soak.pause
    report["unexplained_gaps"] += len(report["pause_violations"])
    report["faults"] = dict(soak.faults + rows.faults)
    report["ledger_tables_held"] = dict(rows.table_rows)
    report["row_lock_errors"] = rows.errors[:20]
    report["events"] = soak.events
    report["timeline"] = soak.timeline
    report["lock_sessions_lost"] = sessions_lost(fleet)
    report["locks_given_back"] = log_lines(fleet, "gave back lock(s) of")
    report["stray_locks_released"] = log_lines(fleet, "stray lock(s) released")
    report["stray_locks"] = len(strays.found) + len(final_strays)
    report["stray_lock_detail"] = [*strays.found.items()][:20] + final_strays[:20]
    report["stray_samples"] = strays.samples
    report["deadlocks"] = server_deadlocks(pair)
    report["unexpected_exits"] = soak.unexpected_exits
    report["missed_by_10s"] = missed_by_10s(fleet, start, end)
    report["exit_codes"] = codes
    print(summary(report))
    print(json.dumps(report, indent=2, default=str))
    if os.environ.get("SOAK_REPORT"):
        with open(os.environ["SOAK_REPORT"], "w") as f:
            json.dump(report, f, indent=2, default=str)
    assert set(codes.values()) == {0}, codes
    assert not soak.unexpected_exits, soak.unexpected_exits
    assert report["ticks"] >= target, report["ticks"]
    assert report["duplicates"] == 0, report["duplicate_detail"]
    assert report["unexplained_gaps"] == 0, (report["unexplained"], report["pause_violations"])
    assert report["stray_locks"] == 0, report["stray_lock_detail"]
    assert report["stray_locks_released"] == 0, report["stray_locks_released"]
    assert report["deadlocks"]["server_log"]["lines"] == 0, report["deadlocks"]


class Crossing:
    """The fleet and what is done to it: random faults, and the set events in their turn."""

    def __init__(
        self,
        fleet: Fleet,
        pair: Pair,
        clock: Clock,
        rng: random.Random,
        links: list[Proxy],
    ) -> None:
        self.fleet = fleet
        self.pair = pair
        self.clock = clock
        self.rng = rng
        self.links = links
        self.faults: Counter[str] = Counter()
        self.events: dict[str, str] = {}  # what happened when, by the faked clock
        self.unexpected_exits: list[tuple[str, int | None]] = []
        self.reload: tuple[datetime, datetime] | None = None
        self.impaired: dict[str, float] = {}  # replica -> when its last freeze/partition ended
        self.timeline: list[tuple[str, str, str]] = []  # (faked time, fault, replica)
        self.pause: list[datetime] = []  # pausing, paused, resuming, resumed

    def start(self, name: str, skew: float = 0.0) -> None:
        env = self.clock.env(skew)
        if name == "s3":
            ports = [link.port for link in self.links]
            env["SCHEDULER_DATABASE_URL"] = multi_host(ports, "soak")
        if name in self.fleet.replicas:
            restart(self.fleet, name, env=env)
        else:
            self.fleet.start(name, env=env)

    def run(self, seconds: float, began: float) -> None:
        planned: list[tuple[float, Callable[[], None]]] = [
            (0.15, self.reload_schedule),
            (0.22, self.pause_job),
            (0.30, self.resume_job),
            (0.45, self.partition),
            (0.62, self.fail_over),
        ]
        deadline = began + seconds
        while time.monotonic() < deadline:
            time.sleep(self.rng.uniform(2, 5))
            self.check_alive()
            if planned and time.monotonic() - began >= planned[0][0] * seconds:
                planned.pop(0)[1]()
            else:
                self.random_fault()
        for _, event in planned:  # a window too short for every event still has them all
            event()

    def check_alive(self) -> None:
        """A replica that exited without being told is counted, and started again."""
        for name, replica in self.fleet.replicas.items():
            code = replica.process.poll()
            if code is not None:
                self.unexpected_exits.append((name, code))
                self.start(name)
        self.fleet.wait_ready()

    def settle(self) -> None:
        for replica in self.fleet.replicas.values():
            replica.signal(signal.SIGCONT)
        self.check_alive()

    def impaired_until(self, name: str) -> float:
        """When the replica last stopped being frozen or cut off (monotonic; inf: still is)."""
        return self.impaired.get(name, 0.0)

    def note(self, what: str) -> None:
        self.events[what] = self.clock.now().isoformat()

    def random_fault(self) -> None:
        name = self.rng.choice(REPLICAS)
        replica = self.fleet.replicas[name]
        fault = self.rng.choice(["kill", "freeze", "sessions", "term", "skew"])
        self.faults[fault] += 1
        self.timeline.append((self.clock.now().isoformat(), fault, name))
        if fault == "sessions":
            self.kill_sessions()
        elif fault == "freeze":
            self.impaired[name] = math.inf
            replica.signal(signal.SIGSTOP)
            time.sleep(self.rng.uniform(1, 10))
            replica.signal(signal.SIGCONT)
            self.impaired[name] = time.monotonic()
        elif fault == "kill":
            replica.signal(signal.SIGKILL)
            replica.wait(10)
            time.sleep(self.rng.uniform(0.5, 3))
            self.start(name)
            self.fleet.wait_ready()
        else:
            replica.signal(signal.SIGTERM)
            code = replica.wait(30)
            if code != 0:
                self.unexpected_exits.append((f"{name} (SIGTERM)", code))
            skew = self.rng.uniform(-0.45, 0.45) if fault == "skew" else 0.0
            self.start(name, skew)
            self.fleet.wait_ready()

    def kill_sessions(self) -> None:
        try:
            with psycopg.connect(self.fleet.database_url, autocommit=True) as admin:
                admin.execute(
                    "SELECT pg_terminate_backend(pid) FROM pg_stat_activity"
                    " WHERE datname = current_database() AND pid <> pg_backend_pid()"
                    " AND application_name <> %s",
                    (HOLDER,),
                )
        except psycopg.OperationalError:  # no primary just now (a failover)
            self.faults["sessions_not_reached"] += 1

    def reload_schedule(self) -> None:
        """`reshaped` from every 2 s to every 1 s: config.yaml rewritten, SIGHUP to all."""
        begun = self.clock.now()
        path = self.fleet.root / "config.yaml"
        document = yaml.safe_load(path.read_text())
        document["jobs"]["reshaped"]["interval"] = "1s"
        path.write_text(yaml.safe_dump(document, sort_keys=False))
        for replica in self.fleet.replicas.values():
            replica.signal(signal.SIGHUP)
        wait_for(
            lambda: all("config.yaml reloaded" in r.log() for r in self.fleet.replicas.values()),
            30,
            "every replica to reload",
        )
        self.reload = (begun, self.clock.now())
        self.note("reloaded")
        self.faults["reload"] += 1

    def pause_job(self) -> None:
        self.pause = [self.clock.now()]
        done = self.cli("pause", "pausable", "--reason", "soak", "--by", "soak")
        assert done.returncode == 0, done.stdout + done.stderr
        self.pause.append(self.clock.now())
        self.note("paused")
        self.faults["pause"] += 1

    def resume_job(self) -> None:
        self.pause.append(self.clock.now())
        done = self.cli("resume", "pausable", "--by", "soak")
        assert done.returncode == 0, done.stdout + done.stderr
        self.pause.append(self.clock.now())
        self.note("resumed")
        self.faults["resume"] += 1

    def partition(self) -> None:
        """s3 and the database hear nothing from each other for 14-20 s; no reset."""
        self.impaired["s3"] = math.inf
        for link in self.links:
            link.cut()
        self.note("partitioned")
        time.sleep(self.rng.uniform(14, 20))
        for link in self.links:
            link.open.set()  # the network is back: connections that outlived it go on
        self.impaired["s3"] = time.monotonic()
        self.note("partition healed")
        self.faults["partition"] += 1

    def fail_over(self) -> None:
        self.note("primary stopped")
        self.pair.fail_over(detection_s=2)
        self.note("standby promoted")
        self.faults["failover"] += 1

    def cli(self, *args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, "-m", "scheduler", *args],
            cwd=self.fleet.root,
            env=self.fleet.env("cli", self.clock.env()),
            capture_output=True,
            text=True,
            timeout=60,
        )

    def expected(self) -> dict[str, Expected]:
        """What each job's schedule in force asked of the window (docs/changing.md,
        docs/time-zones.md), from the set events' times."""
        assert self.reload is not None
        first, last = self.reload[0] - timedelta(seconds=1), self.reload[1] + timedelta(seconds=3)
        plans = {name: every(1) for name in [*QUICK, "wobbly", "catching", "pausable"]}
        plans["retrying"] = every(2, retried=True)
        plans["timing"] = every(3, retried=True)
        plans["wall"] = Expected(lambda tick: tick.second % 2 == 0)
        plans["fixed"] = Expected(first_two_oclock_every_5s)
        plans["reshaped"] = Expected(
            lambda tick: tick.second % 2 == 0 or tick > last,
            maybe=lambda tick: first <= tick <= last,
        )
        return plans

    def pause_violations(self, fleet: Fleet) -> list[tuple[str, str]]:
        """Runs of `pausable` that started while it was paused (docs/changing.md: within a
        tick of the pause); `paused` rows of ticks outside the pause."""
        pausing, paused, resuming, resumed = self.pause
        grace = timedelta(seconds=SETTINGS["misfire_grace"])
        wrong = [
            ("ran while paused", e["tick"])
            for e in fleet.starts()
            if e["job"] == "pausable"
            and paused + timedelta(seconds=1) < datetime.fromisoformat(e["tick"]) < resuming
        ]
        wrong += [
            ("paused outside the pause", r["scheduled_at"].isoformat())
            for r in fleet.ledger("pausable")
            if r["status"] == "paused"
            and not pausing - grace <= r["scheduled_at"] <= resumed + timedelta(seconds=2)
        ]
        return wrong


def first_two_oclock_every_5s(tick: datetime) -> bool:
    """`*/5 0-59 2 * * *` in Europe/Berlin: a specific time runs at its first occurrence."""
    local = tick.astimezone(BERLIN)
    return local.hour == 2 and local.second % 5 == 0 and local.fold == 0


class StraySampler:
    """Locks held in pg_locks with no running row of their replica, sampled every 2 s.

    A claim in flight holds its lock before its row is committed (a claim that
    waits on rows held from outside, fails and is tried again holds it in each
    try), and a finish commits its row before the lock goes: only a session
    with nothing in flight counts. A replica frozen (SIGSTOP) or cut off in
    between stays so until it can act. So a lock counts as stray when it is
    seen so for HOLD_S while its replica could act: from the end of the
    replica's last freeze or partition (and beyond any statement's timeout).
    """

    HOLD_S = 10.0

    def __init__(self, url: str, impaired: Callable[[str], float]) -> None:
        self.url = url
        self.impaired = impaired  # replica -> monotonic time its last freeze/partition ended
        self.found: dict[tuple[str, int, int], str] = {}  # stray -> what its session did
        self.since: dict[tuple[str, int, int], float] = {}  # seen so, continuously, since
        self.samples = 0
        self.stopping = threading.Event()
        self.thread = threading.Thread(target=self._run, name="stray-locks", daemon=True)

    def start(self) -> None:
        self.thread.start()

    def finish(self) -> None:
        self.stopping.set()
        if self.thread.is_alive():
            self.thread.join(30)

    def _run(self) -> None:
        while not self.stopping.wait(2):
            self.sample()

    def sample(self) -> set[tuple[str, int, int]]:
        try:
            now = stray_locks(self.url)
        except psycopg.Error:  # no primary just now
            self.since.clear()
            return set()
        at = time.monotonic()
        self.samples += 1
        self.since = {lock: self.since.get(lock, at) for lock in now}
        for lock, since in self.since.items():
            if at - max(since, self.impaired(lock[0])) >= self.HOLD_S:
                self.found.setdefault(lock, session_state(self.url, lock[2]))
        return set(now)

    def persistent_now(self) -> list[tuple[str, int, int]]:
        """After the calm, with the fleet still up: strays seen so for HOLD_S."""
        self.since.clear()
        seen = []
        for _ in range(int(self.HOLD_S / 2) + 1):
            seen.append(self.sample())
            time.sleep(2)
        return sorted(set.intersection(*seen))


def session_state(url: str, pid: int) -> str:
    """What a session holding a stray lock was doing (for the report)."""
    try:
        with psycopg.connect(url, autocommit=True, connect_timeout=3) as conn:
            row = conn.execute(
                "SELECT state, wait_event, now() - state_change, left(query, 80)"
                " FROM pg_stat_activity WHERE pid = %s",
                (pid,),
            ).fetchone()
    except psycopg.Error as exc:
        return f"unknown: {exc}"
    return str(row)


def stray_locks(url: str) -> set[tuple[str, int, int]]:
    """(replica, job key, pid) of every job lock held with no running row of that replica,
    by a session with nothing in flight (idle, no transaction open: no claim under way)."""
    with psycopg.connect(url, autocommit=True, connect_timeout=3) as conn:
        held = conn.execute(
            "SELECT a.application_name, l.objid::integer, l.pid FROM pg_locks l"
            " JOIN pg_stat_activity a ON a.pid = l.pid"
            " WHERE l.locktype = 'advisory' AND l.objsubid = 2 AND l.classid = %s::oid"
            " AND l.mode = 'ExclusiveLock' AND l.granted AND l.objid <> 0"
            " AND a.state = 'idle'",
            (NAMESPACE,),
        ).fetchall()
        running = set(
            conn.execute(
                "SELECT instance, job_key FROM scheduler_ticks WHERE status = 'running'"
            ).fetchall()
        )
    return {(name, key, pid) for name, key, pid in held if (name, key) not in running}


def server_deadlocks(pair: Pair) -> dict[str, Any]:
    """`deadlock detected` lines in both nodes' server logs (the soak owns both nodes;
    pg_stat_database's counter does not survive the failover)."""
    counts = {}
    for node in (pair.primary, pair.standby):
        assert node is not None
        path = Path(node.base) / "log"
        text = path.read_text(errors="replace") if path.exists() else ""
        counts[node.base.name] = text.count("deadlock detected")
    lines = sum(counts.values())
    log = {"lines": lines, "lines_any_database": lines, "counted": "both nodes' logs"}
    return {"pg_stat_database": "-", "server_log": {**log, "by_node": counts}}


def missed_by_10s(fleet: Fleet, start: datetime, end: datetime) -> dict[str, int]:
    """How many ticks of the window were recorded missed, by 10 s of the faked clock."""
    counts: Counter[str] = Counter()
    for row in fleet.ledger():
        if row["status"] == "missed" and start <= row["scheduled_at"] <= end:
            at = row["scheduled_at"]
            counts[at.replace(second=at.second // 10 * 10).strftime("%H:%M:%S")] += 1
    return dict(sorted(counts.items()))
