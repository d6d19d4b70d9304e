"""Soak: a random fault every few seconds over thousands of ticks.

Not part of the default run (it takes minutes). Run it with

    .venv/bin/pytest -m soak -s -n 0

SOAK_TICKS (default 2000) sets how many ticks the chaos window holds at least
(8 jobs every second: 5000 ticks is about 11 minutes); SOAK_SEED replays the
faults' choices; SOAK_REPORT names a JSON file to write the figures to.

Besides eight jobs every second, `retrying` (every 2 s) fails its first attempt of a
tick half the time and has two retries, and `catching` (every second) has
`catch_up: all`: retries and catch-up passes cross every fault too.

Replica faults, one at a time and on one replica at a time (so at least one
replica is healthy): SIGKILL and restart, SIGSTOP for 1-10 s (beyond
holder_timeout too), every replica session killed, SIGTERM and restart,
restart with a clock skewed by up to ±0.45 s. Meanwhile, and overlapping with
them, an outside session holds ledger rows FOR UPDATE, as a report query or
an operator's open transaction would: a few jobs' `scheduler_jobs` rows (in
random order) or all of them for 1-8 s, longer than a lock-session statement
may wait, and now and then a `running` row of `scheduler_ticks` for a few
seconds; a pending retry's attempt row in `scheduler_attempts` (inserted, not
committed: the retry look that copies the attempt waits on it, then fails); and
the rows of `catching`'s next few ticks (inserted, not committed: those claims
fail the same way). That session takes its row locks with SKIP LOCKED or a
200 ms lock_timeout, so it never waits for long itself and can never be part of
a deadlock: any deadlock counted is one between the fleet's own sessions.

Afterwards, every tick in the window must have run exactly once (each attempt
of a retried tick once), or be explained by the ledger: `skipped` (its job's
previous run held the lock), `missed`, `crashed` or `interrupted` (a run or
claim cut down by a fault), or
`paused`. No retry may be left pending, and no replica may have found a stray
lock (a lock held with no run of its job: every failed claim gives its locks
back at once; the heartbeat's check logs and counts any it finds). No deadlock
may have happened in the test database, counted both
by `pg_stat_database.deadlocks` and by `deadlock detected` lines appended to
the server's log during the soak (when that log is readable here).
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import random
import re
import signal
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import psycopg
import pytest

from tests.support import Fleet, parse_tick, wait_for, whole_seconds

pytestmark = [pytest.mark.soak, pytest.mark.fleet]

QUICK_JOBS = 6  # quick_0 .. quick_5 in jobs/soak.py, keys 500 .. 505
NAMES = [f"quick_{i}" for i in range(QUICK_JOBS)] + ["wobbly_a", "wobbly_b", "retrying", "catching"]
KEYS = [500 + i for i in range(QUICK_JOBS)] + [520, 521, 530, 531]
SCHEDULES: dict[str, dict[str, Any]] = {
    **{name: {"interval": "1s"} for name in NAMES},
    "retrying": {"interval": "2s", "retries": 2, "retry_delay": "1s"},
    "catching": {
        "interval": "1s",
        "catch_up": "all",
        "catch_up_window": "20s",
        "catch_up_limit": 20,
    },
}
EVERY = {name: 2 if name == "retrying" else 1 for name in NAMES}  # seconds between ticks
REPLICAS = ("s1", "s2", "s3")
CALM_S = 35  # after the chaos: sweeps record what was missed
HOLDER = "soak-row-locks"  # application_name of the session that holds rows

# Statuses that explain a tick nobody ran. `crashed` and `interrupted` rows may
# also have a run: it started once and was cut short.
NOT_RUN = ("skipped", "missed", "paused")
CUT_SHORT = ("crashed", "interrupted")


def test_soak(tmp_path, database_url):
    target = int(os.environ.get("SOAK_TICKS", "2000"))
    seed = int(os.environ.get("SOAK_SEED", str(int(time.time()))))
    # The window starts 2 s after the chaos and ends 1 s before its end.
    per_second = sum(1 / every for every in EVERY.values())
    seconds = max(30, math.ceil(target / per_second) + 4)
    rng = random.Random(seed)
    fleet = Fleet(
        tmp_path,
        database_url,
        SCHEDULES,
        settings={"holder_timeout": 6, "misfire_grace": 5, "shutdown_grace": 5},
        job_files=["soak.py"],
    )
    server_log = ServerLog.find(database_url)
    deadlocks_before = _deadlocks(database_url)
    for name in REPLICAS:
        fleet.start(name)
    faults: Counter[str] = Counter()
    timeline: list[tuple[str, str, str]] = []
    rows = RowLocks(database_url, random.Random(seed + 1))
    try:
        fleet.wait_ready()
        start = datetime.now(UTC) + timedelta(seconds=2)
        deadline = time.monotonic() + seconds
        rows.start()
        while time.monotonic() < deadline:
            time.sleep(rng.uniform(2, 5))
            at = datetime.now(UTC).isoformat()
            fault, name = _inject(fleet, rng, database_url)
            faults[fault] += 1
            timeline.append((at, fault, name))
        end = datetime.now(UTC) - timedelta(seconds=1)
        rows.finish()
        for replica in fleet.replicas.values():
            replica.signal(signal.SIGCONT)
        for name in REPLICAS:
            if fleet.replicas[name].process.poll() is not None:
                _restart(fleet, name)
        time.sleep(CALM_S)
        codes = fleet.stop()
    finally:
        rows.finish()
        fleet.kill_all()
    _wait_sessions_gone(database_url)
    deadlocks_after = _deadlocks(database_url)
    report = {"seed": seed, **_report(fleet, start, end)}
    report["faults"] = dict(faults + rows.faults)
    report["deadlocks"] = {
        "pg_stat_database": deadlocks_after - deadlocks_before,
        "pg_stat_database_before_after": [deadlocks_before, deadlocks_after],
        "server_log": server_log.deadlocks(),
    }
    report["running_row_not_found"] = rows.not_found
    report["row_lock_errors"] = rows.errors[:20]
    report["lock_sessions_lost"] = _sessions_lost(fleet)
    report["locks_given_back"] = _log_lines(fleet, "gave back lock(s) of")
    report["stray_locks_released"] = _log_lines(fleet, "stray lock(s) released")
    report["exit_codes"] = codes
    print(_summary(report))
    print(json.dumps(report, indent=2, default=str))
    report["timeline"] = sorted(timeline + rows.timeline)
    if os.environ.get("SOAK_REPORT"):
        with open(os.environ["SOAK_REPORT"], "w") as f:
            json.dump(report, f, indent=2, default=str)
    assert set(codes.values()) == {0}, codes
    assert report["ticks"] >= target, report["ticks"]
    assert report["duplicates"] == 0, report["duplicate_detail"]
    assert report["unexplained_gaps"] == 0, report["unexplained"]
    assert report["stray_locks_released"] == 0, report["stray_locks_released"]
    assert report["deadlocks"]["pg_stat_database"] == 0, report["deadlocks"]
    logged = report["deadlocks"]["server_log"]["lines"]
    assert logged in (0, None), report["deadlocks"]


def _inject(fleet: Fleet, rng: random.Random, database_url: str) -> tuple[str, str]:
    name = rng.choice(REPLICAS)
    replica = fleet.replicas[name]
    fault = rng.choice(["kill", "freeze", "sessions", "term", "skew"])
    if fault == "sessions":
        with psycopg.connect(database_url, autocommit=True) as admin:
            admin.execute(
                "SELECT pg_terminate_backend(pid) FROM pg_stat_activity"
                " WHERE datname = current_database() AND pid <> pg_backend_pid()"
                " AND application_name <> %s",
                (HOLDER,),
            )
    elif fault == "freeze":
        replica.signal(signal.SIGSTOP)
        time.sleep(rng.uniform(1, 10))
        replica.signal(signal.SIGCONT)
    elif fault == "kill":
        replica.signal(signal.SIGKILL)
        replica.wait(10)
        time.sleep(rng.uniform(0.5, 3))
        _restart(fleet, name)
        fleet.wait_ready()
    else:
        replica.signal(signal.SIGTERM)
        replica.wait(30)
        offset = f"{rng.uniform(-0.45, 0.45):+.2f}s" if fault == "skew" else None
        _restart(fleet, name, clock_offset=offset)
        fleet.wait_ready()
    return fault, name


def _restart(fleet: Fleet, name: str, clock_offset: str | None = None) -> None:
    """Start the replica again, keeping its earlier log (a new start rewrites the file)."""
    replica = fleet.replicas[name]
    with open(f"{replica.log_path}.earlier", "a") as f:
        f.write(replica.log())
    fleet.start(name, clock_offset=clock_offset)


def _logs(fleet: Fleet) -> list[str]:
    """Every line each replica logged, across its restarts."""
    lines = []
    for replica in fleet.replicas.values():
        earlier = Path(f"{replica.log_path}.earlier")
        text = (earlier.read_text(errors="replace") if earlier.exists() else "") + replica.log()
        lines += text.splitlines()
    return lines


def _log_lines(fleet: Fleet, words: str) -> int:
    return sum(words in line for line in _logs(fleet))


def _sessions_lost(fleet: Fleet) -> dict[str, int]:
    """Lock sessions the replicas logged as lost, by reason.

    SIGSTOP and killed sessions lose them by design; a row lock held by
    another session should not (its wait is not a lost session).
    """
    reasons: Counter[str] = Counter()
    for line in _logs(fleet):
        _, found, reason = line.partition("lock session lost: ")
        if found:
            reasons[reason.split("; lock_lost set on", 1)[0].strip()] += 1
    return dict(reasons.most_common())


class RowLocks:
    """An outside session that holds ledger rows FOR UPDATE now and then, in a thread.

    Its locks are taken with SKIP LOCKED: it never waits for a replica, so it
    is never part of a deadlock cycle; the replicas wait for it.
    """

    def __init__(self, database_url: str, rng: random.Random) -> None:
        self.database_url = database_url
        self.rng = rng
        self.faults: Counter[str] = Counter()
        self.timeline: list[tuple[str, str, str]] = []
        self.errors: list[str] = []
        self.not_found = 0  # times no `running` row was there to hold
        self.stopping = threading.Event()
        self.thread = threading.Thread(target=self._run, name=HOLDER, daemon=True)

    def start(self) -> None:
        self.thread.start()

    def finish(self) -> None:
        self.stopping.set()
        if self.thread.is_alive():
            self.thread.join(30)

    def _run(self) -> None:
        conn: psycopg.Connection | None = None
        try:
            while not self.stopping.wait(self.rng.uniform(2, 6)):
                try:
                    if conn is None or conn.closed:
                        conn = psycopg.connect(self.database_url, application_name=HOLDER)
                    choice = self.rng.random()
                    if choice < 0.25:
                        self._hold_running(conn)
                    elif choice < 0.45:
                        self._hold_attempt(conn)
                    elif choice < 0.55:
                        self._hold_next_ticks(conn)
                    else:
                        self._hold_jobs(conn)
                except psycopg.Error as exc:
                    self.errors.append(f"{datetime.now(UTC).isoformat()} {exc}".strip())
                    if conn is not None:
                        conn.close()
                    conn = None
        finally:
            if conn is not None:
                conn.close()

    def _hold_jobs(self, conn: psycopg.Connection) -> None:
        """A few jobs' state rows in a random order, or all of them, for 1-8 s."""
        if self.rng.random() < 0.25:
            wanted = sorted(KEYS)
        else:
            wanted = self.rng.sample(KEYS, self.rng.randint(1, 3))
        at = datetime.now(UTC).isoformat()
        held = [
            key
            for (key,) in conn.execute(
                "SELECT job_key FROM scheduler_jobs WHERE job_key = ANY(%s)"
                " ORDER BY array_position(%s, job_key) FOR UPDATE SKIP LOCKED",
                (wanted, wanted),
            )
        ]
        seconds = self.rng.uniform(1, 8)
        if held:
            self.faults["row_locks"] += 1
            self.timeline.append((at, "row_locks", f"scheduler_jobs {held} {seconds:.1f}s"))
            self.stopping.wait(seconds)
        conn.rollback()

    def _hold_attempt(self, conn: psycopg.Connection) -> None:
        """A pending retry's attempt row, inserted and not committed, for 2-5 s: the retry
        look that copies that attempt waits on it, then fails (its lock given back)."""
        conn.execute("SET LOCAL lock_timeout = '200ms'")
        pending = conn.execute(
            "SELECT job_key, scheduled_at, attempt FROM scheduler_ticks"
            " WHERE status = 'failed' AND retry_at IS NOT NULL ORDER BY retry_at LIMIT 1"
        ).fetchone()
        if pending is None:
            conn.rollback()
            return
        inserted = conn.execute(
            "INSERT INTO scheduler_attempts (job_key, scheduled_at, attempt, status)"
            " VALUES (%s, %s, %s, 'failed') ON CONFLICT DO NOTHING",
            pending,
        ).rowcount
        if inserted:
            seconds = self.rng.uniform(2, 5)
            at = datetime.now(UTC).isoformat()
            tick = pending[1].astimezone(UTC).isoformat()
            self.faults["attempt_row"] += 1
            self.timeline.append((at, "attempt_row", f"{pending[0]} {tick} {seconds:.1f}s"))
            self.stopping.wait(seconds)
        conn.rollback()

    def _hold_next_ticks(self, conn: psycopg.Connection) -> None:
        """Rows of `catching`'s ticks 2-4 s ahead, inserted and not committed, for 1-4 s:
        their claims wait on them, then fail (and are tried again, or caught up)."""
        conn.execute("SET LOCAL lock_timeout = '200ms'")
        now = datetime.now(UTC).replace(microsecond=0)
        ticks = [now + timedelta(seconds=n) for n in (2, 3, 4)]
        for tick in ticks:
            conn.execute(
                "INSERT INTO scheduler_ticks (job_key, scheduled_at, job_name, status)"
                " VALUES (531, %s, 'catching', 'missed') ON CONFLICT DO NOTHING",
                (tick,),
            )
        seconds = self.rng.uniform(1, 4)
        self.faults["next_tick_rows"] += 1
        self.timeline.append((now.isoformat(), "next_tick_rows", f"catching {seconds:.1f}s"))
        self.stopping.wait(seconds)
        conn.rollback()

    def _hold_running(self, conn: psycopg.Connection) -> None:
        """A `running` tick's row for 2-5 s: its run's finish (and any claim marking it) waits."""
        deadline = time.monotonic() + 3
        while not self.stopping.is_set() and time.monotonic() < deadline:
            row = conn.execute(
                "SELECT job_name, scheduled_at FROM scheduler_ticks WHERE status = 'running'"
                " ORDER BY random() LIMIT 1 FOR UPDATE SKIP LOCKED"
            ).fetchone()
            if row is not None:
                seconds = self.rng.uniform(2, 5)
                at = datetime.now(UTC).isoformat()
                tick = row[1].astimezone(UTC).isoformat()
                self.faults["running_row"] += 1
                self.timeline.append((at, "running_row", f"{row[0]} {tick} {seconds:.1f}s"))
                self.stopping.wait(seconds)
                conn.rollback()
                return
            conn.rollback()
            time.sleep(0.1)
        if not self.stopping.is_set():
            self.not_found += 1


