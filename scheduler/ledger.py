"""The ledger's tables and the queries of housekeeping and the commands, in SQLAlchemy 2.

The tables are made by the migration files (scheduler/backends/migrations); the Table
objects here describe them for the queries, and a test holds the two together.

One row per (job key, scheduled tick): its primary key is what a claim
inserts (the protocol is told in `scheduler.gate`). Both backends
(PostgreSQL and the embedded SQLite file) use these tables and these queries.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from datetime import UTC, datetime, timedelta
from typing import Any, NamedTuple

from sqlalchemy import (
    BigInteger,
    Boolean,
    Column,
    Connection,
    DateTime,
    Float,
    Integer,
    MetaData,
    Row,
    Sequence,
    String,
    Table,
    Text,
    TypeDecorator,
    delete,
    desc,
    false,
    func,
    or_,
    select,
    tuple_,
    union_all,
    update,
)
from sqlalchemy.engine import Dialect

from scheduler.statuses import Status


class UTCDateTime(TypeDecorator[datetime]):
    """Aware UTC datetimes in and out, on both backends.

    SQLite stores datetimes as text without a zone; normalising to UTC on the
    way in keeps the claim's primary key (job_key, scheduled_at) exact.
    """

    impl = DateTime(timezone=True)
    cache_ok = True

    def process_bind_param(self, value: Any, dialect: Dialect) -> Any:
        if isinstance(value, datetime):
            if value.tzinfo is None:
                raise ValueError(f"naive datetime {value!r} in the ledger")
            value = value.astimezone(UTC)
            return value.replace(tzinfo=None) if dialect.name == "sqlite" else value
        return value

    def process_result_value(self, value: Any, dialect: Dialect) -> datetime | None:
        if value is None:
            return None
        stamp: datetime = value
        if stamp.tzinfo is None:
            return stamp.replace(tzinfo=UTC)
        return stamp.astimezone(UTC)


metadata = MetaData()

run_ids = Sequence("scheduler_run_id", metadata=metadata)

ticks = Table(
    "scheduler_ticks",
    metadata,
    Column("job_key", Integer, primary_key=True),
    Column("scheduled_at", UTCDateTime(), primary_key=True),
    Column("job_name", Text, nullable=False),
    Column("status", String(16), nullable=False),
    Column("instance", Text),  # the replica that claimed the tick
    Column("holder", Text),  # skipped ticks: the replica whose run held the lock
    Column("run_id", BigInteger),  # the fencing token of the run
    Column("started_at", UTCDateTime()),
    Column("finished_at", UTCDateTime()),
    Column("error", Text),
    Column("manual", Boolean, nullable=False, server_default=false()),
    Column("told", Text),  # what the run was told while it ran: stopping, lock_lost
    Column("duration_s", Float),  # the run's own duration, measured where it ran
    # Retries (job `retries`): the row holds the tick's latest attempt; earlier ones are
    # kept in scheduler_attempts. `retry_at`: set on a `failed` row whose next attempt is
    # due then; the attempt that takes it clears it.
    Column("attempt", Integer, nullable=False, server_default="1"),
    Column("retry_at", UTCDateTime()),
    # Run after the fleet came back (`catch_up: all`), later than its misfire grace.
    Column("caught_up", Boolean, nullable=False, server_default=false()),
)


# The earlier attempts of a tick that was retried (the tick's row holds the latest):
# copied here by the claim that starts the next attempt.
attempts = Table(
    "scheduler_attempts",
    metadata,
    Column("job_key", Integer, primary_key=True),
    Column("scheduled_at", UTCDateTime(), primary_key=True),
    Column("attempt", Integer, primary_key=True),
    Column("instance", Text),
    Column("run_id", BigInteger),
    Column("status", String(16), nullable=False),
    Column("started_at", UTCDateTime()),
    Column("finished_at", UTCDateTime()),
    Column("duration_s", Float),
    Column("error", Text),
    Column("told", Text),
)


jobs = Table(
    "scheduler_jobs",
    metadata,
    Column("job_key", Integer, primary_key=True),
    Column("job_name", Text, nullable=False),
    Column("consecutive_skips", Integer, nullable=False, server_default="0"),
    Column("skip_alerted", Boolean, nullable=False, server_default=false()),
    Column("consecutive_failures", Integer, nullable=False, server_default="0"),
    Column("fail_alerted", Boolean, nullable=False, server_default=false()),
    Column("schedule", Text),
    Column("tracked_since", UTCDateTime(), nullable=False),
    # Skipped ticks since the job last kept up (a run that ended before its next tick).
    Column("overrun_skips", Integer, nullable=False, server_default="0"),
    # Since when its live replicas run different schedules (see scheduler.fleet.agreement).
    Column("drift_since", UTCDateTime()),
    Column("drift_alerted", Boolean, nullable=False, server_default=false()),
)

# What each replica runs: every job it registered, under which name and schedule, since
# when. A schedule is in force from `since` until `until` (NULL: still in force; set when
# the replica changes the job's schedule (a reload, a restart with another config), or
# when a replica that is gone is superseded by one with another schedule). The rows a
# change ends are kept (until `retention_days`): which ticks were due is judged by the
# schedules in force at each tick (scheduler.fleet.due), never by today's.
registrations = Table(
    "scheduler_registrations",
    metadata,
    Column("instance", Text, primary_key=True),
    Column("job_key", Integer, primary_key=True),
    Column("job_name", Text, nullable=False),
    Column("schedule", Text),  # canonical (catalog.schedule_text); NULL: not scheduled
    Column("since", UTCDateTime(), primary_key=True),
    Column("until", UTCDateTime()),
)

# When each replica was last known to be alive: its housekeeping pass writes its row
# (one row per replica, one write per pass). A run found `crashed` lasted at least until
# then (the sweep records that much of it as its duration).
seen = Table(
    "scheduler_seen",
    metadata,
    Column("instance", Text, primary_key=True),
    Column("seen_at", UTCDateTime(), nullable=False),
)

# The outbox: a notice (an alert, a recovery) is written in the transaction that changes
# the state it announces, and delivered by whichever replica is alive, exactly once when
# all goes well, at least once when a replica dies while delivering (`id` is in the
# webhook body, so a receiver can tell a repeat). `lease_by` delivers it until
# `lease_until`; then any replica may take it over.
notices = Table(
    "scheduler_notices",
    metadata,
    Column("id", BigInteger().with_variant(Integer, "sqlite"), primary_key=True),
    Column("event", Text, nullable=False),
    Column("job_key", Integer, nullable=False),
    Column("job_name", Text, nullable=False),
    Column("scheduled_at", UTCDateTime()),
    Column("facts", Text, nullable=False),  # a JSON object: what the notice says
    Column("raised_by", Text, nullable=False),
    Column("raised_at", UTCDateTime(), nullable=False),
    Column("lease_by", Text),
    Column("lease_until", UTCDateTime()),
    Column("attempts", Integer, nullable=False, server_default="0"),
    Column("next_attempt_at", UTCDateTime(), nullable=False),
    Column("done_at", UTCDateTime()),  # delivered, or given up
    Column("outcome", Text),  # delivered, given_up
    sqlite_autoincrement=True,
)

# Jobs paused for the whole fleet: while a job has a row here, its ticks are recorded
# `paused` (by the claim, or by the sweep if no replica was up) and none runs; a manual
# trigger still runs it. Resuming deletes the row: the pause in force is all it keeps;
# the notices (`job.paused`, `job.resumed`) and the ticks' rows are the history.
pauses = Table(
    "scheduler_pauses",
    metadata,
    Column("job_key", Integer, primary_key=True),
    Column("job_name", Text, nullable=False),
    Column("paused_by", Text, nullable=False),
    Column("paused_at", UTCDateTime(), nullable=False),
    Column("reason", Text),
)

# Run-now requests (`scheduler trigger` without --here): a command asks, a live replica
# that runs the job takes the request and runs it through the gate as a manual tick,
# then writes its outcome here, where the command reads it (see scheduler.fleet.run_now).
run_requests = Table(
    "scheduler_requests",
    metadata,
    Column("id", BigInteger().with_variant(Integer, "sqlite"), primary_key=True),
    Column("job_key", Integer, nullable=False),
    Column("job_name", Text, nullable=False),
    Column("requested_by", Text, nullable=False),
    Column("requested_at", UTCDateTime(), nullable=False),
    Column("taken_by", Text),  # the replica that took it
    Column("taken_at", UTCDateTime()),
    Column("outcome", Text),  # run, held (the job's lock was held elsewhere), lost
    Column("status", Text),  # the run's: succeeded, failed, interrupted, crashed
    Column("run_id", BigInteger),
    Column("error", Text),
    Column("finished_at", UTCDateTime()),
    sqlite_autoincrement=True,
)

maintenance = Table(
    "scheduler_maintenance",
    metadata,
    Column("task", String(32), primary_key=True),
    Column("last_run_at", UTCDateTime(), nullable=False),
)

schema_version = Table(
    "scheduler_schema",
    metadata,
    Column("version", Integer, primary_key=True),
    Column("applied_at", UTCDateTime(), nullable=False),
)

# PostgreSQL only: which postgres.sql is installed (its sha256), by which version.
functions_installed = Table(
    "scheduler_functions",
    metadata,
    Column("sha256", Text, primary_key=True),
    Column("version", Integer, nullable=False),
    Column("installed_at", UTCDateTime(), nullable=False),
)

# Embedded mode only: SQLite has no sequences.
counters = Table(
    "scheduler_counters",
    metadata,
    Column("name", String(32), primary_key=True),
    Column("value", BigInteger, nullable=False),
)


@dataclass(frozen=True)
class TickRow:
    job: str
    key: int
    scheduled_at: datetime
    instance: str | None
    status: str
    started_at: datetime | None
    finished_at: datetime | None
    duration_s: float | None
    error: str | None
    run_id: int | None
    holder: str | None
    manual: bool
    told: str | None = None
    attempt: int = 1  # the row's attempt; earlier ones are in `attempts`, oldest first
    retry_at: datetime | None = None  # failed, with another attempt due then
    caught_up: bool = False
    attempts: tuple[dict[str, object], ...] = ()

    def as_json(self) -> dict[str, object]:
        return {
            "job": self.job,
            "key": self.key,
            "scheduled_at": iso(self.scheduled_at),
            "instance": self.instance,
            "status": self.status,
            "started_at": iso(self.started_at),
            "finished_at": iso(self.finished_at),
            "duration_s": self.duration_s,
            "error": self.error,
            "run_id": self.run_id,
            "holder": self.holder,
            "manual": self.manual,
            "told": self.told,
            "attempt": self.attempt,
            "retry_at": iso(self.retry_at),
            "caught_up": self.caught_up,
            "attempts": list(self.attempts),
        }


def iso(value: datetime | None) -> str | None:
    return None if value is None else value.isoformat()


def _row(row: Row[Any]) -> TickRow:
    m = row._mapping
    started, finished = m["started_at"], m["finished_at"]
    duration = m["duration_s"]  # the run's own, as measured where it ran
    if duration is None and started and finished:
        duration = (finished - started).total_seconds()
    return TickRow(
        job=m["job_name"],
        key=m["job_key"],
        scheduled_at=m["scheduled_at"],
        instance=m["instance"],
        status=m["status"],
        started_at=started,
        finished_at=finished,
        duration_s=round(duration, 6) if duration is not None else None,
        error=m["error"],
        run_id=m["run_id"],
        holder=m["holder"],
        manual=bool(m["manual"]),
        told=m["told"],
        attempt=m["attempt"],
        retry_at=m["retry_at"],
        caught_up=bool(m["caught_up"]),
    )


def _with_attempts(conn: Connection, rows: list[TickRow]) -> list[TickRow]:
    """Each retried tick with its earlier attempts (one query for the page of rows)."""
    retried = [(r.key, r.scheduled_at) for r in rows if r.attempt > 1]
    if not retried:
        return rows
    a = attempts
    query = (
        select(a).where(tuple_(a.c.job_key, a.c.scheduled_at).in_(retried)).order_by(a.c.attempt)
    )
    earlier: dict[tuple[int, datetime], list[dict[str, object]]] = {}
    for row in conn.execute(query):
        m = row._mapping
        earlier.setdefault((m["job_key"], m["scheduled_at"]), []).append(
            {
                "attempt": m["attempt"],
                "status": m["status"],
                "instance": m["instance"],
                "run_id": m["run_id"],
                "started_at": iso(m["started_at"]),
                "finished_at": iso(m["finished_at"]),
                "duration_s": m["duration_s"],
                "error": m["error"],
                "told": m["told"],
            }
        )
    return [
        replace(r, attempts=tuple(earlier.get((r.key, r.scheduled_at), ()))) if r.attempt > 1 else r
        for r in rows
    ]


def upsert(conn: Connection, table: Table) -> Any:
    """The dialect's INSERT, which knows ON CONFLICT (imported only for the dialect in use)."""
    if conn.dialect.name == "postgresql":
        from sqlalchemy.dialects import postgresql

        return postgresql.insert(table)
    from sqlalchemy.dialects import sqlite

    return sqlite.insert(table)


