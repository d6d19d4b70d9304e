"""The embedded backend: a SQLite ledger and `flock` files, for one host and no services.

The same protocol as PostgreSQL (told in `scheduler.gate`), built from the
same ledger tables: a claim is the INSERT of the tick's row inside a
``BEGIN IMMEDIATE`` transaction (`embedded_steps.py`, step by step), and a
job's lock is an exclusive ``flock`` on its own file (`filelocks.py`).
Coordinates the processes of one host only.

On a shared host its files are watched by a keeper thread
(`embedded_keeper.py`), and kept this user's alone (`ledger_file.py`,
`filelocks.py`): what cannot be mended ends the process for its supervisor.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sqlite3
import time
from collections.abc import Callable, Collection, Iterator, Mapping, Sequence
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from sqlalchemy import Connection, Engine, create_engine, event, func, select
from sqlalchemy.exc import OperationalError, SQLAlchemyError

from scheduler.backends import filelocks
from scheduler.backends.base import (
    ClaimAnswer,
    ClaimRequest,
    Crashes,
    FinishRequest,
    FinishResult,
    Outcome,
    Recheck,
    Retries,
    SessionLost,
    Unavailable,
)
from scheduler.backends.embedded_keeper import Keeper
from scheduler.backends.embedded_steps import Steps, claimed
from scheduler.backends.filelocks import KEEP_EVERY, FileLocks
from scheduler.backends.ledger_file import JOURNAL_SIZE_LIMIT, LedgerFile, process_state
from scheduler.backends.schema import CURRENT_VERSION, migrate
from scheduler.errors import ConfigError
from scheduler.ledger import history, tables
from scheduler.ledger.run_now import RunRequest, take_run_requests

log = logging.getLogger("scheduler.embedded")

READ_ONLY = "scheduler_read_only"  # an execution option: a deferred BEGIN, no write lock


def sqlite_engine(
    file: LedgerFile,
    busy_timeout: float = 30.0,
    before: Callable[[], None] = lambda: None,
) -> Engine:
    """SQLite in WAL mode; writes BEGIN IMMEDIATE (writers queue), reads a deferred BEGIN.

    A read-only transaction (execution option READ_ONLY) takes no write lock:
    in WAL mode readers never wait for a writer. SQLite never makes the file
    (`mode=rw`): LedgerFile.create does, 0600.
    """

    def connect() -> sqlite3.Connection:
        return sqlite3.connect(file.uri(), uri=True, timeout=busy_timeout, check_same_thread=False)

    engine = create_engine(f"sqlite:///{file.path}", creator=connect)

    @event.listens_for(engine, "connect")
    def _on_connect(dbapi_connection: Any, _record: Any) -> None:
        dbapi_connection.isolation_level = None  # we issue BEGIN ourselves
        cursor = dbapi_connection.cursor()
        if file.empty():  # set before the first table; on a ledger in use it would wait
            cursor.execute("PRAGMA auto_vacuum=INCREMENTAL")
        cursor.execute("PRAGMA journal_mode=WAL")
        cursor.execute("PRAGMA synchronous=NORMAL")
        cursor.execute(f"PRAGMA busy_timeout={int(busy_timeout * 1000)}")
        cursor.execute(f"PRAGMA journal_size_limit={JOURNAL_SIZE_LIMIT}")
        cursor.close()

    @event.listens_for(engine, "before_cursor_execute")
    def _before(*_args: Any) -> None:
        before()  # every statement, on every connection: see EmbeddedBackend._intact

    @event.listens_for(engine, "begin")
    def _on_begin(conn: Connection) -> None:
        reading = conn.get_execution_options().get(READ_ONLY)
        conn.exec_driver_sql("BEGIN" if reading else "BEGIN IMMEDIATE")

    return engine


class LedgerBusy(Exception):
    """The ledger's write lock stayed held past busy_timeout: by whom, and how it is."""


def _exit_now(code: int) -> None:
    from scheduler.logs import stop_logging

    stop_logging()
    os._exit(code)


