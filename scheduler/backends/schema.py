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

from sqlalchemy import Connection, func, insert, select, text

from scheduler import ledger

MIGRATION_LOCK_KEY = -1  # (lock_namespace, -1); job keys are 1..2147483647


def _v1_tables(conn: Connection) -> None:
    ledger.metadata.create_all(conn, checkfirst=True)
    conn.execute(ledger.RUNNING_INDEX)
    epoch = datetime(1970, 1, 1, tzinfo=UTC)
    conn.execute(
        insert(ledger.maintenance),
        [{"task": task, "last_run_at": epoch} for task in ledger.MAINTENANCE_TASKS],
    )
    if conn.dialect.name == "sqlite":
        conn.execute(insert(ledger.counters).values(name="run_id", value=0))


def _functions(conn: Connection) -> None:
    """(Re)create the gate's SQL functions; each version that changes them runs this."""
    if conn.dialect.name != "postgresql":
        return
    body = resources.files("scheduler.backends").joinpath("postgres.sql").read_text()
    conn.exec_driver_sql(body)


MIGRATIONS: list[tuple[int, Callable[[Connection], None]]] = [
    (1, _v1_tables),
    (2, _functions),  # v2: claims leave ticks owned by other replicas out of the answer
]
CURRENT_VERSION = max(version for version, _ in MIGRATIONS)


def migrate(conn: Connection, namespace: int) -> int:
    """Bring the schema to CURRENT_VERSION; returns the version found before."""
    with conn.begin():
        if conn.dialect.name == "postgresql":
            conn.execute(
                text("SELECT pg_advisory_xact_lock(:ns, :key)"),
                {"ns": namespace, "key": MIGRATION_LOCK_KEY},
            )
        found = _version(conn)
        for version, step in MIGRATIONS:
            if version > found:
                step(conn)
        if found < CURRENT_VERSION:
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
