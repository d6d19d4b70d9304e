"""What the real-process soaks share: faults from outside, the logs, the counters.

`test_soak.py` and `test_soak_crossing.py` drive a fleet through faults; this
module holds the session that takes ledger rows from outside (`RowLocks`), the
reading of the replicas' logs and of the server's, and the accounting of a
window of ticks (`report`): each tick ran once or the ledger explains it.
"""

from __future__ import annotations

import contextlib
import os
import random
import re
import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import psycopg
from psycopg import sql

from tests.support import Fleet, parse_tick, wait_for, whole_seconds

HOLDER = "soak-row-locks"  # application_name of the session that holds rows

# Statuses that explain a tick nobody ran. `crashed` and `interrupted` rows may
# also have a run: it started once and was cut short.
NOT_RUN = ("skipped", "missed", "paused")
CUT_SHORT = ("crashed", "interrupted")


def restart(
    fleet: Fleet, name: str, clock_offset: str | None = None, env: dict[str, str] | None = None
) -> None:
    """Start the replica again, keeping its earlier log (a new start rewrites the file)."""
    replica = fleet.replicas[name]
    with open(f"{replica.log_path}.earlier", "a") as f:
        f.write(replica.log())
    fleet.start(name, clock_offset=clock_offset, env=env)


def logs(fleet: Fleet) -> list[str]:
    """Every line each replica logged, across its restarts."""
    lines = []
    for replica in fleet.replicas.values():
        earlier = Path(f"{replica.log_path}.earlier")
        text = (earlier.read_text(errors="replace") if earlier.exists() else "") + replica.log()
        lines += text.splitlines()
    return lines


def log_lines(fleet: Fleet, words: str) -> int:
    return sum(words in line for line in logs(fleet))


def sessions_lost(fleet: Fleet) -> dict[str, int]:
    """Lock sessions the replicas logged as lost, by reason.

    SIGSTOP and killed sessions lose them by design; a row lock held by
    another session should not (its wait is not a lost session).
    """
    reasons: Counter[str] = Counter()
    for line in logs(fleet):
        _, found, reason = line.partition("lock session lost: ")
        if found:
            reasons[reason.split("; lock_lost set on", 1)[0].strip()] += 1
    return dict(reasons.most_common())


