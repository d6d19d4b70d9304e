"""The embedded backend: a SQLite ledger and `flock` files, for one host and no services.

The same protocol as PostgreSQL (see `scheduler.backends.base`), built from
the same ledger tables: a claim is the INSERT of the tick's row inside a
``BEGIN IMMEDIATE`` transaction, and a job's lock is an exclusive ``flock`` on
its own file, which the kernel releases the instant the process dies, as
PostgreSQL releases a dead session's advisory locks. Coordinates the
processes of one host only.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import logging
import os
import stat
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
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
from scheduler.statuses import CRASHED_LOST_LOCK, Status

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


class FileLocks:
    """Exclusive `flock`s on one file per job key; shared ones mark live instances.

    The folder is this user's alone (0700, files 0600, opened without following
    links): another local user must not be able to take or hold a job's lock.
    A lock is released with LOCK_UN before its descriptor is closed, so a child
    made with `fork` (multiprocessing) that inherited the descriptor cannot keep
    the lock after this process lets it go; forked children also close their
    copies at once.
    """

    def __init__(self, folder: Path, namespace: int) -> None:
        self.folder = folder
        self.namespace = namespace
        self._held: dict[int, int] = {}
        self._presence: int | None = None
        _ALL.add(self)

    def path(self, key: int) -> Path:
        return self.folder / f"{self.namespace}-{key}.lock"

    def make_folder(self) -> None:
        """The lock folders, this user's alone; refuse one that others could write to."""
        for folder in (self.folder, self.folder / "instances"):
            folder.mkdir(mode=0o700, parents=True, exist_ok=True)
            found = os.stat(folder, follow_symlinks=False)
            if not stat.S_ISDIR(found.st_mode) or found.st_uid != os.getuid():
                raise OSError(f"{folder}: not a folder of this user's; remove it")
            if found.st_mode & 0o022:
                raise OSError(
                    f"{folder}: other users may write to it (mode {found.st_mode & 0o777:o}): "
                    "any of them could hold a job's lock; remove it or chmod 700 it"
                )

    def try_lock(self, key: int) -> bool:
        if key in self._held:
            return False  # never stack: the gate asks only for keys it does not run
        fd = _open(self.path(key))
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
            _release(fd)

    def is_free(self, key: int) -> bool:
        """Probe without keeping the lock (status, and the crash sweep)."""
        if key in self._held:
            return False
        try:
            fd = _open(self.path(key), create=False)
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
        """Hold a shared lock on our presence file while we are up.

        A sweep of dead instances may unlink the file between our open and our
        flock; then we would hold a lock on a file nobody can see. So after the
        flock, check that the path is still our file, and start over if not.
        """
        path = self.folder / "instances" / f"{instance}.lock"
        while True:
            fd = _open(path)
            fcntl.flock(fd, fcntl.LOCK_SH)
            try:
                same = os.stat(path, follow_symlinks=False).st_ino == os.fstat(fd).st_ino
            except FileNotFoundError:
                same = False
            if same:
                self._presence = fd
                return
            _release(fd)

    def release_all(self) -> None:
        for key in list(self._held):
            self.unlock(key)
        if self._presence is not None:
            _release(self._presence)
            self._presence = None

    def live_instances(self) -> list[str]:
        folder = self.folder / "instances"
        live = []
        for path in sorted(folder.glob("*.lock")) if folder.is_dir() else []:
            try:
                fd = _open(path, create=False)
            except OSError:  # gone meanwhile, a dangling link, not ours
                continue
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                live.append(path.stem)
            else:
                path.unlink(missing_ok=True)  # under our exclusive lock: nobody holds it
            finally:
                os.close(fd)
        return live

    def _forget_after_fork(self) -> None:
        """In a forked child: these descriptors are the parent's, not ours."""
        for fd in [*self._held.values(), *([self._presence] if self._presence else [])]:
            with contextlib.suppress(OSError):
                os.close(fd)
        self._held.clear()
        self._presence = None