@dataclass(frozen=True)
class TickFilter:
    """Which ticks `history` shows: all of them by default, newest first."""

    key: int | None = None
    since: datetime | None = None  # scheduled at or after
    until: datetime | None = None  # scheduled at or before
    statuses: tuple[str, ...] = ()
    instance: str | None = None
    limit: int | None = 50


def history(conn: Connection, wanted: TickFilter) -> list[TickRow]:
    """Most recent ticks first; served by the primary key or the scheduled_at index."""
    query = select(ticks)
    if wanted.key is not None:
        query = query.where(ticks.c.job_key == wanted.key)
    if wanted.since is not None:
        query = query.where(ticks.c.scheduled_at >= wanted.since)
    if wanted.until is not None:
        query = query.where(ticks.c.scheduled_at <= wanted.until)
    if wanted.statuses:
        query = query.where(ticks.c.status.in_(wanted.statuses))
    if wanted.instance is not None:
        query = query.where(ticks.c.instance == wanted.instance)
    query = query.order_by(desc(ticks.c.scheduled_at), ticks.c.job_key)
    if wanted.limit is not None:
        query = query.limit(wanted.limit)
    return _with_attempts(conn, [_row(r) for r in conn.execute(query)])


LATEST_AT_ONCE = 100  # jobs whose latest row one statement reads


