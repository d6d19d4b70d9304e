"""The ledger: one row per (job key, scheduled tick), in SQLAlchemy 2.

The primary key on (job_key, scheduled_at) is the claim: whichever replica
inserts a tick's row first owns that tick, so a tick runs once even when
replicas' clocks disagree or a job finishes in a millisecond. Both backends
(PostgreSQL and the embedded SQLite file) use these tables and these queries.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any

from sqlalchemy import (
    BigInteger,
    Boolean,
    CheckConstraint,
    Column,
    Connection,
    DateTime,
    Index,
    Integer,
    MetaData,
    Sequence,
    String,
    Table,
    Text,
    TypeDecorator,
    delete,
    desc,
    false,
    select,
    text,
    tuple_,
    update,
)
from sqlalchemy.engine import Dialect

STATUSES = ("running", "succeeded", "failed", "skipped", "crashed", "missed")
FINISHED = ("succeeded", "failed", "crashed")


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
        if value.tzinfo is None:
            return value.replace(tzinfo=UTC)
        return value.astimezone(UTC)


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
    CheckConstraint(
        "status IN (" + ", ".join(f"'{status}'" for status in STATUSES) + ")",
        name="scheduler_ticks_status",
    ),
    Index("scheduler_ticks_scheduled_at", "scheduled_at"),
)

# Runs still going, by job: every claim that starts a run looks for stale ones.
# A partial index, created by the migration with the same statement on both
# backends (declared on the table, it would make SQLAlchemy load the module of
# every dialect it names, a megabyte or two of memory for nothing).
RUNNING_INDEX = text(
    "CREATE INDEX IF NOT EXISTS scheduler_ticks_running"
    " ON scheduler_ticks (job_key) WHERE status = 'running'"
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
        }


def iso(value: datetime | None) -> str | None:
    return None if value is None else value.isoformat()


def _row(row: object) -> TickRow:
    m = row._mapping  # type: ignore[attr-defined]
    started, finished = m["started_at"], m["finished_at"]
    duration = (finished - started).total_seconds() if started and finished else None
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
    )


def upsert(conn: Connection, table: Table) -> Any:
    """The dialect's INSERT, which knows ON CONFLICT (imported only for the dialect in use)."""
    if conn.dialect.name == "postgresql":
        from sqlalchemy.dialects.postgresql import insert
    else:
        from sqlalchemy.dialects.sqlite import insert
    return insert(table)


def history(conn: Connection, key: int | None, limit: int) -> list[TickRow]:
    """Most recent ticks first; served by the primary key or the scheduled_at index."""
    query = select(ticks)
    if key is not None:
        query = query.where(ticks.c.job_key == key)
    query = query.order_by(desc(ticks.c.scheduled_at), ticks.c.job_key).limit(limit)
    return [_row(r) for r in conn.execute(query)]


def latest(conn: Connection, key: int, statuses: tuple[str, ...] | None = None) -> TickRow | None:
    query = select(ticks).where(ticks.c.job_key == key)
    if statuses:
        query = query.where(ticks.c.status.in_(statuses))
    row = conn.execute(query.order_by(desc(ticks.c.scheduled_at)).limit(1)).first()
    return _row(row) if row else None


def running(conn: Connection) -> list[TickRow]:
    query = select(ticks).where(ticks.c.status == "running").order_by(ticks.c.job_key)
    return [_row(r) for r in conn.execute(query)]


def job_states(conn: Connection) -> dict[int, dict[str, object]]:
    return {r.job_key: dict(r._mapping) for r in conn.execute(select(jobs))}


def track_jobs(conn: Connection, entries: list[tuple[int, str, str]], now: datetime) -> None:
    """Make sure every job has a state row; a changed schedule restarts its tracking.

    `tracked_since` is where the missed-tick sweep starts looking: ticks from
    before a job existed (or before its schedule changed) were never due.
    """
    if not entries:
        return
    for key, name, schedule in entries:
        statement = upsert(conn, jobs).values(
            job_key=key, job_name=name, schedule=schedule, tracked_since=now
        )
        statement = statement.on_conflict_do_update(
            index_elements=[jobs.c.job_key],
            set_={"job_name": name, "schedule": schedule, "tracked_since": now},
            where=jobs.c.schedule.is_distinct_from(schedule),
        )
        conn.execute(statement)


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


def mark_crashed(conn: Connection, key: int, run_id: int, error: str, now: datetime) -> bool:
    """A running row whose lock is free: its replica died. Conditional, like every update."""
    result = conn.execute(
        update(ticks)
        .where(ticks.c.job_key == key, ticks.c.run_id == run_id, ticks.c.status == "running")
        .values(status="crashed", finished_at=now, error=error)
    )
    return result.rowcount == 1


MAINTENANCE_TASKS = ("sweep", "prune")


def elect(conn: Connection, task: str, now: Any, every: float) -> tuple[datetime, datetime] | None:
    """One replica at a time does a fleet chore: whoever moves its clock forward first.

    `now` is the backend's clock (PostgreSQL: ``now()``, the same for every
    replica). Returns (previous run, this run) if this replica won, else None.
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
    return (previous, row[0]) if row else None


def record_missed(
    conn: Connection, key: int, name: str, instance: str, scheduled: list[datetime]
) -> int:
    """Rows for ticks nobody claimed; a tick that has a row keeps it."""
    if not scheduled:
        return 0
    statement = (
        upsert(conn, ticks)
        .values(
            [
                {
                    "job_key": key,
                    "scheduled_at": t,
                    "job_name": name,
                    "status": "missed",
                    "instance": instance,
                }
                for t in scheduled
            ]
        )
        .on_conflict_do_nothing(index_elements=[ticks.c.job_key, ticks.c.scheduled_at])
        .returning(ticks.c.scheduled_at)
    )
    return len(conn.execute(statement).all())


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
    window = (
        ticks.c.scheduled_at <= batch_end
        if batch_end is not None
        else ticks.c.scheduled_at < older_than
    )
    return conn.execute(delete(ticks).where(window, ticks.c.status != "running")).rowcount or 0