def _deadlocks(database_url: str) -> int:
    """Deadlocks PostgreSQL has counted in the test database so far."""
    with psycopg.connect(database_url, autocommit=True) as conn:
        with contextlib.suppress(psycopg.errors.UndefinedFunction):  # before PostgreSQL 15
            conn.execute("SELECT pg_stat_force_next_flush()")
        row = conn.execute(
            "SELECT deadlocks FROM pg_stat_database WHERE datname = current_database()"
        ).fetchone()
    assert row is not None
    return int(row[0])


def _wait_sessions_gone(database_url: str) -> None:
    """Every replica's backend has exited (and so flushed its statistics)."""

    def gone() -> bool:
        with psycopg.connect(database_url, autocommit=True) as conn:
            row = conn.execute(
                "SELECT count(*) FROM pg_stat_activity"
                " WHERE datname = current_database() AND pid <> pg_backend_pid()"
            ).fetchone()
        return row is not None and row[0] == 0

    wait_for(gone, 30, "the replicas' sessions to end", every=0.5)


@dataclass
class ServerLog:
    """The PostgreSQL server's log, from where it ended when the soak began."""

    database: str
    path: Path | None = None
    offset: int = 0
    by_database: bool = False  # log_line_prefix names the database (%d)
    note: str = ""
    looked_at: list[str] = field(default_factory=list)

    @classmethod
    def find(cls, database_url: str) -> ServerLog:
        with psycopg.connect(database_url, autocommit=True) as conn:
            database = str(_show(conn, "SELECT current_database()"))
            found = cls(database, by_database="%d" in str(_show(conn, "SHOW log_line_prefix")))
            address = _show(conn, "SELECT inet_server_addr()")
            data_directory = _show(conn, "SHOW data_directory")
            local = address is None or getattr(address, "is_loopback", False)
            if not local and not (data_directory and Path(str(data_directory)).is_dir()):
                found.note = f"the server ({address}) is not on this machine: log not readable"
                return found
            candidates = found._candidates(conn, data_directory)
        for path in candidates:
            found.looked_at.append(str(path))
            try:
                found.offset = path.stat().st_size
                with open(path, "rb"):
                    pass
            except OSError:
                continue
            found.path = path
            return found
        found.note = "no readable server log"
        return found

    @staticmethod
    def _candidates(conn: psycopg.Connection, data_directory: object) -> list[Path]:
        """The logging collector's current file, else Debian's per-cluster log."""
        paths = []
        current = _show(conn, "SELECT pg_current_logfile()")
        if current:
            path = Path(str(current))
            if not path.is_absolute() and data_directory:
                path = Path(str(data_directory)) / path
            paths.append(path)
        cluster = _show(conn, "SHOW cluster_name")
        folder = Path("/var/log/postgresql")
        if cluster:
            paths.append(folder / f"postgresql-{str(cluster).replace('/', '-')}.log")
        version = int(str(_show(conn, "SHOW server_version_num") or 0)) // 10000
        with contextlib.suppress(OSError):
            others = folder.glob(f"postgresql-{version}-*.log")
            paths += sorted(others, key=lambda p: p.stat().st_mtime, reverse=True)
        return list(dict.fromkeys(paths))

    def appended(self) -> str:
        assert self.path is not None
        with open(self.path, "rb") as f:
            f.seek(0, os.SEEK_END)
            if f.tell() < self.offset:  # truncated or replaced: read all of it
                self.note = "the log was truncated or replaced during the soak: read whole"
                self.offset = 0
            f.seek(self.offset)
            return f.read().decode(errors="replace")

    def deadlocks(self) -> dict[str, Any]:
        """`deadlock detected` lines written during the soak; lines: None when unreadable."""
        if self.path is None:
            return {"lines": None, "log": None, "note": self.note, "looked_at": self.looked_at}
        try:
            text = self.appended()
        except OSError as exc:
            return {"lines": None, "log": str(self.path), "note": f"unreadable: {exc}"}
        every = [line for line in text.splitlines() if "deadlock detected" in line]
        name = re.compile(rf"(?<![\w$]){re.escape(self.database)}(?![\w$])")
        ours = [line for line in every if name.search(line.split("deadlock detected", 1)[0])]
        counted = ours if self.by_database else every
        return {
            "lines": len(counted),
            "lines_any_database": len(every),
            "counted": (
                f"lines of database {self.database}"
                if self.by_database
                else "every line (log_line_prefix does not name the database)"
            ),
            "log": str(self.path),
            "bytes_read": len(text.encode()),
            "note": self.note,
            "first": counted[:5],
        }