def latest_of(
    conn: Connection, keys: list[int], statuses: tuple[Status, ...]
) -> dict[int, TickRow]:
    """Each job's newest row with one of `statuses`: one statement per hundred jobs, each
    part a probe of the primary key from the newest end (never a scan of the ledger)."""
    found: dict[int, TickRow] = {}
    for start in range(0, len(keys), LATEST_AT_ONCE):
        parts = [
            select(ticks)
            .where(ticks.c.job_key == key, ticks.c.status.in_(statuses))
            .order_by(desc(ticks.c.scheduled_at))
            .limit(1)
            .subquery()
            for key in keys[start : start + LATEST_AT_ONCE]
        ]
        for row in conn.execute(union_all(*(select(part) for part in parts))):
            found[row.job_key] = _row(row)
    return found


def running(conn: Connection) -> list[TickRow]:
    query = select(ticks).where(ticks.c.status == Status.RUNNING).order_by(ticks.c.job_key)
    return [_row(r) for r in conn.execute(query)]


def job_states(conn: Connection) -> dict[int, dict[str, Any]]:
    return {r.job_key: dict(r._mapping) for r in conn.execute(select(jobs))}


def track_jobs(engine: Any, entries: list[tuple[int, str, str]], now: datetime) -> None:
    """Make sure every job has a state row (its streaks, its name and schedule as shown).

    `tracked_since` is when the job was first seen: the missed-tick sweep never
    looks before it (ticks from before a job existed were never due); when a
    schedule changes, the registrations say from when (see `registrations`).
    Unchanged rows are only read, never locked (claims update them all the
    time), and each new or changed row is written in a short transaction of
    its own, so a slow or frozen starting replica holds no job row for long.
    """
    if not entries:
        return
    with engine.connect() as conn:
        known = {
            row.job_key: (row.job_name, row.schedule)
            for row in conn.execute(select(jobs.c.job_key, jobs.c.job_name, jobs.c.schedule))
        }
    new = [
        {"job_key": key, "job_name": name, "schedule": schedule, "tracked_since": now}
        for key, name, schedule in sorted(entries)
        if key not in known
    ]
    if new:  # new rows lock nothing another transaction holds: one statement, in key order
        with engine.begin() as conn:
            statement = upsert(conn, jobs).on_conflict_do_nothing(index_elements=[jobs.c.job_key])
            conn.execute(statement, new)
    for key, name, schedule in sorted(entries):
        if key in known and known[key] != (name, schedule):
            with engine.begin() as conn:
                conn.execute(
                    update(jobs)
                    .where(
                        jobs.c.job_key == key,
                        or_(jobs.c.job_name != name, jobs.c.schedule.is_distinct_from(schedule)),
                    )
                    .values(job_name=name, schedule=schedule)
                )