class EmbeddedBackend:
    """A replica's ledger and locks on this host's disk."""

    name = "embedded"
    needs_watchdog = False  # kernel locks: held while the process lives, gone when it dies
    notifies_requests = False  # no server: the gate looks for run-now requests itself
    # A claim is a local transaction, not a round trip: nothing to save by claiming ahead
    # (the gate's recheck works here too, for tests that turn it on).
    claims_ahead = False

    def __init__(
        self,
        database: Path,
        *,
        instance: str,
        namespace: int,
        clock: Callable[[], datetime] = lambda: datetime.now(UTC),
        monotonic: Callable[[], float] = time.monotonic,
        wall: Callable[[], float] = time.time,
        busy_timeout: float = 30.0,
        keep_every: float = KEEP_EVERY,
        exit: Callable[[int], None] = _exit_now,
    ) -> None:
        self.monotonic = monotonic
        self.database = database
        self.file = LedgerFile(database)
        self.instance = instance
        self.namespace = namespace
        self.clock = clock
        self.busy_timeout = busy_timeout
        self.engine = sqlite_engine(self.file, busy_timeout, before=self._intact)
        self.locks = FileLocks(
            database.parent / f"{database.name}.locks",
            namespace,
            instance,
            wall=wall,
            monotonic=monotonic,
        )
        self.keeper = Keeper(
            self.locks, self.file, monotonic=monotonic, wall=wall, every=keep_every, exit=exit
        )
        self._conn: Connection | None = None
        self._requests_looked = -1e9  # monotonic: when requests_pending last looked

    # -- the session ---------------------------------------------------------------------

    def connect(self) -> None:
        self.close()
        try:
            repaired = self.locks.make_folder()
            opened = self.file.identity()
            if opened is None:
                self.keeper.end(f"{self.database}: the ledger is gone (removed while running?)")
                raise Unavailable(f"{self.database}: the ledger is gone")
            self._conn = self.engine.connect()
            self.locks.join(self.instance)
        except (OSError, SQLAlchemyError) as exc:
            self.close()
            raise Unavailable(str(exc)) from None
        if repaired:
            log.warning("lock files made this user's alone: %s", "; ".join(repaired))
        self.keeper.start(opened)

    def close(self) -> None:
        self.keeper.stop()
        self.locks.release_all()
        conn, self._conn = self._conn, None
        if conn is not None:
            conn.close()

    def verify(self) -> None:
        """At start-up: what no retry mends ends it (ConfigError: exit 2, one line)."""
        self.file.refuse_unsafe()
        live = filelocks.presence_of(self.locks.folder, self.instance)
        if live is not None:
            raise ConfigError(
                f"instance_name {self.instance!r} is in use by a live replica"
                + (f" (pid {live['pid']})" if "pid" in live else "")
                + ": give each replica its own name (SCHEDULER_INSTANCE_NAME)"
            )
        try:
            repaired = self.locks.make_folder()
        except OSError as exc:
            raise ConfigError(str(exc)) from None
        if repaired:
            log.warning("lock files made this user's alone: %s", "; ".join(repaired))
        with self.locks.alone("ledger"):  # replicas starting together: one at a time
            self.file.set_aside_orphans()
            if self.file.mend_loose(self.monotonic):
                self.engine.dispose()  # no pooled connection may keep the old file
            if not filelocks.live_instances(self.locks.folder):
                self.file.incremental_vacuum_once(self.busy_timeout)

    def migrate(self) -> int:
        self.file.refuse_unreadable()
        self.file.set_aside_orphans()
        self.file.create()
        with self.engine.connect() as conn:  # a look first, which waits for no writer
            conn.execution_options(**{READ_ONLY: True})
            found: int | None = 0
            if conn.dialect.has_table(conn, tables.schema_version.name):
                found = conn.execute(select(func.max(tables.schema_version.c.version))).scalar()
        if (found or 0) >= CURRENT_VERSION:
            return int(found or 0)
        with self.engine.connect() as conn:
            return migrate(conn, self.namespace)

    def fileno(self) -> int | None:
        return self.keeper.fileno()

    def abort(self) -> None:
        return None  # no call can hang on a dead server

    def check_alive(self) -> None:
        self.keeper.check_alive()

    def _intact(self) -> None:
        """Before any ledger statement: a process whose descriptors a job closed ends
        here, before SQLite writes to a number that may name the job's own file now."""
        if not self.locks.presence_intact():
            self.keeper.descriptors_lost("its presence file's")
            raise SessionLost("this replica's descriptors were closed under it")

    def keep_once(self) -> bool:
        """One look of the keeper (its thread does this twice a second)."""
        return self.keeper.look()

    @property
    def broken(self) -> str | None:
        return self.keeper.broken

    def maintain(self) -> None:
        self.file.maintain()

    def heartbeat(self, expected: Collection[int] | None = None) -> list[int]:
        return [] if expected is None else self.release_strays(expected)

    def requests_pending(self) -> bool:
        """A look at the local file, at most once a second (no server to notify us)."""
        now = self.monotonic()
        if self._conn is None or now < self._requests_looked + 1.0:
            return False
        self._requests_looked = now
        return bool(
            self._peek("SELECT EXISTS (SELECT 1 FROM scheduler_requests WHERE taken_by IS NULL)")
        )

    def retry_due_in(self) -> float | None:
        """A look at the local file for the next retry of a job that is not paused."""
        if self._conn is None:
            return None
        due = self._peek(
            "SELECT min(retry_at) FROM scheduler_ticks t"
            " WHERE retry_at IS NOT NULL AND status = 'failed'"
            " AND NOT EXISTS (SELECT 1 FROM scheduler_pauses p WHERE p.job_key = t.job_key)"
        )
        if due is None:
            return None
        # The ledger keeps UTC without a zone in SQLite (scheduler.ledger.times.UTCDateTime).
        at = datetime.fromisoformat(str(due)).replace(tzinfo=UTC)
        return (at - self.clock()).total_seconds()

    def _peek(self, query: str) -> Any:
        """One value, read outside any transaction: no BEGIN IMMEDIATE, so no writer waits.
        Read to the end: a statement left unfinished would hold its snapshot, and with
        it the WAL, from shrinking."""
        assert self._conn is not None, "not connected"
        self._intact()
        driver = self._conn.connection.driver_connection
        assert driver is not None, "not connected"
        found = driver.execute(query).fetchall()
        return found[0][0] if found else None

    def claim_retries(
        self,
        instance: str,
        keys: Sequence[int],
        capacity: int,
        crashed: str,
        fail_thresholds: Sequence[int] | None = None,
    ) -> Retries:
        thresholds = dict(zip(keys, fail_thresholds or [3] * len(keys), strict=True))
        with self._steps(instance) as steps:
            return steps.claim_retries(keys, capacity, crashed, thresholds)

    def take_requests(self, instance: str, keys: Sequence[int]) -> list[RunRequest]:
        assert self._conn is not None, "not connected"
        with self._writing(), self._conn.begin():
            return take_run_requests(self._conn, instance, list(keys), self.clock())

    # -- housekeeping ---------------------------------------------------------------------

    @property
    def ledger_engine(self) -> Engine:
        return self.engine

    def now_expression(self) -> datetime:
        return self.clock()

    def now(self, conn: Connection) -> datetime:
        return self.clock()

    def free_locks(self, conn: Connection, keys: Sequence[int]) -> set[int]:
        """Probe inside the caller's BEGIN IMMEDIATE: no claim can take a lock meanwhile.
        Free means the running rows' processes are gone too (FileLocks.vacant)."""
        runs = _runs_by_key(conn)
        return {key for key in keys if self.locks.vacant(key, runs.get(key, set()))}

    def live_instances(self, conn: Connection) -> list[dict[str, Any]]:
        out = []
        for found in filelocks.live_instances(self.locks.folder):
            since = found.get("since")
            at = datetime.fromtimestamp(since, UTC) if isinstance(since, float | int) else None
            out.append(
                {
                    "name": found["name"],
                    "since": at,
                    "address": "localhost",
                    "pid": found.get("pid"),
                    "note": found.get("note"),
                }
            )
        return out

    def count_crashes(self, conn: Connection, crashes: Mapping[int, Crashes]) -> dict[int, int]:
        """The claim's own step (Steps.count_crashes), inside the caller's transaction."""
        return Steps(conn, self.locks, self.instance, self.clock()).count_crashes(crashes)

    def lock_holders(self, conn: Connection) -> dict[int, str]:
        """Held job locks, read without taking any; the holder's name is the ledger's."""
        rows = [row for row in history.running(conn) if row.instance]
        held = self.locks.held_now(row.key for row in rows)
        if held is None:  # /proc/locks cannot tell here: probe
            held = {row.key for row in rows if not self.locks.free_now(row.key)}
        return {row.key: row.instance for row in rows if row.key in held and row.instance}

    def notes(self) -> list[str]:
        """What `status` should say about the files under the fleet."""
        out = []
        if not self.locks.folder_present():
            out.append(
                f"the lock folder {self.locks.folder} is missing: a running replica makes it "
                "again within a second, so none runs, or none can (see their logs)"
            )
        out += [f"the ledger: {why}" for why in [self._write_lock_trouble()] if why]
        return out

    def held_keys(self) -> set[int]:
        return self.locks.held_keys()

    def release_strays(self, expected: Collection[int]) -> list[int]:
        strays = sorted(self.locks.held_keys() - set(expected))
        for key in strays:
            self.locks.give_back(key)
        return strays

    def shape(self) -> None:
        """No shares here (scheduler_share in postgres.sql says why): every replica offers
        every tick, and no tick is held as another replica's (gate/others.py)."""
        return None

    def untaken(self, ticks: Sequence[tuple[int, datetime]]) -> list[int]:
        """Never asked: with no shape, no tick is held as another replica's."""
        raise RuntimeError("the embedded backend shares no burst out: nothing to probe")

    # -- the claim and the finish: the steps of postgres.sql (see embedded_steps.py) -----

    def claim(self, requests: Sequence[ClaimRequest], instance: str, capacity: int) -> ClaimAnswer:
        with self._steps(instance) as steps:
            ticks = steps.choose(requests, capacity)
            ticks = steps.lock_manual(ticks)
            ticks = steps.insert_ticks(ticks)
            ticks = steps.take_locks(ticks)
            ticks = steps.record_skips(ticks)
            crashed = steps.crash_stale(ticks)
            streaks = steps.skip_streaks(ticks)
            alerts = steps.count_crashes(crashed)
        return claimed(ticks, crashed, streaks, alerts)

    @contextlib.contextmanager
    def _steps(self, instance: str) -> Iterator[Steps]:
        """One transaction of steps that take locks: rolled back, it gives them back too."""
        assert self._conn is not None, "not connected"
        conn = self._conn
        steps = Steps(conn, self.locks, instance, self.clock())
        try:
            with self._writing(), conn.begin():
                yield steps
        except BaseException:
            for key in steps.taken:  # the rows were rolled back; so are the locks
                self.locks.give_back(key)
            raise

    def finish(self, requests: Sequence[FinishRequest]) -> list[FinishResult]:
        assert self._conn is not None, "not connected"
        conn = self._conn
        with self._writing(), conn.begin():
            steps = Steps(conn, self.locks, self.instance, self.clock())
            done = steps.record_finishes(requests)
            streaks = steps.finish_streaks(done)
        for r in requests:  # after the commit: whoever locks next sees the final rows
            if r.unlock:
                self.locks.give_back(r.key)
        return [d.result(streaks.get(d.request.key)) for d in done]

    def recheck(self, runs: Sequence[Recheck]) -> list[Outcome]:
        assert self._conn is not None, "not connected"
        conn = self._conn
        with self._writing(), conn.begin():
            said = Steps(conn, self.locks, self.instance, self.clock()).recheck(runs)
        for run, outcome in zip(runs, said, strict=True):  # after the commit, as `finish`
            if outcome is not Outcome.RUN:
                self.locks.give_back(run.key)
        return said

    @contextlib.contextmanager
    def _writing(self) -> Iterator[None]:
        """A write that waited busy_timeout for the ledger's write lock says who holds it."""
        try:
            yield
        except OperationalError as exc:
            if "database is locked" not in str(exc.orig):
                raise
            trouble = self._write_lock_trouble() or "held in this process, or free again now"
            raise LedgerBusy(
                f"the ledger's write lock was held for over {self.busy_timeout:g} s: {trouble}"
            ) from None

    def _write_lock_trouble(self) -> str | None:
        """Who holds the ledger's write lock (another process), and how that process is."""
        pid = self.file.write_lock_holder()
        if pid is None:
            return None
        live = filelocks.live_instances(self.locks.folder)
        names = [i["name"] for i in live if i.get("pid") == pid]
        who = f"replica {names[0]} (pid {pid})" if names else f"process {pid}"
        state = process_state(pid)
        if not state.startswith("stopped"):
            return f"its write lock is held by {who}" + (f", {state}" if state else "")
        return (
            f"its write lock is held by {who}, {state}: every replica's claims and finishes "
            "wait until it resumes or ends (SIGCONT or end it)"
        )


def _runs_by_key(conn: Connection) -> dict[int, set[str]]:
    """Job key -> instances whose ledger rows say the job runs there."""
    out: dict[int, set[str]] = {}
    for row in history.running(conn):
        out.setdefault(row.key, set()).add(row.instance or "")
    return out
