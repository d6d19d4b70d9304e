"""Create or migrate the ledger schema at start-up, safely from N replicas at once.

Each migration step runs once, in order, inside one transaction that first
takes an exclusive lock (PostgreSQL: the advisory lock (lock_namespace, -1);
SQLite: BEGIN IMMEDIATE). Replicas that start together queue on that lock
and find the work done.
"""

from __future__ import annotations

from collections.abc import Callable
from datetime import UTC, datetime
from importlib import resources

from sqlalchemy import Connection, MetaData, func, insert, inspect, select, text

from scheduler import ledger

MIGRATION_LOCK_KEY = -1  # (lock_namespace, -1); job keys are 1..2147483647


def _v1_tables(conn: Connection) -> None:
    v1 = [ledger.ticks, ledger.jobs, ledger.maintenance, ledger.schema_version, ledger.counters]
    ledger.metadata.create_all(conn, tables=v1, checkfirst=True)
    conn.execute(ledger.RUNNING_INDEX)
    epoch = datetime(1970, 1, 1, tzinfo=UTC)
    conn.execute(
        insert(ledger.maintenance),
        [{"task": task, "last_run_at": epoch} for task in ledger.MAINTENANCE_TASKS],
    )
    if conn.dialect.name == "sqlite":
        conn.execute(insert(ledger.counters).values(name="run_id", value=0))


def _functions(conn: Connection) -> None:
    """(Re)create the gate's SQL functions; each version that changes them runs this.

    Every function and type of ours is dropped first: a changed signature would
    otherwise leave the old function beside the new one.
    """
    if conn.dialect.name != "postgresql":
        return
    conn.exec_driver_sql(
        """
        DO $$
        DECLARE
            f regprocedure;
        BEGIN
            FOR f IN SELECT p.oid::regprocedure FROM pg_proc p
                      WHERE p.pronamespace = current_schema()::regnamespace
                        AND left(p.proname, 10) = 'scheduler_'
            LOOP
                EXECUTE 'DROP FUNCTION ' || f || ' CASCADE';
            END LOOP;
        END $$;
        DROP TYPE IF EXISTS scheduler_tick, scheduler_done CASCADE;
        """
    )
    body = resources.files("scheduler.backends").joinpath("postgres.sql").read_text()
    conn.exec_driver_sql(body)


def _v3_notices_and_told(conn: Connection) -> None:
    """The outbox, registrations, what a run was told and its own duration, two statuses."""
    ledger.notices.create(conn, checkfirst=True)
    ledger.registrations.create(conn, checkfirst=True)
    conn.execute(ledger.PENDING_NOTICES_INDEX)
    columns = (
        ("scheduler_ticks", "told", "TEXT"),
        ("scheduler_ticks", "duration_s", "DOUBLE PRECISION"),
        ("scheduler_jobs", "overrun_skips", "INTEGER NOT NULL DEFAULT 0"),
    )
    found = inspect(conn)
    for table, column, kind in columns:
        if column not in {c["name"] for c in found.get_columns(table)}:
            conn.exec_driver_sql(f"ALTER TABLE {table} ADD COLUMN {column} {kind}")
    _allow_statuses(conn, "'paused'")


def _allow_statuses(conn: Connection, newest: str) -> None:
    """The status CHECK constraint of today (`newest`: the last status it gained)."""
    if conn.dialect.name == "postgresql":
        conn.exec_driver_sql(
            "ALTER TABLE scheduler_ticks DROP CONSTRAINT scheduler_ticks_status,"
            f" ADD CONSTRAINT scheduler_ticks_status CHECK ({ledger.STATUS_CHECK}) NOT VALID"
        )
        conn.exec_driver_sql(
            "ALTER TABLE scheduler_ticks VALIDATE CONSTRAINT scheduler_ticks_status"
        )
    else:
        made = conn.exec_driver_sql(
            "SELECT sql FROM sqlite_master WHERE type = 'table' AND name = 'scheduler_ticks'"
        ).scalar_one()
        if newest not in made:
            _rebuild_sqlite_ticks(conn)


def _rebuild_sqlite_ticks(conn: Connection) -> None:
    """SQLite cannot change a CHECK constraint: copy the rows into a table made anew."""
    conn.exec_driver_sql("ALTER TABLE scheduler_ticks RENAME TO scheduler_ticks_old")
    conn.exec_driver_sql("DROP INDEX IF EXISTS scheduler_ticks_scheduled_at")
    conn.exec_driver_sql("DROP INDEX IF EXISTS scheduler_ticks_running")
    fresh = MetaData()
    ledger.ticks.to_metadata(fresh).create(conn)
    old = {c["name"] for c in inspect(conn).get_columns("scheduler_ticks_old")}
    names = ", ".join(column.name for column in ledger.ticks.columns if column.name in old)
    conn.exec_driver_sql(
        f"INSERT INTO scheduler_ticks ({names}) SELECT {names} FROM scheduler_ticks_old"
    )
    conn.exec_driver_sql("DROP TABLE scheduler_ticks_old")
    conn.execute(ledger.RUNNING_INDEX)
    conn.execute(ledger.RETRY_INDEX)


def _v4_pauses(conn: Connection) -> None:
    """Fleet-wide pauses; the claim functions read them (re-created with this version)."""
    ledger.pauses.create(conn, checkfirst=True)