def existing_ticks(
    conn: Connection, wanted: list[tuple[int, datetime]]
) -> set[tuple[int, datetime]]:
    """Which of these (job_key, scheduled_at) pairs already have a row: primary-key probes."""
    found: set[tuple[int, datetime]] = set()
    for start in range(0, len(wanted), 1000):
        chunk = wanted[start : start + 1000]
        query = select(ticks.c.job_key, ticks.c.scheduled_at).where(
            tuple_(ticks.c.job_key, ticks.c.scheduled_at).in_(chunk)
        )
        found.update((row.job_key, row.scheduled_at) for row in conn.execute(query))
    return found


def mark_crashed(
    conn: Connection,
    key: int,
    run_id: int,
    error: str,
    now: datetime,
    lasted: float | None = None,
) -> bool:
    """A running row whose lock is free: its replica died. Conditional, like every update.

    `lasted`: how long the run was known to be going (until its replica was last
    seen alive), kept as its duration: it ran at least that long.
    """
    result = conn.execute(
        update(ticks)
        .where(ticks.c.job_key == key, ticks.c.run_id == run_id, ticks.c.status == Status.RUNNING)
        .values(status=Status.CRASHED, finished_at=now, error=error, duration_s=lasted)
    )
    return result.rowcount == 1


@dataclass(frozen=True)
class PendingRetry:
    key: int
    job: str
    scheduled_at: datetime
    retry_at: datetime


def pending_retries(conn: Connection, due_before: datetime) -> list[PendingRetry]:
    """Failed ticks whose next attempt was due before `due_before` (the retry_at index)."""
    query = (
        select(ticks.c.job_key, ticks.c.job_name, ticks.c.scheduled_at, ticks.c.retry_at)
        .where(ticks.c.retry_at.is_not(None), ticks.c.retry_at < due_before)
        .order_by(ticks.c.scheduled_at, ticks.c.job_key)
    )
    return [PendingRetry(*row) for row in conn.execute(query)]


def end_retry(conn: Connection, retry: PendingRetry, why: str) -> bool:
    """The tick's failed attempt is its last: no next one (conditional: one not yet taken)."""
    result = conn.execute(
        update(ticks)
        .where(
            ticks.c.job_key == retry.key,
            ticks.c.scheduled_at == retry.scheduled_at,
            ticks.c.status == Status.FAILED,
            ticks.c.retry_at == retry.retry_at,
        )
        .values(
            retry_at=None,
            error=func.coalesce(ticks.c.error + "; ", "") + why,
        )
    )
    return result.rowcount == 1


# "missed" is not elected: its last_run_at is how far missed ticks have been recorded.
MAINTENANCE_TASKS = ("sweep", "prune", "missed")


class Election(NamedTuple):
    """A fleet chore this replica won: when it last ran (by anyone), and this run's time."""

    previous: datetime
    at: datetime  # the backend's clock as the election read it: the chore's "now"


