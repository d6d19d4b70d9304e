"""The embedded backend: a SQLite ledger and `flock` files, for one host and no services.

The same protocol as PostgreSQL (see `scheduler.backends.base`), built from
the same ledger tables: a claim is the INSERT of the tick's row inside a
``BEGIN IMMEDIATE`` transaction, and a job's lock is an exclusive ``flock`` on
its own file, which the kernel releases the instant the process dies, as
PostgreSQL releases a dead session's advisory locks. Coordinates the
processes of one host only.
"""

from __future__ import annotations

import fcntl
import logging
import os
from collections.abc import Callable, Sequence
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

from sqlalchemy import Connection, Engine, create_engine, event, select, update
from sqlalchemy.dialects.sqlite import insert
from sqlalchemy.exc import SQLAlchemyError

from scheduler import ledger
from scheduler.backends.base import (
    ClaimRequest,
    ClaimResult,
    FinishRequest,
    FinishResult,
    Intent,
    Outcome,
    Unavailable,
)
from scheduler.backends.schema import migrate

log = logging.getLogger("scheduler.embedded")

CRASHED = "replica lost its lock before the run finished"


def sqlite_engine(path: Path) -> Engine:
    """SQLite in WAL mode, every transaction BEGIN IMMEDIATE: writers queue, readers don't."""
    engine = create_engine(f"sqlite:///{path}", connect_args={"timeout": 30})

    @event.listens_for(engine, "connect")
    def _on_connect(dbapi_connection: Any, _record: Any) -> None:
        dbapi_connection.isolation_level = None  # we issue BEGIN ourselves
        cursor = dbapi_connection.cursor()
        cursor.execute("PRAGMA journal_mode=WAL")
        cursor.execute("PRAGMA synchronous=NORMAL")
        cursor.execute("PRAGMA busy_timeout=30000")
        cursor.close()

    @event.listens_for(engine, "begin")
    def _on_begin(conn: Connection) -> None:
        conn.exec_driver_sql("BEGIN IMMEDIATE")

    return engine