def _v5_drift(conn: Connection) -> None:
    """Whether a job's live replicas disagree on its schedule, and since when; how far
    missed ticks are recorded (from where the sweep was, on a ledger that has run);
    run-now requests."""
    known = conn.execute(
        select(ledger.maintenance.c.last_run_at).where(ledger.maintenance.c.task == "sweep")
    ).scalar()
    ledger.run_requests.create(conn, checkfirst=True)
    conn.execute(ledger.PENDING_REQUESTS_INDEX)
    if not conn.execute(
        select(ledger.maintenance.c.task).where(ledger.maintenance.c.task == "missed")
    ).first():
        epoch = datetime(1970, 1, 1, tzinfo=UTC)
        conn.execute(insert(ledger.maintenance).values(task="missed", last_run_at=known or epoch))
    timestamp = "TIMESTAMP WITH TIME ZONE" if conn.dialect.name == "postgresql" else "DATETIME"
    columns = (("drift_since", timestamp), ("drift_alerted", "BOOLEAN NOT NULL DEFAULT FALSE"))
    found = {c["name"] for c in inspect(conn).get_columns("scheduler_jobs")}
    for column, kind in columns:
        if column not in found:
            conn.exec_driver_sql(f"ALTER TABLE scheduler_jobs ADD COLUMN {column} {kind}")


def _v6_retries_and_catch_up(conn: Connection) -> None:
    """A tick's attempts (job `retries`) and when its next is due; caught-up ticks."""
    ledger.attempts.create(conn, checkfirst=True)
    timestamp = "TIMESTAMP WITH TIME ZONE" if conn.dialect.name == "postgresql" else "DATETIME"
    columns = (
        ("attempt", "INTEGER NOT NULL DEFAULT 1"),
        ("retry_at", timestamp),
        ("caught_up", "BOOLEAN NOT NULL DEFAULT FALSE"),
    )
    found = {c["name"] for c in inspect(conn).get_columns("scheduler_ticks")}
    for column, kind in columns:
        if column not in found:
            conn.exec_driver_sql(f"ALTER TABLE scheduler_ticks ADD COLUMN {column} {kind}")
    conn.execute(ledger.RETRY_INDEX)


def _v7_schedule_history(conn: Connection) -> None:
    """A replica's schedule of a job that changed is kept (ended), beside the one in force:
    the registrations' key gains `since`. When replicas were last seen alive."""
    ledger.seen.create(conn, checkfirst=True)
    table = ledger.registrations.name
    found = inspect(conn).get_pk_constraint(table)
    if "since" in found["constrained_columns"]:
        return
    if conn.dialect.name == "postgresql":
        conn.exec_driver_sql(
            f'ALTER TABLE {table} DROP CONSTRAINT "{found["name"]}",'
            " ADD PRIMARY KEY (instance, job_key, since)"
        )
        return
    conn.exec_driver_sql(f"ALTER TABLE {table} RENAME TO {table}_old")
    ledger.registrations.to_metadata(MetaData()).create(conn)
    names = ", ".join(column.name for column in ledger.registrations.columns)
    conn.exec_driver_sql(f"INSERT INTO {table} ({names}) SELECT {names} FROM {table}_old")
    conn.exec_driver_sql(f"DROP TABLE {table}_old")


def _v2_lean_claims(conn: Connection) -> None:
    """v2 changed only the SQL functions (claims leave other replicas' ticks out)."""


# Each step brings the tables from the version before to its own; the SQL functions
# are then installed once, as they are today, whenever any step ran.
MIGRATIONS: list[tuple[int, Callable[[Connection], None]]] = [
    (1, _v1_tables),
    (2, _v2_lean_claims),
    (3, _v3_notices_and_told),
    (4, _v4_pauses),
    (5, _v5_drift),
    (6, _v6_retries_and_catch_up),
    (7, _v7_schedule_history),
]
CURRENT_VERSION = max(version for version, _ in MIGRATIONS)


def migrate(conn: Connection, namespace: int, schema: str = "public") -> int:
    """Bring the schema to CURRENT_VERSION; returns the version found before.

    PostgreSQL: the fleet's schema (a validated name) is created if missing;
    the session's search_path already points there.
    """
    with conn.begin():
        if conn.dialect.name == "postgresql":
            conn.execute(
                text("SELECT pg_advisory_xact_lock(:ns, :key)"),
                {"ns": namespace, "key": MIGRATION_LOCK_KEY},
            )
            if not conn.execute(
                text("SELECT 1 FROM pg_namespace WHERE nspname = :schema"), {"schema": schema}
            ).first():
                conn.exec_driver_sql(f'CREATE SCHEMA "{schema}"')
        found = _version(conn)
        for version, step in MIGRATIONS:
            if version > found:
                step(conn)
        if found < CURRENT_VERSION:
            _functions(conn)
            conn.execute(
                insert(ledger.schema_version).values(
                    version=CURRENT_VERSION, applied_at=datetime.now(UTC)
                )
            )
    return found


def _version(conn: Connection) -> int:
    if not conn.dialect.has_table(conn, ledger.schema_version.name):
        return 0
    return conn.execute(select(func.max(ledger.schema_version.c.version))).scalar() or 0