_ALL: weakref.WeakSet[FileLocks] = weakref.WeakSet()


def _forget_all_after_fork() -> None:
    for locks in list(_ALL):
        locks._forget_after_fork()


os.register_at_fork(after_in_child=_forget_all_after_fork)


def _open(path: Path, create: bool = True) -> int:
    flags = os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC | (os.O_CREAT if create else 0)
    return os.open(path, flags, 0o600)


def _release(fd: int) -> None:
    with contextlib.suppress(OSError):
        fcntl.flock(fd, fcntl.LOCK_UN)  # also for a forked child's copy of the descriptor
    os.close(fd)


@dataclass(frozen=True)
class _Tick:
    """A tick on its way through a claim, as `scheduler_tick` in postgres.sql."""

    request: ClaimRequest
    fate: str  # running, skipped, missed, held, lost, deferred
    run_id: int | None = None
    started_at: datetime | None = None
    holder: str | None = None
    holder_since: datetime | None = None

    @property
    def key(self) -> int:
        return self.request.key


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

    # -- the claim: the steps of scheduler_claim in postgres.sql, by the same names -------

    def claim(
        self, requests: Sequence[ClaimRequest], instance: str, capacity: int
    ) -> list[ClaimResult]:
        assert self._conn is not None, "not connected"
        conn = self._conn
        taken: list[int] = []
        try:
            with conn.begin():
                now = self.clock()
                ticks = self._choose(conn, requests, capacity, now)
                ticks = self._lock_manual(conn, ticks, taken)
                ticks = self._insert_ticks(conn, ticks, instance, now, taken)
                ticks = self._take_locks(ticks, taken)
                ticks = self._record_skips(conn, ticks)
                crashed = self._crash_stale(conn, ticks, now)
                streaks = self._skip_streaks(conn, ticks, instance, now)
        except BaseException:
            for key in taken:  # the rows were rolled back; so are the locks
                self.locks.unlock(key)
            raise
        return [self._result(t, crashed, streaks) for t in ticks]

    def _choose(
        self, conn: Connection, requests: Sequence[ClaimRequest], capacity: int, now: datetime
    ) -> list[_Tick]:
        t = ledger.ticks
        out, room = [], capacity
        for r in sorted(requests, key=lambda r: (r.scheduled_at, r.key)):
            late = now - r.scheduled_at > timedelta(seconds=r.grace_s)
            if r.intent is Intent.SKIP:
                fate = "skipped"
            elif r.intent is Intent.MANUAL:
                fate = "running"
            elif late:
                fate = "missed"
            elif conn.execute(
                select(t.c.job_key).where(t.c.job_key == r.key, t.c.scheduled_at == r.scheduled_at)
            ).first():
                fate = "lost"
            elif room > 0:
                fate, room = "running", room - 1
            else:
                fate = "deferred"  # no free worker for it in this batch
            out.append(_Tick(r, fate))
        return out

    def _lock_manual(self, conn: Connection, ticks: list[_Tick], taken: list[int]) -> list[_Tick]:
        t = ledger.ticks
        out = []
        for tick in ticks:
            if tick.request.intent is Intent.MANUAL:
                if self.locks.try_lock(tick.key):
                    taken.append(tick.key)
                else:
                    holder = conn.execute(
                        select(t.c.instance, t.c.started_at)
                        .where(t.c.job_key == tick.key, t.c.status == Status.RUNNING)
                        .order_by(t.c.scheduled_at.desc())
                        .limit(1)
                    ).first()
                    tick = replace(
                        tick,
                        fate="held",
                        holder=holder.instance if holder else None,
                        holder_since=holder.started_at if holder else None,
                    )
            out.append(tick)
        return out

    def _insert_ticks(
        self, conn: Connection, ticks: list[_Tick], instance: str, now: datetime, taken: list[int]
    ) -> list[_Tick]:
        out = []
        for tick in ticks:
            if tick.fate in ("running", "skipped", "missed"):
                r = tick.request
                run_id = self._next_run_id(conn) if tick.fate == "running" else None
                inserted = conn.execute(
                    insert(ledger.ticks)
                    .values(
                        job_key=r.key,
                        scheduled_at=r.scheduled_at,
                        job_name=r.name,
                        status=tick.fate,
                        instance=instance,
                        run_id=run_id,
                        started_at=now if run_id is not None else None,
                        manual=r.intent is Intent.MANUAL,
                    )
                    .on_conflict_do_nothing()
                ).rowcount
                if inserted:
                    tick = replace(tick, run_id=run_id, started_at=tick_time(now, run_id))
                else:
                    if r.intent is Intent.MANUAL:
                        self.locks.unlock(r.key)
                        taken.remove(r.key)
                    tick = replace(tick, fate="lost")
            out.append(tick)
        return out

    def _take_locks(self, ticks: list[_Tick], taken: list[int]) -> list[_Tick]:
        out = []
        for tick in ticks:
            if tick.fate == "running" and tick.request.intent is Intent.RUN:
                if self.locks.try_lock(tick.key):
                    taken.append(tick.key)
                else:
                    tick = replace(tick, fate="skipped")
            out.append(tick)
        return out

    def _record_skips(self, conn: Connection, ticks: list[_Tick]) -> list[_Tick]:
        t = ledger.ticks
        own = {(tick.key, tick.request.scheduled_at) for tick in ticks}
        out = []
        for tick in ticks:
            if tick.fate == "skipped":
                holder = next(
                    (
                        row
                        for row in conn.execute(
                            select(t.c.instance, t.c.started_at, t.c.scheduled_at)
                            .where(t.c.job_key == tick.key, t.c.status == Status.RUNNING)
                            .order_by(t.c.scheduled_at.desc())
                        )
                        if (tick.key, row.scheduled_at) not in own
                    ),
                    None,
                )
                conn.execute(
                    update(t)
                    .where(t.c.job_key == tick.key, t.c.scheduled_at == tick.request.scheduled_at)
                    .values(
                        status=Status.SKIPPED,
                        run_id=None,
                        started_at=None,
                        holder=holder.instance if holder else None,
                    )
                )
                tick = replace(
                    tick,
                    run_id=None,
                    started_at=None,
                    holder=holder.instance if holder else None,
                    holder_since=holder.started_at if holder else None,
                )
            out.append(tick)
        return out

    def _crash_stale(self, conn: Connection, ticks: list[_Tick], now: datetime) -> dict[int, int]:
        t = ledger.ticks
        crashed = {}
        for tick in ticks:
            if tick.fate == "running":
                crashed[tick.key] = conn.execute(
                    update(t)
                    .where(
                        t.c.job_key == tick.key,
                        t.c.status == Status.RUNNING,
                        t.c.scheduled_at != tick.request.scheduled_at,
                    )
                    .values(status=Status.CRASHED, finished_at=now, error=CRASHED_LOST_LOCK)
                ).rowcount
        return crashed

    def _skip_streaks(
        self, conn: Connection, ticks: list[_Tick], instance: str, now: datetime
    ) -> dict[tuple[int, datetime | None], tuple[int, bool, int | None]]:
        """(key, tick) -> (streak, alert, notice); (key, None) -> the streak a run ends."""
        j = ledger.jobs
        out: dict[tuple[int, datetime | None], tuple[int, bool, int | None]] = {}
        for key in sorted({t.key for t in ticks if t.fate in ("running", "skipped")}):
            mine = [t for t in ticks if t.key == key and t.fate in ("running", "skipped")]
            skipped = [t for t in mine if t.fate == "skipped"]
            ran = len(skipped) < len(mine)
            ensure_job(conn, key, mine[0].request.name, now)
            row = conn.execute(select(j).where(j.c.job_key == key)).one()
            before, alerted = row.consecutive_skips, row.skip_alerted
            threshold = min(t.request.skip_threshold for t in mine)
            after = 0 if ran else before + len(skipped)
            alerting = not alerted and not ran and after >= threshold
            conn.execute(
                update(j)
                .where(j.c.job_key == key)
                .values(
                    consecutive_skips=after,
                    overrun_skips=row.overrun_skips + len(skipped),
                    skip_alerted=alerted or alerting,
                )
            )
            if ran:
                out[(key, None)] = (before, False, None)
            for n, tick in enumerate(skipped, start=1):
                streak = before + n
                notice = None
                if alerting and streak == max(before + 1, threshold):
                    notice = raise_notice(
                        conn,
                        "job.skips_exceeded",
                        tick.request,
                        instance,
                        now,
                        consecutive_skips=streak,
                        threshold=threshold,
                        holder=tick.holder,
                        holder_since=iso(tick.holder_since),
                        running_s=(now - tick.holder_since).total_seconds()
                        if tick.holder_since
                        else None,
                    )
                out[(key, tick.request.scheduled_at)] = (streak, notice is not None, notice)
        return out

    @staticmethod
    def _result(
        tick: _Tick,
        crashed: dict[int, int],
        streaks: dict[tuple[int, datetime | None], tuple[int, bool, int | None]],
    ) -> ClaimResult:
        r = tick.request
        outcome = Outcome.RUN if tick.fate == "running" else Outcome(tick.fate)
        streak, alert, notice = streaks.get((r.key, r.scheduled_at)) or streaks.get(
            (r.key, None), (0, False, None)
        )
        if outcome is not Outcome.RUN and outcome is not Outcome.SKIPPED:
            streak, alert, notice = 0, False, None
        return ClaimResult(
            r.key,
            r.scheduled_at,
            outcome,
            tick.run_id,
            tick.started_at,
            tick.holder,
            tick.holder_since,
            streak,
            alert,
            crashed.get(r.key, 0) if outcome is Outcome.RUN else 0,
            () if notice is None else (notice,),
        )

    def _next_run_id(self, conn: Connection) -> int:
        c = ledger.counters
        value = conn.execute(
            update(c).where(c.c.name == "run_id").values(value=c.c.value + 1).returning(c.c.value)
        ).scalar_one()
        return int(value)

    # -- the finish: the steps of scheduler_finish in postgres.sql ------------------------

    def finish(self, requests: Sequence[FinishRequest]) -> list[FinishResult]:
        assert self._conn is not None, "not connected"
        conn = self._conn
        with conn.begin():
            now = self.clock()
            done = self._record_finishes(conn, requests, now)
            streaks = self._finish_streaks(conn, done, now)
        for r in requests:  # after the commit: whoever locks next sees the final rows
            if r.unlock:
                self.locks.unlock(r.key)
        return [
            FinishResult(
                r.key, r.scheduled_at, recorded or repeated, finished, *streaks.get(r.key, ())
            )
            for r, recorded, repeated, finished in done
        ]

    def _record_finishes(
        self, conn: Connection, requests: Sequence[FinishRequest], now: datetime
    ) -> list[tuple[FinishRequest, bool, bool, datetime | None]]:
        t = ledger.ticks
        out = []
        for r in sorted(requests, key=lambda r: (r.scheduled_at, r.key)):
            row = (t.c.job_key == r.key, t.c.scheduled_at == r.scheduled_at, t.c.run_id == r.run_id)
            recorded = (
                conn.execute(
                    update(t)
                    .where(*row, t.c.status == Status.RUNNING)
                    .values(
                        status=r.status,
                        finished_at=now,
                        error=r.error,
                        told=r.told,
                        duration_s=r.duration_s,
                    )
                ).rowcount
                == 1
            )
            finished = now if recorded else None
            repeated = False
            if not recorded:  # an earlier finish of this run may have been recorded already
                again = conn.execute(
                    select(t.c.finished_at).where(*row, t.c.status == r.status)
                ).first()
                repeated, finished = again is not None, again[0] if again else None
            out.append((r, recorded, repeated, finished))
        return out

    def _finish_streaks(
        self,
        conn: Connection,
        done: list[tuple[FinishRequest, bool, bool, datetime | None]],
        now: datetime,
    ) -> dict[int, tuple[int | None, bool, bool, bool, tuple[int, ...]]]:
        """key -> (failures, alert, recovered, skips_recovered, notices), in key order."""
        j = ledger.jobs
        out: dict[int, tuple[int | None, bool, bool, bool, tuple[int, ...]]] = {}
        for r, recorded, _, finished in sorted(done, key=lambda d: d[0].key):
            if not recorded or r.status not in (Status.SUCCEEDED, Status.FAILED):
                continue
            ensure_job(conn, r.key, self._job_name(conn, r), now)
            row = conn.execute(select(j).where(j.c.job_key == r.key)).one()
            kept_up = r.next_due is None or (finished is not None and finished <= r.next_due)
            failed = r.status == Status.FAILED
            failures = row.consecutive_failures + 1 if failed else 0
            fail_alert = failed and not row.fail_alerted and failures >= r.fail_threshold
            recovered = not failed and row.fail_alerted
            skips_recovered = kept_up and row.skip_alerted
            conn.execute(
                update(j)
                .where(j.c.job_key == r.key)
                .values(
                    consecutive_failures=failures,
                    fail_alerted=failed and (row.fail_alerted or fail_alert),
                    skip_alerted=row.skip_alerted and not kept_up,
                    overrun_skips=0 if kept_up else row.overrun_skips,
                )
            )
            request = ClaimRequest(r.key, row.job_name, r.scheduled_at, Intent.RUN, 0, 0)
            who = {"instance": self.instance, "run_id": r.run_id}
            due = [
                (
                    fail_alert,
                    "job.failures_exceeded",
                    {
                        "consecutive_failures": failures,
                        "threshold": r.fail_threshold,
                        **who,
                        "error": r.error,
                    },
                ),
                (
                    recovered,
                    "job.failures_recovered",
                    {
                        "consecutive_failures": row.consecutive_failures,
                        **who,
                    },
                ),
                (
                    skips_recovered,
                    "job.recovered",
                    {
                        "consecutive_skips": row.overrun_skips,
                        **who,
                    },
                ),
            ]
            notices = [
                raise_notice(conn, event, request, self.instance, now, **facts)
                for raised, event, facts in due
                if raised
            ]
            shown = failures if failed else row.consecutive_failures
            out[r.key] = (shown, fail_alert, recovered, skips_recovered, tuple(notices))
        return out

    @staticmethod
    def _job_name(conn: Connection, r: FinishRequest) -> str:
        t = ledger.ticks
        return str(
            conn.execute(
                select(t.c.job_name).where(t.c.job_key == r.key, t.c.scheduled_at == r.scheduled_at)
            ).scalar_one()
        )


def tick_time(now: datetime, run_id: int | None) -> datetime | None:
    return now if run_id is not None else None


def iso(value: datetime | None) -> str | None:
    return value.isoformat() if value else None


def ensure_job(conn: Connection, key: int, name: str, now: datetime) -> None:
    statement = insert(ledger.jobs).values(job_key=key, job_name=name, tracked_since=now)
    conn.execute(statement.on_conflict_do_nothing())


def raise_notice(
    conn: Connection, event: str, r: ClaimRequest, raised_by: str, now: datetime, **facts: Any
) -> int:
    """Write a notice to the outbox, leased to this replica (see `scheduler.notices`)."""
    return int(
        conn.execute(
            insert(ledger.notices)
            .values(
                event=event,
                job_key=r.key,
                job_name=r.name,
                scheduled_at=r.scheduled_at,
                facts=json.dumps(facts),
                raised_by=raised_by,
                raised_at=now,
                lease_by=raised_by,
                lease_until=now + ledger.NOTICE_LEASE,
                next_attempt_at=now,
            )
            .returning(ledger.notices.c.id)
        ).scalar_one()
    )