def elect(conn: Connection, task: str, now: Any, every: float) -> Election | None:
    """One replica at a time does a fleet chore: whoever moves its clock forward first.

    `now` is the backend's clock (PostgreSQL: ``now()``, the same for every
    replica). Returns the election if this replica won, else None.
    Call inside a transaction: a concurrent loser's update finds the row moved.
    """
    previous = conn.execute(
        select(maintenance.c.last_run_at).where(maintenance.c.task == task)
    ).scalar_one()
    row = conn.execute(
        update(maintenance)
        .where(
            maintenance.c.task == task,
            maintenance.c.last_run_at <= now - timedelta(seconds=every),
        )
        .values(last_run_at=now)
        .returning(maintenance.c.last_run_at)
    ).first()
    return Election(previous, row.last_run_at) if row else None


def missed_watermark(conn: Connection) -> datetime:
    """How far the sweep has recorded missed ticks; the row stays locked until the commit,
    which also moves it (`set_missed_watermark`): a sweep cut short moves nothing."""
    query = select(maintenance.c.last_run_at).where(maintenance.c.task == "missed")
    found: datetime = conn.execute(query.with_for_update()).scalar_one()
    return found


def set_missed_watermark(conn: Connection, until: datetime) -> None:
    conn.execute(
        update(maintenance).where(maintenance.c.task == "missed").values(last_run_at=until)
    )


def record_missed(
    conn: Connection,
    missing: list[tuple[int, str, datetime]],
    instance: str,
    paused: dict[int, datetime] | None = None,
) -> int:
    """Rows for ticks nobody claimed, in the common order; a tick that has a row keeps it.

    A tick of a job paused (`paused`: key -> since when) at that tick is recorded
    `paused`, not `missed`: nobody was meant to run it. Returns the missed ones recorded.
    """
    if not missing:
        return 0
    paused = paused or {}
    statement = (
        upsert(conn, ticks)
        .on_conflict_do_nothing(index_elements=[ticks.c.job_key, ticks.c.scheduled_at])
        .returning(ticks.c.status)
    )
    rows = [
        {
            "job_key": key,
            "scheduled_at": tick,
            "job_name": name,
            "status": Status.PAUSED if key in paused and tick >= paused[key] else Status.MISSED,
            "instance": instance,
        }
        for key, name, tick in missing
    ]
    return sum(1 for row in conn.execute(statement, rows) if row.status == Status.MISSED)


def set_drift(conn: Connection, key: int, since: datetime | None, alerted: bool) -> None:
    conn.execute(
        update(jobs).where(jobs.c.job_key == key).values(drift_since=since, drift_alerted=alerted)
    )


def paused_since(conn: Connection) -> dict[int, datetime]:
    """The jobs paused now, and since when (see `scheduler.fleet.pauses`)."""
    return {
        r.job_key: r.paused_at for r in conn.execute(select(pauses.c.job_key, pauses.c.paused_at))
    }


def prune_batch(conn: Connection, older_than: datetime, batch: int = 5000) -> int:
    """Delete up to about `batch` of the oldest finished rows before `older_than`.

    Called in a loop, one transaction per batch, so a backlog of millions of
    rows never holds one long transaction; the scheduled_at index finds each
    batch's end.
    """
    batch_end = conn.execute(
        select(ticks.c.scheduled_at)
        .where(ticks.c.scheduled_at < older_than)
        .order_by(ticks.c.scheduled_at)
        .offset(batch - 1)
        .limit(1)
    ).scalar()

    def in_batch(column: Any) -> Any:
        return column <= batch_end if batch_end is not None else column < older_than

    pending = or_(ticks.c.status == Status.RUNNING, ticks.c.retry_at.is_not(None))
    removed = conn.execute(delete(ticks).where(in_batch(ticks.c.scheduled_at), ~pending)).rowcount
    # A tick's earlier attempts go with its row (a pending tick keeps both).
    kept = (
        select(ticks.c.job_key)
        .where(ticks.c.job_key == attempts.c.job_key)
        .where(ticks.c.scheduled_at == attempts.c.scheduled_at)
        .exists()
    )
    conn.execute(delete(attempts).where(in_batch(attempts.c.scheduled_at), ~kept))
    conn.execute(
        delete(notices).where(notices.c.done_at.is_not(None), notices.c.done_at < older_than)
    )
    conn.execute(delete(run_requests).where(run_requests.c.requested_at < older_than))
    return removed or 0


# -- the outbox ---------------------------------------------------------------------------

NOTICE_LEASE = timedelta(seconds=30)  # a notice's deliverer has this long before others may


def adopt_notices(conn: Connection, instance: str, now: Any, limit: int = 100) -> list[int]:
    """Take the lease of notices that are due and that nobody is delivering.

    Their replica died while delivering them, or never got the answer of the
    claim that raised them, or a retry is due. Rows another replica is
    adopting at the same moment are left to it.
    """
    due = (
        select(notices.c.id)
        .where(
            notices.c.done_at.is_(None),
            notices.c.next_attempt_at <= now,
            or_(notices.c.lease_until.is_(None), notices.c.lease_until < now),
        )
        .order_by(notices.c.id)
        .limit(limit)
    )
    if conn.dialect.name == "postgresql":
        due = due.with_for_update(skip_locked=True)
    ids = [row[0] for row in conn.execute(due)]
    if ids:
        conn.execute(
            update(notices)
            .where(notices.c.id.in_(ids))
            .values(lease_by=instance, lease_until=now + NOTICE_LEASE)
        )
    return ids


