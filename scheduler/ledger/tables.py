"""The ledger's tables, as SQLAlchemy Core describes them for the queries.

The migration files (scheduler/backends/migrations) make the tables; a test holds the two
together. One row of `ticks` per (job key, scheduled tick): its primary key is what a claim
inserts (the protocol is told in `scheduler.gate`).
"""

from __future__ import annotations

from typing import Any

from sqlalchemy import (
    BigInteger,
    Boolean,
    Column,
    Connection,
    Float,
    Integer,
    MetaData,
    Sequence,
    String,
    Table,
    Text,
    false,
)

from scheduler.ledger.times import UTCDateTime

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


def upsert(conn: Connection, table: Table) -> Any:
    """The dialect's INSERT, which knows ON CONFLICT (imported only for the dialect in use)."""
    if conn.dialect.name == "postgresql":
        from sqlalchemy.dialects import postgresql

        return postgresql.insert(table)
    from sqlalchemy.dialects import sqlite

    return sqlite.insert(table)
