"""The embedded backend: a SQLite ledger and `flock` files, for one host and no services.

The same protocol as PostgreSQL (told in `scheduler.gate`), built from the
same ledger tables: a claim is the INSERT of the tick's row inside a
``BEGIN IMMEDIATE`` transaction (`embedded_steps.py`, step by step), and a
job's lock is an exclusive ``flock`` on its own file (`filelocks.py`).
Coordinates the processes of one host only.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable, Collection, Iterator, Sequence
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from sqlalchemy import Connection, Engine, create_engine, event
from sqlalchemy.exc import SQLAlchemyError

from scheduler import ledger
from scheduler.backends.base import (
    ClaimRequest,
    ClaimResult,
    FinishRequest,
    FinishResult,
    Retries,
    Unavailable,
)
from scheduler.backends.embedded_steps import Steps
from scheduler.backends.filelocks import FileLocks
from scheduler.backends.schema import migrate

log = logging.getLogger("scheduler.embedded")


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


class EmbeddedBackend:
    """A replica's ledger and locks on this host's disk."""

    name = "embedded"
    needs_watchdog = False  # kernel locks: held while the process lives, gone when it dies

    def __init__(
        self,
        database: Path,
        *,
        instance: str,
        namespace: int,
        clock: Callable[[], datetime] = lambda: datetime.now(UTC),
        monotonic: Callable[[], float] = time.monotonic,
    ) -> None:
        self.monotonic = monotonic
        self.database = database
        self.instance = instance
        self.namespace = namespace
        self.clock = clock
        self.engine = sqlite_engine(database)
        self.locks = FileLocks(database.parent / f"{database.name}.locks", namespace)
        self._conn: Connection | None = None
        self._requests_looked = -1e9  # monotonic: when requests_pending last looked

    def connect(self) -> None:
        self.close()
        try:
            self.locks.make_folder()
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
        # The ledger keeps UTC without a zone in SQLite (ledger.UTCDateTime).
        at = datetime.fromisoformat(str(due)).replace(tzinfo=UTC)
        return (at - self.clock()).total_seconds()

    def _peek(self, query: str) -> Any:
        """One value, read outside any transaction: no BEGIN IMMEDIATE, so no writer waits."""
        assert self._conn is not None, "not connected"
        driver = self._conn.connection.driver_connection
        found = driver.execute(query).fetchone()  # type: ignore[union-attr]
        return found[0] if found else None

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

    def take_requests(self, instance: str, keys: Sequence[int]) -> list[ledger.RunRequest]:
        assert self._conn is not None, "not connected"
        with self._conn.begin():
            return ledger.take_run_requests(self._conn, instance, list(keys), self.clock())

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

    def held_keys(self) -> set[int]:
        return self.locks.held()

    def release_strays(self, expected: Collection[int]) -> list[int]:
        strays = sorted(self.locks.held() - set(expected))
        for key in strays:
            self.locks.unlock(key)
        return strays

    # -- the claim and the finish: the steps of postgres.sql (see embedded_steps.py) -----

    def claim(
        self, requests: Sequence[ClaimRequest], instance: str, capacity: int
    ) -> list[ClaimResult]:
        with self._steps(instance) as steps:
            ticks = steps.choose(requests, capacity)
            ticks = steps.lock_manual(ticks)
            ticks = steps.insert_ticks(ticks)
            ticks = steps.take_locks(ticks)
            ticks = steps.record_skips(ticks)
            crashed = steps.crash_stale(ticks)
            streaks = steps.skip_streaks(ticks)
            alerts = steps.count_crashes(crashed)
        return [steps.result(t, crashed, streaks, alerts) for t in ticks]

    @contextlib.contextmanager
    def _steps(self, instance: str) -> Iterator[Steps]:
        """One transaction of steps that take locks: rolled back, it gives them back too."""
        assert self._conn is not None, "not connected"
        conn = self._conn
        steps = Steps(conn, self.locks, instance, self.clock())
        try:
            with conn.begin():
                yield steps
        except BaseException:
            for key in steps.taken:  # the rows were rolled back; so are the locks
                self.locks.unlock(key)
            raise

    def finish(self, requests: Sequence[FinishRequest]) -> list[FinishResult]:
        assert self._conn is not None, "not connected"
        conn = self._conn
        with conn.begin():
            steps = Steps(conn, self.locks, self.instance, self.clock())
            done = steps.record_finishes(requests)
            streaks = steps.finish_streaks(done)
        for r in requests:  # after the commit: whoever locks next sees the final rows
            if r.unlock:
                self.locks.unlock(r.key)
        return [
            FinishResult(
                r.key, r.scheduled_at, recorded or repeated, finished, *streaks.get(r.key, ())
            )
            for r, recorded, repeated, finished in done
        ]