def leased_notices(conn: Connection, ids: list[int], instance: str) -> list[dict[str, Any]]:
    """The notices of `ids` this replica still holds the lease of, not yet delivered."""
    query = select(notices).where(
        notices.c.id.in_(ids), notices.c.lease_by == instance, notices.c.done_at.is_(None)
    )
    return [dict(row._mapping) for row in conn.execute(query.order_by(notices.c.id))]


def add_notice(
    conn: Connection,
    event: str,
    key: int,
    name: str,
    facts: dict[str, Any],
    *,
    raised_by: str,
    now: datetime,
    scheduled_at: datetime | None = None,
    deliverer: str | None = None,
) -> int:
    """Write a notice to the outbox. With a `deliverer`, leased to it (it delivers at once);
    without one (a command line, not a replica), the next live replica's housekeeping adopts it.
    """
    statement = notices.insert().values(
        event=event,
        job_key=key,
        job_name=name,
        scheduled_at=scheduled_at,
        facts=json.dumps(facts),
        raised_by=raised_by,
        raised_at=now,
        lease_by=deliverer,
        lease_until=now + NOTICE_LEASE if deliverer else None,
        next_attempt_at=now,
    )
    return int(conn.execute(statement.returning(notices.c.id)).scalar_one())


def notice_done(conn: Connection, notice: int, instance: str, now: Any, outcome: str) -> None:
    conn.execute(
        update(notices)
        .where(notices.c.id == notice, notices.c.lease_by == instance)
        .values(done_at=now, outcome=outcome, attempts=notices.c.attempts + 1)
    )


def notice_retry(conn: Connection, notice: int, instance: str, due: datetime) -> None:
    """Keep the lease until the retry is due (and a little after, for the retry itself)."""
    conn.execute(
        update(notices)
        .where(notices.c.id == notice, notices.c.lease_by == instance)
        .values(
            attempts=notices.c.attempts + 1,
            next_attempt_at=due,
            lease_until=due + NOTICE_LEASE,
        )
    )


# -- registrations ------------------------------------------------------------------------


@dataclass(frozen=True)
class Registration:
    instance: str
    key: int
    name: str
    schedule: str | None
    since: datetime
    until: datetime | None


def registrations_of(conn: Connection, keys: list[int] | None = None) -> list[Registration]:
    query = select(registrations)
    if keys is not None:
        query = query.where(registrations.c.job_key.in_(keys))
    return [
        Registration(r.instance, r.job_key, r.job_name, r.schedule, r.since, r.until)
        for r in conn.execute(
            query.order_by(registrations.c.job_key, registrations.c.instance, registrations.c.since)
        )
    ]


def _inheritance(
    found: list[Registration], instance: str, live: set[str]
) -> dict[tuple[int, str | None], datetime]:
    """(job, schedule) of replicas now gone -> since when the fleet has run it so."""
    heirs: dict[tuple[int, str | None], datetime] = {}
    for r in found:
        if r.instance != instance and r.instance not in live and r.until is None:
            pair = (r.key, r.schedule)
            heirs[pair] = min(r.since, heirs.get(pair, r.since))
    return heirs


def _take_over(
    conn: Connection,
    heirs: dict[tuple[int, str | None], datetime],
    wanted: set[tuple[int, str | None]],
    keep: list[str],
) -> None:
    """The gone replicas' open rows of what this one runs too: they live on in its own."""
    inherited: dict[str | None, list[int]] = {}
    for key, schedule in heirs:
        if (key, schedule) in wanted:
            inherited.setdefault(schedule, []).append(key)
    for schedule, keys in inherited.items():
        conn.execute(
            delete(registrations).where(
                registrations.c.job_key.in_(sorted(keys)),
                registrations.c.schedule.is_not_distinct_from(schedule),
                registrations.c.until.is_(None),
                registrations.c.instance.not_in(keep),
            )
        )


def registered_instances(conn: Connection) -> set[str]:
    """The replicas that have some schedule in force (an open registration)."""
    query = select(registrations.c.instance).where(registrations.c.until.is_(None)).distinct()
    return set(conn.execute(query).scalars())