class RowLocks:
    """An outside session that holds ledger rows FOR UPDATE now and then, in a thread.

    Its locks are taken with SKIP LOCKED: it never waits for a replica, so it
    is never part of a deadlock cycle; the replicas wait for it.
    """

    def __init__(
        self,
        database_url: str,
        rng: random.Random,
        keys: list[int],
        catching: tuple[int, str],
        clock: Callable[[], datetime] = lambda: datetime.now(UTC),
        every_table: bool = False,
    ) -> None:
        self.database_url = database_url
        self.rng = rng
        self.keys = keys
        self.catching = catching  # (key, name) of a `catch_up: all` job
        self.clock = clock  # the database's clock (it may be faked)
        self.every_table = every_table  # also rows of any ledger table, now and then
        self.faults: Counter[str] = Counter()
        self.timeline: list[tuple[str, str, str]] = []
        self.errors: list[str] = []
        self.not_found = 0  # times no `running` row was there to hold
        self.table_rows: Counter[str] = Counter()  # rows held, by table
        self.stopping = threading.Event()
        self.thread = threading.Thread(target=self._run, name=HOLDER, daemon=True)
        self.tables: list[str] = []

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
                    if self.every_table and self.rng.random() < 0.3:
                        self._hold_table(conn)
                    elif choice < 0.25:
                        self._hold_running(conn)
                    elif choice < 0.45:
                        self._hold_attempt(conn)
                    elif choice < 0.55:
                        self._hold_next_ticks(conn)
                    else:
                        self._hold_jobs(conn)
                except psycopg.Error as exc:
                    self.errors.append(f"{self.clock().isoformat()} {exc}".strip())
                    if conn is not None:
                        conn.close()
                    conn = None
        finally:
            if conn is not None:
                conn.close()

    def _hold_jobs(self, conn: psycopg.Connection) -> None:
        """A few jobs' state rows in a random order, or all of them, for 1-8 s."""
        if self.rng.random() < 0.25:
            wanted = sorted(self.keys)
        else:
            wanted = self.rng.sample(self.keys, self.rng.randint(1, 3))
        at = self.clock().isoformat()
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
            at = self.clock().isoformat()
            tick = pending[1].astimezone(UTC).isoformat()
            self.faults["attempt_row"] += 1
            self.timeline.append((at, "attempt_row", f"{pending[0]} {tick} {seconds:.1f}s"))
            self.stopping.wait(seconds)
        conn.rollback()

    def _hold_next_ticks(self, conn: psycopg.Connection) -> None:
        """Rows of the catching job's ticks 2-4 s ahead, inserted and not committed, for 1-4 s:
        their claims wait on them, then fail (and are tried again, or caught up)."""
        conn.execute("SET LOCAL lock_timeout = '200ms'")
        now = self.clock().replace(microsecond=0)
        key, name = self.catching
        ticks = [now + timedelta(seconds=n) for n in (2, 3, 4)]
        for tick in ticks:
            conn.execute(
                "INSERT INTO scheduler_ticks (job_key, scheduled_at, job_name, status)"
                " VALUES (%s, %s, %s, 'missed') ON CONFLICT DO NOTHING",
                (key, tick, name),
            )
        seconds = self.rng.uniform(1, 4)
        self.faults["next_tick_rows"] += 1
        self.timeline.append((now.isoformat(), "next_tick_rows", f"{name} {seconds:.1f}s"))
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
                at = self.clock().isoformat()
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

    def _hold_table(self, conn: psycopg.Connection) -> None:
        """Up to three rows of one ledger table, for 1-4 s (every table gets its turn)."""
        if not self.tables:
            self.tables = ledger_tables(conn)
            conn.rollback()
        table = self.tables[self.faults["table_rows"] % len(self.tables)]
        conn.execute("SET LOCAL lock_timeout = '200ms'")
        query = sql.SQL("SELECT 1 FROM {} LIMIT 3 FOR UPDATE SKIP LOCKED").format(
            sql.Identifier(table)
        )
        held = len(conn.execute(query).fetchall())
        self.faults["table_rows"] += 1
        if held:
            seconds = self.rng.uniform(1, 4)
            self.table_rows[table] += 1
            self.timeline.append((self.clock().isoformat(), "table_rows", f"{table} {held}"))
            self.stopping.wait(seconds)
        conn.rollback()


def ledger_tables(conn: psycopg.Connection) -> list[str]:
    """The ledger's tables in the current schema."""
    rows = conn.execute(
        "SELECT table_name FROM information_schema.tables"
        " WHERE table_schema = current_schema() AND table_name LIKE 'scheduler%'"
        " AND table_type = 'BASE TABLE' ORDER BY table_name"
    ).fetchall()
    return [name for (name,) in rows]


def deadlocks(database_url: str) -> int:
    """Deadlocks PostgreSQL has counted in the test database so far."""
    with psycopg.connect(database_url, autocommit=True) as conn:
        with contextlib.suppress(psycopg.errors.UndefinedFunction):  # before PostgreSQL 15
            conn.execute("SELECT pg_stat_force_next_flush()")
        row = conn.execute(
            "SELECT deadlocks FROM pg_stat_database WHERE datname = current_database()"
        ).fetchone()
    assert row is not None
    return int(row[0])


def wait_sessions_gone(database_url: str) -> None:
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


@dataclass(frozen=True)
class Expected:
    """What one job's schedule asks of the window, written from the docs, not the code.

    `due`: the tick is one of the schedule's. `maybe`: it may have run or not
    (a schedule being changed, between the first and the last replica's
    reload); it must not have run twice. `retried`: a tick may start once per attempt.
    """

    due: Callable[[datetime], bool]
    maybe: Callable[[datetime], bool] = lambda tick: False
    retried: bool = False