def _show(conn: psycopg.Connection, query: str) -> object:
    """One value, or None when this role may not read it."""
    try:
        row = conn.execute(query).fetchone()
    except psycopg.Error:
        return None
    return None if row is None else row[0]


def _report(fleet: Fleet, start: datetime, end: datetime) -> dict[str, Any]:
    window = whole_seconds(start, end)
    first, last = window[0], window[-1]
    attempts = Counter(
        (e["job"], parse_tick(e["tick"]), e.get("attempt", 1)) for e in fleet.starts()
    )
    started = Counter((job, tick) for job, tick, _ in attempts.elements())
    twice = {(job, tick) for (job, tick, _), n in attempts.items() if n > 1}
    ledger = {
        (r["job_name"], r["scheduled_at"]): r
        for r in fleet.ledger()
        if first <= r["scheduled_at"] <= last
    }
    statuses = Counter(row["status"] for row in ledger.values())
    outcome: Counter[str] = Counter()
    duplicates: list[tuple[str, str, int]] = []
    unexplained: list[tuple[str, str, str]] = []
    disagree: list[tuple[str, str, str]] = []
    cut_short: list[tuple[str, ...]] = []
    pending: list[tuple[str, str]] = []
    ticks = 0
    for job in NAMES:
        for tick in window:
            if int(tick.timestamp()) % EVERY[job]:
                continue
            ticks += 1
            runs = started[(job, tick)]
            row = ledger.get((job, tick))
            status = row["status"] if row else None
            if row is not None and row.get("retry_at") is not None:
                pending.append((job, tick.isoformat()))
            if (job, tick) in twice or (runs > 1 and job != "retrying"):
                duplicates.append((job, tick.isoformat(), runs))
            elif runs >= 1:
                outcome["ran_once"] += 1
                if status in CUT_SHORT:
                    outcome[f"{status}_after_start"] += 1
                elif status not in ("succeeded", "failed"):
                    disagree.append((job, tick.isoformat(), str(status)))
            elif status in NOT_RUN or status in CUT_SHORT:
                outcome[f"{status}_without_run"] += 1
                if status in CUT_SHORT and row is not None:
                    cut_short.append(
                        (
                            job,
                            tick.isoformat(),
                            status,
                            str(row["instance"]),
                            str(row["started_at"]),
                            str(row["finished_at"]),
                        )
                    )
            else:
                unexplained.append((job, tick.isoformat(), status or "no row"))
    return {
        "window": [start.isoformat(), end.isoformat()],
        "ticks": ticks,
        "retries_left_pending": pending[:20],
        "ran_once": outcome["ran_once"],
        "duplicates": len(duplicates),
        "duplicate_detail": duplicates[:20],
        "skipped": statuses["skipped"],
        "missed": statuses["missed"],
        "crashed": statuses["crashed"],
        "interrupted": statuses["interrupted"],
        "paused": statuses["paused"],
        "explained_without_run": {
            status: outcome[f"{status}_without_run"] for status in NOT_RUN + CUT_SHORT
        },
        "cut_short_after_start": {status: outcome[f"{status}_after_start"] for status in CUT_SHORT},
        "cut_short_detail": cut_short[:20],
        "ledger_statuses": dict(statuses),
        "ran_but_ledger_says": disagree[:20],
        "ran_but_ledger_says_count": len(disagree),
        "unexplained_gaps": len(unexplained) + len(pending),
        "unexplained_by_status": dict(Counter(u[2] for u in unexplained)),
        "unexplained": unexplained[:20],
    }