class FileLocks:
    """Exclusive `flock`s on one file per job key; shared ones mark live instances."""

    def __init__(self, folder: Path, namespace: int) -> None:
        self.folder = folder
        self.namespace = namespace
        self._held: dict[int, int] = {}
        self._presence: int | None = None

    def path(self, key: int) -> Path:
        return self.folder / f"{self.namespace}-{key}.lock"

    def try_lock(self, key: int) -> bool:
        if key in self._held:
            return False  # never stack: the gate asks only for keys it does not run
        fd = os.open(self.path(key), os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            return False
        self._held[key] = fd
        return True

    def unlock(self, key: int) -> None:
        fd = self._held.pop(key, None)
        if fd is not None:
            os.close(fd)  # closing the last descriptor releases the flock

    def is_free(self, key: int) -> bool:
        """Probe without keeping the lock (status, and the crash sweep)."""
        if key in self._held:
            return False
        try:
            fd = os.open(self.path(key), os.O_RDWR)
        except FileNotFoundError:
            return True
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return False
        finally:
            os.close(fd)
        return True

    def join(self, instance: str) -> None:
        """Hold a shared lock on our presence file while we are up."""
        folder = self.folder / "instances"
        folder.mkdir(parents=True, exist_ok=True)
        fd = os.open(folder / f"{instance}.lock", os.O_RDWR | os.O_CREAT, 0o644)
        fcntl.flock(fd, fcntl.LOCK_SH)
        self._presence = fd

    def release_all(self) -> None:
        for key in list(self._held):
            self.unlock(key)
        if self._presence is not None:
            os.close(self._presence)
            self._presence = None

    def live_instances(self) -> list[str]:
        folder = self.folder / "instances"
        live = []
        for path in sorted(folder.glob("*.lock")) if folder.is_dir() else []:
            fd = os.open(path, os.O_RDWR)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                live.append(path.stem)
            else:
                path.unlink(missing_ok=True)
            finally:
                os.close(fd)
        return live


class EmbeddedBackend:
    """A replica's ledger and locks on this host's disk."""

    name = "embedded"

    def __init__(
        self,
        database: Path,
        *,
        instance: str,
        namespace: int,
        clock: Callable[[], datetime] = lambda: datetime.now(UTC),
    ) -> None:
        self.database = database
        self.instance = instance
        self.namespace = namespace
        self.clock = clock
        self.engine = sqlite_engine(database)
        self.locks = FileLocks(database.parent / f"{database.name}.locks", namespace)
        self._conn: Connection | None = None

    def connect(self) -> None:
        self.close()
        try:
            self.locks.folder.mkdir(parents=True, exist_ok=True)
            self._conn = self.engine.connect()
            self.locks.join(self.instance)
        except (OSError, SQLAlchemyError) as exc:
            raise Unavailable(str(exc)) from None

    def close(self) -> None:
        self.locks.release_all()
        conn, self._conn = self._conn, None
        if conn is not None:
            conn.close()

    def verify(self) -> None:
        return None  # no pooler between us and a file

    def migrate(self) -> int:
        self.database.parent.mkdir(parents=True, exist_ok=True)
        with self.engine.connect() as conn:
            return migrate(conn, self.namespace)

    def fileno(self) -> int | None:
        return None  # no server to say goodbye

    def abort(self) -> None:
        return None  # no call can hang on a dead server

    def check_alive(self) -> None:
        return None

    def heartbeat(self) -> datetime:
        return self.clock()

    # -- housekeeping ---------------------------------------------------------------------

    @property
    def ledger_engine(self) -> Engine:
        return self.engine

    def now_expression(self) -> datetime:
        return self.clock()

    def now(self, conn: Connection) -> datetime:
        return self.clock()

    def free_locks(self, conn: Connection, keys: Sequence[int]) -> set[int]:
        """Probe inside the caller's BEGIN IMMEDIATE: no claim can take a lock meanwhile."""
        return {key for key in keys if self.locks.is_free(key)}

    def live_instances(self, conn: Connection) -> list[dict[str, Any]]:
        return [
            {"name": name, "since": None, "address": "localhost", "pid": None}
            for name in self.locks.live_instances()
        ]

    def lock_holders(self, conn: Connection) -> dict[int, str]:
        """Held job locks; the holder's name comes from the ledger's running row."""
        held = {}
        for row in ledger.running(conn):
            if not self.locks.is_free(row.key) and row.instance:
                held[row.key] = row.instance
        return held

    def release(self, keys: Sequence[int]) -> None:
        for key in keys:
            self.locks.unlock(key)

    # -- the gate's two steps, as in postgres.sql ------------------------------------------

    def claim(
        self, requests: Sequence[ClaimRequest], instance: str, capacity: int
    ) -> list[ClaimResult]:
        assert self._conn is not None, "not connected"
        taken: list[int] = []
        ordered = sorted(requests, key=lambda r: (r.scheduled_at, r.key))
        try:
            with self._conn.begin():
                results = []
                won = 0
                for request in ordered:
                    result = self._claim_one(self._conn, request, instance, taken, won < capacity)
                    won += result.outcome is Outcome.RUN
                    results.append(result)
        except BaseException:
            for key in taken:  # the rows were rolled back; so are the locks
                self.locks.unlock(key)
            raise
        return results

    def _claim_one(
        self, conn: Connection, r: ClaimRequest, instance: str, taken: list[int], room: bool
    ) -> ClaimResult:
        t = ledger.ticks
        now = self.clock()
        if r.intent is Intent.MANUAL:
            if not self.locks.try_lock(r.key):
                holder, since = self._holder(conn, r.key, r.scheduled_at)
                return ClaimResult(
                    r.key, r.scheduled_at, Outcome.HELD, holder=holder, holder_since=since
                )
            taken.append(r.key)
            if not self._insert(conn, r, instance, now, manual=True):
                self.locks.unlock(r.key)
                taken.remove(r.key)
                return ClaimResult(r.key, r.scheduled_at, Outcome.LOST)
        elif now - r.scheduled_at > timedelta(seconds=r.grace_s):
            won = self._insert(conn, r, instance, None, status="missed")
            return ClaimResult(r.key, r.scheduled_at, Outcome.MISSED if won else Outcome.LOST)
        elif r.intent is Intent.RUN and not room:
            taken_by_other = conn.execute(
                select(t.c.job_key).where(t.c.job_key == r.key, t.c.scheduled_at == r.scheduled_at)
            ).first()
            return ClaimResult(
                r.key, r.scheduled_at, Outcome.LOST if taken_by_other else Outcome.DEFERRED
            )
        else:
            if not self._insert(conn, r, instance, now):
                return ClaimResult(r.key, r.scheduled_at, Outcome.LOST)
            if r.intent is not Intent.RUN or not self.locks.try_lock(r.key):
                holder, since = self._holder(conn, r.key, r.scheduled_at)
                conn.execute(
                    update(t)
                    .where(t.c.job_key == r.key, t.c.scheduled_at == r.scheduled_at)
                    .values(status="skipped", run_id=None, started_at=None, holder=holder)
                )
                skips = self._bump(
                    conn, r.key, r.name, "consecutive_skips", "skip_alerted", r.skip_threshold, now
                )
                return ClaimResult(
                    r.key,
                    r.scheduled_at,
                    Outcome.SKIPPED,
                    holder=holder,
                    holder_since=since,
                    consecutive_skips=skips,
                    alert=skips == r.skip_threshold,
                )
            taken.append(r.key)
        crashed = conn.execute(
            update(t)
            .where(
                t.c.job_key == r.key, t.c.status == "running", t.c.scheduled_at != r.scheduled_at
            )
            .values(status="crashed", finished_at=now, error=CRASHED)
        ).rowcount
        recovered, ended = self._reset(conn, r.key, "consecutive_skips", "skip_alerted")
        row = conn.execute(
            select(t.c.run_id, t.c.started_at).where(
                t.c.job_key == r.key, t.c.scheduled_at == r.scheduled_at
            )
        ).one()
        return ClaimResult(
            r.key,
            r.scheduled_at,
            Outcome.RUN,
            run_id=row.run_id,
            started_at=row.started_at,
            consecutive_skips=ended,
            recovered=recovered,
            crashed=crashed,
        )

    def _insert(
        self,
        conn: Connection,
        r: ClaimRequest,
        instance: str,
        now: datetime | None,
        *,
        status: str = "running",
        manual: bool = False,
    ) -> bool:
        run_id = self._next_run_id(conn) if status == "running" else None
        statement = (
            insert(ledger.ticks)
            .values(
                job_key=r.key,
                scheduled_at=r.scheduled_at,
                job_name=r.name,
                status=status,
                instance=instance,
                run_id=run_id,
                started_at=now,
                manual=manual,
            )
            .on_conflict_do_nothing()
        )
        return conn.execute(statement).rowcount == 1

    def _next_run_id(self, conn: Connection) -> int:
        c = ledger.counters
        value = conn.execute(
            update(c).where(c.c.name == "run_id").values(value=c.c.value + 1).returning(c.c.value)
        ).scalar_one()
        return int(value)

    def _holder(self, conn: Connection, key: int, tick: datetime) -> tuple[str | None, Any]:
        t = ledger.ticks
        row = conn.execute(
            select(t.c.instance, t.c.started_at)
            .where(t.c.job_key == key, t.c.status == "running", t.c.scheduled_at != tick)
            .order_by(t.c.scheduled_at.desc())
            .limit(1)
        ).first()
        return (row.instance, row.started_at) if row else (None, None)

    def _bump(
        self,
        conn: Connection,
        key: int,
        name: str,
        counter: str,
        flag: str,
        threshold: int,
        now: datetime,
    ) -> int:
        j = ledger.jobs
        statement = insert(j).values(
            job_key=key, job_name=name, tracked_since=now, **{counter: 1, flag: threshold <= 1}
        )
        statement = statement.on_conflict_do_update(
            index_elements=[j.c.job_key],
            set_={counter: j.c[counter] + 1, flag: j.c[flag] | (j.c[counter] + 1 >= threshold)},
        ).returning(j.c[counter])
        return int(conn.execute(statement).scalar_one())

    def _reset(self, conn: Connection, key: int, counter: str, flag: str) -> tuple[bool, int]:
        """End a streak: (whether it had alerted, how long it was)."""
        j = ledger.jobs
        row = conn.execute(select(j.c[counter], j.c[flag]).where(j.c.job_key == key)).first()
        if row is None or (not row[0] and not row[1]):
            return False, 0
        conn.execute(update(j).where(j.c.job_key == key).values(**{counter: 0, flag: False}))
        return bool(row[1]), int(row[0])

    def finish(self, requests: Sequence[FinishRequest]) -> list[FinishResult]:
        assert self._conn is not None, "not connected"
        t = ledger.ticks
        results = []
        with self._conn.begin():
            for r in requests:
                now = self.clock()
                recorded = (
                    self._conn.execute(
                        update(t)
                        .where(
                            t.c.job_key == r.key,
                            t.c.scheduled_at == r.scheduled_at,
                            t.c.run_id == r.run_id,
                            t.c.status == "running",
                        )
                        .values(status=r.status, finished_at=now, error=r.error)
                    ).rowcount
                    == 1
                )
                failures, alert, recovered = None, False, False
                if recorded and r.status == "failed":
                    name = self._conn.execute(
                        select(t.c.job_name).where(
                            t.c.job_key == r.key, t.c.scheduled_at == r.scheduled_at
                        )
                    ).scalar_one()
                    failures = self._bump(
                        self._conn,
                        r.key,
                        name,
                        "consecutive_failures",
                        "fail_alerted",
                        r.fail_threshold,
                        now,
                    )
                    alert = failures == r.fail_threshold
                elif recorded and r.status == "succeeded":
                    recovered, failures = self._reset(
                        self._conn, r.key, "consecutive_failures", "fail_alerted"
                    )
                results.append(
                    FinishResult(
                        r.key,
                        r.scheduled_at,
                        recorded,
                        now if recorded else None,
                        failures,
                        alert,
                        recovered,
                    )
                )
        for r in requests:  # after the commit: whoever locks next sees the final rows
            if r.unlock:
                self.locks.unlock(r.key)
        return results