def register(
    conn: Connection,
    instance: str,
    entries: list[tuple[int, str, str | None]],
    live: set[str],
    now: datetime,
) -> None:
    """This replica's jobs and schedules, in force from now.

    A schedule it already runs keeps its `since`; one that a replica now gone
    began is taken over from then (the gone replica's row goes: the table stays
    about one open row per live replica and job). A schedule this replica ran and
    runs no more (a reload, a restart with another config.yaml) ends now, and its
    row stays: the ticks from before the change are judged by it (scheduler.fleet.due).
    """
    found = registrations_of(conn)
    heirs = _inheritance(found, instance, live)
    _take_over(conn, heirs, {(key, schedule) for key, _, schedule in entries}, [*live, instance])
    mine = {r.key: r for r in found if r.instance == instance and r.until is None}
    rows, renamed = [], []
    for key, name, schedule in sorted(entries):
        known = mine.pop(key, None)
        if known is not None and known.schedule == schedule:
            if known.name != name:
                renamed.append((key, name))
            continue
        since = heirs.get((key, schedule), now)
        if known is not None:
            _end(conn, known, now if since != known.since else None)
        row = {"instance": instance, "job_key": key, "job_name": name, "schedule": schedule}
        rows.append({**row, "since": since, "until": None})
    for known in mine.values():  # jobs this replica no longer has
        _end(conn, known, now)
    for key, name in renamed:
        conn.execute(
            update(registrations)
            .where(
                registrations.c.instance == instance,
                registrations.c.job_key == key,
                registrations.c.until.is_(None),
            )
            .values(job_name=name)
        )
    if rows:
        conn.execute(registrations.insert(), rows)


def _key_of(row: Registration) -> tuple[Any, ...]:
    return (
        registrations.c.instance == row.instance,
        registrations.c.job_key == row.key,
        registrations.c.since == row.since,
    )


def _end(conn: Connection, row: Registration, at: datetime | None) -> None:
    """A schedule is no longer in force from `at` (None: it never was: its row goes)."""
    where = _key_of(row)
    if at is None:
        conn.execute(delete(registrations).where(*where))
    else:
        conn.execute(update(registrations).where(*where).values(until=at))


def supersede(conn: Connection, live: set[str], now: datetime) -> int:
    """Schedules of replicas that are gone end where a live replica runs another schedule."""
    found = registrations_of(conn)
    running = {(r.key, r.schedule) for r in found if r.instance in live and r.until is None}
    live_keys = {key for key, _ in running}
    ended = 0
    for r in found:
        gone = r.instance not in live and r.until is None
        if gone and r.key in live_keys and (r.key, r.schedule) not in running:
            _end(conn, r, now)
            ended += 1
    return ended


def reassert(
    conn: Connection, instance: str, entries: list[tuple[int, str, str | None]], now: Any
) -> int:
    """A live replica's schedules are in force, whatever another replica concluded while
    this one was starting (registered, not yet live) or reconnecting: see `supersede`,
    and `register`, which takes over the rows of a replica that looks gone. Returns how
    many rows it put back.

    Its newest row of each of its jobs (`entries`) is reopened if it is this schedule's,
    and one from now is added if it is gone or another; the rows its own changes ended
    stay ended.
    """
    query = select(registrations).where(registrations.c.instance == instance)
    newest = {r.job_key: r for r in conn.execute(query.order_by(registrations.c.since))}
    put_back = 0
    for key, name, schedule in entries:
        row = newest.get(key)
        if row is not None and row.until is None:
            continue
        if row is not None and row.schedule == schedule:
            found = Registration(instance, key, name, schedule, row.since, row.until)
            conn.execute(update(registrations).where(*_key_of(found)).values(until=None))
        else:
            conn.execute(
                registrations.insert().values(
                    instance=instance, job_key=key, job_name=name, schedule=schedule, since=now
                )
            )
        put_back += 1
    return put_back


def mark_seen(conn: Connection, instance: str, now: Any) -> None:
    """This replica is alive now (see `seen`)."""
    statement = upsert(conn, seen).values(instance=instance, seen_at=now)
    conn.execute(
        statement.on_conflict_do_update(
            index_elements=[seen.c.instance], set_={"seen_at": statement.excluded.seen_at}
        )
    )


def seen_at(conn: Connection, instances: list[str]) -> dict[str, datetime]:
    """When each of these replicas was last known to be alive (those it knows)."""
    if not instances:
        return {}
    query = select(seen.c.instance, seen.c.seen_at).where(seen.c.instance.in_(instances))
    return {row.instance: row.seen_at for row in conn.execute(query)}


def prune_registrations(conn: Connection, older_than: datetime) -> int:
    """Schedules that ended before `older_than`, and replicas not seen since then."""
    conn.execute(delete(seen).where(seen.c.seen_at < older_than))
    return (
        conn.execute(
            delete(registrations).where(
                registrations.c.until.is_not(None), registrations.c.until < older_than
            )
        ).rowcount
        or 0
    )


# -- run-now requests (scheduler.fleet.run_now) --------------------------------------------

RUN_NOW_TAKE_AT_ONCE = 10  # requests one replica takes per look


def run_now_channel(namespace: int) -> str:
    """The fleet's LISTEN/NOTIFY channel: fleets in other schemas have other namespaces."""
    return f"scheduler_run_now_{namespace & 0xFFFFFFFF}"


@dataclass(frozen=True)
class RunRequest:
    """A run-now request a replica took."""

    id: int
    key: int
    name: str
    requested_by: str