def _summary(report: dict[str, Any]) -> str:
    log = report["deadlocks"]["server_log"]
    logged = (
        f"{log['lines']} ({log['counted']}; {log['lines_any_database']} in any database)"
        if log["lines"] is not None
        else f"not checked: {log['note']}"
    )
    faults = ", ".join(f"{k} {v}" for k, v in sorted(report["faults"].items()))
    explained = report["explained_without_run"]
    return "\n".join(
        [
            "",
            f"soak seed {report['seed']}: {report['ticks']} ticks in"
            f" {report['window'][0]} .. {report['window'][1]}",
            f"  faults: {faults}",
            f"  ran once {report['ran_once']}, duplicates {report['duplicates']},"
            f" unexplained gaps {report['unexplained_gaps']}",
            f"  ledger: skipped {report['skipped']}, missed {report['missed']},"
            f" crashed {report['crashed']}, interrupted {report['interrupted']},"
            f" paused {report['paused']}",
            "  not run, explained: " + ", ".join(f"{k} {v}" for k, v in explained.items()),
            f"  ran, ledger disagrees: {report['ran_but_ledger_says_count']}",
            f"  deadlocks: pg_stat_database {report['deadlocks']['pg_stat_database']},"
            f" server log {logged}",
            f"  lock sessions lost: {report['lock_sessions_lost']}",
            f"  locks given back after a failed claim: {report['locks_given_back']},"
            f" stray locks released by the heartbeat: {report['stray_locks_released']}",
            f"  exit codes: {report['exit_codes']}",
            "",
        ]
    )
