"""Create or migrate the ledger schema at start-up, safely from N replicas at once.

The schema is the numbered SQL files of scheduler/backends/migrations: each file a
ledger has not applied runs once, in order, and its number is recorded in
scheduler_schema. All of it happens inside one transaction that first takes an
exclusive lock (PostgreSQL: the advisory lock (lock_namespace, -1); SQLite: BEGIN
IMMEDIATE). Replicas that start together queue on that lock and find the work done.

PostgreSQL's functions (postgres.sql) are installed whole after the files, whenever a
file ran or the installed postgres.sql (its hash, in scheduler_functions) is not this
one, but never by a replica older than the ledger: in a rolling deploy the newer
replicas' functions stay (they still answer older callers: see postgres.sql).
"""

from __future__ import annotations

from datetime import UTC, datetime

from sqlalchemy import Connection, delete, func, insert, select, text

from scheduler.backends.migrations import LATEST, Migration, functions_sql, migrations, sha256
from scheduler.ledger import tables

MIGRATION_LOCK_KEY = -1  # (lock_namespace, -1); job keys are 1..2147483647
CURRENT_VERSION = LATEST


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
        pending = [m for m in migrations(conn.dialect.name) if m.version > found]
        for migration in pending:
            _apply(conn, migration)
        if conn.dialect.name == "postgresql" and found <= CURRENT_VERSION:
            _install_functions(conn, again=bool(pending))
    return found


def _apply(conn: Connection, migration: Migration) -> None:
    if conn.dialect.name == "postgresql":
        if migration.statements():
            conn.exec_driver_sql(migration.sql)
    else:
        for statement in migration.statements():
            conn.exec_driver_sql(statement)
    conn.execute(
        insert(tables.schema_version).values(
            version=migration.version, applied_at=datetime.now(UTC)
        )
    )


def _install_functions(conn: Connection, again: bool) -> None:
    """(Re)create the gate's SQL functions unless the ones installed are these already.

    Every function and type of ours is dropped first: a changed signature would
    otherwise leave the old function beside the new one.
    """
    body = functions_sql()
    digest = sha256(body)
    installed = conn.execute(select(tables.functions_installed.c.sha256)).scalars().all()
    if installed == [digest] and not again:
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
    conn.exec_driver_sql(body)
    conn.execute(delete(tables.functions_installed))
    conn.execute(
        insert(tables.functions_installed).values(
            sha256=digest, version=CURRENT_VERSION, installed_at=datetime.now(UTC)
        )
    )


def _version(conn: Connection) -> int:
    if not conn.dialect.has_table(conn, tables.schema_version.name):
        return 0
    return conn.execute(select(func.max(tables.schema_version.c.version))).scalar() or 0