def every(seconds: int, retried: bool = False) -> Expected:
    """An interval schedule on the UTC grid."""
    return Expected(lambda tick: int(tick.timestamp()) % seconds == 0, retried=retried)


def account(
    fleet: Fleet, start: datetime, end: datetime, expected: dict[str, Expected]
) -> dict[str, Any]:
    """Every tick of the window, run once or explained by the ledger; the counters."""
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
    seen = Tally()
    for job, plan in expected.items():
        for tick in window:
            runs = started[(job, tick)]
            row = ledger.get((job, tick))
            if plan.due(tick):
                seen.ticks += 1
            elif runs or row is not None:
                if not plan.maybe(tick):
                    seen.unexplained.append((job, tick.isoformat(), "not scheduled"))
                    continue
            else:
                continue
            seen.judge(
                job, tick, runs, row, (job, tick) in twice or (runs > 1 and not plan.retried)
            )
    return {
        "window": [start.isoformat(), end.isoformat()],
        "ticks": seen.ticks,
        "retries_left_pending": seen.pending[:20],
        "ran_once": seen.outcome["ran_once"],
        "duplicates": len(seen.duplicates),
        "duplicate_detail": seen.duplicates[:20],
        "skipped": statuses["skipped"],
        "missed": statuses["missed"],
        "crashed": statuses["crashed"],
        "interrupted": statuses["interrupted"],
        "paused": statuses["paused"],
        "explained_without_run": {
            status: seen.outcome[f"{status}_without_run"] for status in NOT_RUN + CUT_SHORT
        },
        "cut_short_after_start": {
            status: seen.outcome[f"{status}_after_start"] for status in CUT_SHORT
        },
        "cut_short_detail": seen.cut_short[:20],
        "ledger_statuses": dict(statuses),
        "ran_but_ledger_says": seen.disagree[:20],
        "ran_but_ledger_says_count": len(seen.disagree),
        "unexplained_gaps": len(seen.unexplained) + len(seen.pending),
        "unexplained_by_status": dict(Counter(u[2] for u in seen.unexplained)),
        "unexplained": seen.unexplained[:20],
    }


@dataclass
class Tally:
    """What the window's ticks turned out to be."""

    ticks: int = 0
    outcome: Counter[str] = field(default_factory=Counter)
    duplicates: list[tuple[str, str, int]] = field(default_factory=list)
    unexplained: list[tuple[str, str, str]] = field(default_factory=list)
    disagree: list[tuple[str, str, str]] = field(default_factory=list)
    cut_short: list[tuple[str, ...]] = field(default_factory=list)
    pending: list[tuple[str, str]] = field(default_factory=list)

    def judge(
        self, job: str, tick: datetime, runs: int, row: dict[str, Any] | None, twice: bool
    ) -> None:
        status = row["status"] if row else None
        if row is not None and row.get("retry_at") is not None:
            self.pending.append((job, tick.isoformat()))
        if twice:
            self.duplicates.append((job, tick.isoformat(), runs))
        elif runs >= 1:
            self.outcome["ran_once"] += 1
            if status in CUT_SHORT:
                self.outcome[f"{status}_after_start"] += 1
            elif status not in ("succeeded", "failed"):
                self.disagree.append((job, tick.isoformat(), str(status)))
        elif status in NOT_RUN or status in CUT_SHORT:
            self.outcome[f"{status}_without_run"] += 1
            if status in CUT_SHORT and row is not None:
                self.cut_short.append(
                    (
                        job,
                        tick.isoformat(),
                        str(status),
                        str(row["instance"]),
                        str(row["started_at"]),
                        str(row["finished_at"]),
                    )
                )
        else:
            self.unexplained.append((job, tick.isoformat(), status or "no row"))


def summary(report: dict[str, Any]) -> str:
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
            f"  stray locks held in pg_locks with no running row: {report.get('stray_locks', '-')}",
            f"  exit codes: {report['exit_codes']}",
            "",
        ]
    )