def take_run_requests(
    conn: Connection, instance: str, keys: list[int], now: Any
) -> list[RunRequest]:
    """Take requests for jobs this replica runs; another replica's take skips them."""
    r = run_requests
    if not keys:
        return []
    wanted = (
        select(r.c.id)
        .where(r.c.taken_by.is_(None), r.c.job_key.in_(sorted(keys)))
        .order_by(r.c.id)
        .limit(RUN_NOW_TAKE_AT_ONCE)
    )
    if conn.dialect.name == "postgresql":
        wanted = wanted.with_for_update(skip_locked=True)
    rows = conn.execute(
        update(r)
        .where(r.c.id.in_(wanted.scalar_subquery()), r.c.taken_by.is_(None))
        .values(taken_by=instance, taken_at=now)
        .returning(r.c.id, r.c.job_key, r.c.job_name, r.c.requested_by)
    ).all()
    # In the order they were asked: the replica claims them in this order.
    return sorted(
        (RunRequest(row.id, row.job_key, row.job_name, row.requested_by) for row in rows),
        key=lambda request: request.id,
    )


# How far apart a request's take and the start of its run may be, at most, for the run to be
# found from the ledger: the clocks of a replica and of the database, and a claim delayed by
# a reconnect. A run further off is not claimed for the request (its asker says it does not
# know), never wrongly.
LINK_WINDOW = timedelta(minutes=10)


@dataclass(frozen=True)
class RequestRun:
    """The run a taken run-now request became, as the ledger shows it."""

    run_id: int
    status: str
    instance: str
    started_at: datetime
    finished_at: datetime | None
    error: str | None
    sure: bool  # False: another request of the job, taken by the same replica, may be its


def run_of_request(conn: Connection, request: dict[str, Any]) -> RequestRun | None:
    """The run a taken request became, read from the ledger alone (never from who is live).

    A replica runs what it takes as a manual tick, lock first, in the order it took
    them, so the run is the first manual run of the job on the taker that started
    after the take. None if there is none (yet), or if another request is known to
    have become it; not `sure` if another request of the job taken by that replica
    before the run started, and not settled, may have become it instead.
    """
    r, t = run_requests, ticks
    key, taker, taken_at = request["job_key"], request["taken_by"], request["taken_at"]
    if taker is None or taken_at is None:
        return None
    found = conn.execute(
        select(t.c.run_id, t.c.status, t.c.instance, t.c.started_at, t.c.finished_at, t.c.error)
        .where(
            t.c.job_key == key,
            t.c.scheduled_at >= taken_at - LINK_WINDOW,
            t.c.manual,
            t.c.instance == taker,
            t.c.run_id.is_not(None),
            t.c.started_at >= taken_at,
        )
        .order_by(t.c.started_at)
        .limit(1)
    ).first()
    if found is None:
        return None
    others = select(r.c.id).where(
        r.c.job_key == key, r.c.taken_by == taker, r.c.id != request["id"]
    )
    if conn.execute(others.where(r.c.run_id == found.run_id).limit(1)).first():
        return None
    could_be_theirs = others.where(
        r.c.finished_at.is_(None),
        r.c.taken_at >= found.started_at - LINK_WINDOW,
        r.c.taken_at <= found.started_at,
        or_(r.c.taken_at != taken_at, r.c.id < request["id"]),  # taken together: in id order
    )
    sure = conn.execute(could_be_theirs.limit(1)).first() is None
    return RequestRun(
        found.run_id,
        found.status,
        found.instance,
        found.started_at,
        found.finished_at,
        found.error,
        sure,
    )


def settle_request(
    conn: Connection,
    request: int,
    *,
    outcome: str,
    status: str | None,
    run_id: int | None,
    error: str | None,
    now: Any,
) -> bool:
    """Write a request's outcome, once: whoever settles it first (its replica, or whoever
    read it from the ledger) wins; False if it was settled already."""
    r = run_requests
    statement = (
        update(r)
        .where(r.c.id == request, r.c.finished_at.is_(None))
        .values(outcome=outcome, status=status, run_id=run_id, error=error, finished_at=now)
    )
    return bool(conn.execute(statement).rowcount)


SETTLE_AT_ONCE = 100  # taken, unsettled requests housekeeping looks at per sweep, newest first


def settle_ended_requests(conn: Connection, now: Any) -> int:
    """Settle taken requests whose run has ended, from its row (housekeeping): the replica
    that ran it may have died, or failed to write the outcome, before it did."""
    r = run_requests
    waiting = conn.execute(
        select(r)
        .where(r.c.taken_by.is_not(None), r.c.finished_at.is_(None))
        .order_by(r.c.id.desc())
        .limit(SETTLE_AT_ONCE)
    ).all()
    settled = 0
    for row in waiting:
        run = run_of_request(conn, dict(row._mapping))
        if run is not None and run.sure and run.status != Status.RUNNING:
            settled += settle_request(
                conn,
                row.id,
                outcome="run",
                status=run.status,
                run_id=run.run_id,
                error=run.error,
                now=now,
            )
    return settled


def running_of(conn: Connection, key: int) -> TickRow | None:
    """The job's run going now, as the ledger says (to say who holds its lock)."""
    query = select(ticks).where(ticks.c.job_key == key, ticks.c.status == Status.RUNNING)
    row = conn.execute(query.order_by(ticks.c.started_at.desc()).limit(1)).first()
    return _row(row) if row else None
