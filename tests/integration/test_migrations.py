"""The schema's migration files: a ledger made by any earlier version, migrated in place,
equals a fresh one; the files and postgres.sql agree with their manifest; the tables the
queries name are the tables the files make."""

from __future__ import annotations

import subprocess
import sys
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import psycopg
import pytest
from psycopg import sql
from sqlalchemy import Table, create_engine, inspect

from scheduler.backends.embedded import EmbeddedBackend
from scheduler.backends.migrations import manifest
from scheduler.backends.postgres import PostgresBackend
from scheduler.backends.schema import CURRENT_VERSION
from scheduler.ledger import tables
from scheduler.statuses import Status
from tests.ledger_schema import differences, postgres_schema, sqlite_schema
from tests.support import ROOT, with_database

NAMESPACE = 4545
# The last commit of each earlier schema version on main: what a ledger at that version
# looks like. Version 6 is the last released one.
EARLIER = {
    1: "45005835105b97c36a89df3f8e075264827baa2f",
    2: "ac046351eea6c7349028517273f2f312333d12eb",
    3: "d51e16b4c4fe0fa2888428d553a9029cc9697dc9",
    4: "31768df07946b4c8dd03073cc6141d69843456b8",
    5: "e476bd989ad5555dbf1d8e99fb54de8af8d69feb",
    6: "5b2536cdd7f5c10f9d56d802aa3068095b5d3526",
    7: "0b15e6c0f17bf27fd0b35a36caf8aefa1dcee346",
}
# Made by the code of that commit: its own migrate(), then a tick (and, from version 3,
# a registration) that the migration must keep.
OLD_LEDGER = """
import sys
from datetime import UTC, datetime
from sqlalchemy import create_engine, text
from scheduler.backends import schema
url, namespace, version = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
engine = create_engine(url)
at = datetime(2026, 1, 2, 3, 4, 5, tzinfo=UTC)
if url.startswith("sqlite"):
    at = at.replace(tzinfo=None)
with engine.connect() as conn:
    schema.migrate(conn, namespace)
with engine.begin() as conn:
    conn.execute(text(
        "INSERT INTO scheduler_ticks (job_key, scheduled_at, job_name, status, instance,"
        " run_id, started_at, finished_at) VALUES (7, :at, 'kept', 'succeeded', 'old', 1,"
        " :at, :at)"), {"at": at})
    if version >= 3:
        conn.execute(text(
            "INSERT INTO scheduler_registrations (instance, job_key, job_name, schedule,"
            " since) VALUES ('old', 7, 'kept', 'every 5s', :at)"), {"at": at})
"""


def source_of(commit: str, into: Path) -> Path:
    """The `scheduler` package as it was at `commit`; skips on a clone without it."""
    if subprocess.run(
        ["git", "-C", str(ROOT), "cat-file", "-e", f"{commit}^{{commit}}"], capture_output=True
    ).returncode:
        pytest.skip(f"commit {commit} is not in this clone (a shallow clone?): fetch the history")
    if not (into / "scheduler").exists():
        into.mkdir(parents=True, exist_ok=True)
        archive = subprocess.run(
            ["git", "-C", str(ROOT), "archive", commit, "scheduler"],
            capture_output=True,
            check=True,
        ).stdout
        subprocess.run(["tar", "-x", "-C", str(into)], input=archive, check=True)
    return into


def make_old_ledger(commit: str, version: int, url: str, tmp: Path) -> None:
    tree = source_of(commit, tmp / f"v{version}")
    made = subprocess.run(
        [sys.executable, "-c", OLD_LEDGER, url, str(NAMESPACE), str(version)],
        env={"PYTHONPATH": str(tree), "PATH": "/usr/bin:/bin"},
        cwd=tree,  # not this checkout, whose `scheduler` `-c` would import first
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert made.returncode == 0, made.stderr


@pytest.fixture
def new_database(pg_server: str) -> Iterator[Callable[[], str]]:
    """Databases of this test's own, dropped at its end."""
    made = []

    def make() -> str:
        name = f"scheduler_mig_{uuid.uuid4().hex[:10]}"
        with psycopg.connect(pg_server, autocommit=True) as admin:
            admin.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(name)))
        made.append(name)
        return with_database(pg_server, name)

    yield make
    with psycopg.connect(pg_server, autocommit=True) as admin:
        for name in made:
            admin.execute(
                sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(sql.Identifier(name))
            )


def postgres_ledger(url: str) -> PostgresBackend:
    return PostgresBackend(
        url.replace("postgresql://", "postgresql+psycopg://"),
        instance="new",
        namespace=NAMESPACE,
        holder_timeout=30,
    )


def migrate_postgres(url: str) -> int:
    backend = postgres_ledger(url)
    try:
        return backend.migrate()
    finally:
        backend.ledger_engine.dispose()


def migrate_embedded(path: Path) -> int:
    backend = EmbeddedBackend(path, instance="new", namespace=NAMESPACE)
    try:
        return backend.migrate()
    finally:
        backend.close()
        backend.ledger_engine.dispose()


def postgres_rows(url: str) -> dict[str, object]:
    with psycopg.connect(url) as conn:
        return {
            "version": conn.execute("SELECT max(version) FROM scheduler_schema").fetchone(),
            "tasks": conn.execute("SELECT task FROM scheduler_maintenance ORDER BY 1").fetchall(),
            "counters": conn.execute("SELECT name FROM scheduler_counters").fetchall(),
        }


@pytest.mark.parametrize("version", sorted(EARLIER))
def test_a_postgres_ledger_of_each_earlier_version_migrates_to_a_fresh_one(
    version, new_database, tmp_path
):
    old, fresh = new_database(), new_database()
    make_old_ledger(EARLIER[version], version, old, tmp_path)
    assert migrate_postgres(old) == version
    assert migrate_postgres(fresh) == 0
    assert differences(postgres_schema(fresh), postgres_schema(old)) == []
    assert postgres_rows(old) == postgres_rows(fresh)
    with psycopg.connect(old) as conn:
        assert conn.execute(
            "SELECT job_name, status, attempt, caught_up FROM scheduler_ticks"
        ).fetchall() == [("kept", "succeeded", 1, False)]
        registered = conn.execute("SELECT instance FROM scheduler_registrations").fetchall()
    assert registered == ([("old",)] if version >= 3 else [])


@pytest.mark.parametrize("version", sorted(EARLIER))
def test_an_embedded_ledger_of_each_earlier_version_migrates_to_a_fresh_one(version, tmp_path):
    old, fresh = tmp_path / "old" / "scheduler.db", tmp_path / "fresh" / "scheduler.db"
    old.parent.mkdir(mode=0o700)
    make_old_ledger(EARLIER[version], version, f"sqlite:///{old}", tmp_path)
    assert migrate_embedded(old) == version
    assert migrate_embedded(fresh) == 0
    assert differences(sqlite_schema(str(fresh)), sqlite_schema(str(old))) == []
    engine = create_engine(f"sqlite:///{old}")
    with engine.connect() as conn:
        kept = conn.exec_driver_sql("SELECT job_name, status, attempt FROM scheduler_ticks")
        assert kept.fetchall() == [("kept", "succeeded", 1)]
        tasks = conn.exec_driver_sql("SELECT task FROM scheduler_maintenance ORDER BY 1")
        assert [t for (t,) in tasks] == ["missed", "prune", "sweep"]
        registered = conn.exec_driver_sql("SELECT instance FROM scheduler_registrations")
        assert registered.fetchall() == ([("old",)] if version >= 3 else [])
    engine.dispose()


def test_the_migration_files_and_postgres_sql_agree_with_their_manifest():
    problems = manifest.check()
    assert not problems, "\n".join(problems)


def test_a_changed_postgres_sql_without_a_new_migration_is_refused(monkeypatch):
    monkeypatch.setattr(manifest, "functions_sql", lambda: "-- changed\n")
    problems = manifest.check()
    assert len(problems) == 1
    assert "postgres.sql changed without a new migration" in problems[0]
    assert f"postgresql/{CURRENT_VERSION + 1:04d}_<what>.sql" in problems[0]
    assert manifest.record() == problems  # and the manifest is not rewritten


def test_an_edited_migration_file_is_refused(monkeypatch):
    real = manifest.current()
    name = "sqlite/0003_notices_and_told.sql"
    monkeypatch.setattr(manifest, "current", lambda: {**real, name: "0" * 64})
    (problem,) = manifest.check()
    assert name in problem and "new migration file" in problem


def test_the_queries_tables_are_the_ones_the_files_make(new_database, tmp_path):
    """ledger/tables.py describes the tables for the queries: same columns, keys, nullability."""
    url = new_database()
    migrate_postgres(url)
    migrate_embedded(tmp_path / "scheduler.db")
    for made in (url.replace("postgresql://", "postgresql+psycopg://"), tmp_path):
        engine = create_engine(made if isinstance(made, str) else f"sqlite:///{made}/scheduler.db")
        with engine.connect() as conn:
            found = inspect(conn)
            for table in tables.metadata.sorted_tables:
                if engine.dialect.name == "sqlite" and table is tables.functions_installed:
                    continue
                assert described(table) == made_so(found, table.name), table.name
        engine.dispose()


def described(table: Table) -> tuple[object, ...]:
    columns = sorted((c.name, c.nullable) for c in table.columns)
    return columns, sorted(c.name for c in table.primary_key)


def made_so(found, name: str) -> tuple[object, ...]:
    columns = sorted((c["name"], c["nullable"]) for c in found.get_columns(name))
    return columns, sorted(found.get_pk_constraint(name)["constrained_columns"])


def test_the_ledger_allows_every_status_and_no_other(new_database, tmp_path):
    url = new_database()
    migrate_postgres(url)
    with psycopg.connect(url) as conn:
        (check,) = conn.execute(
            "SELECT pg_get_constraintdef(oid) FROM pg_constraint"
            " WHERE conname = 'scheduler_ticks_status'"
        ).fetchone()
    migrate_embedded(tmp_path / "scheduler.db")
    (embedded,) = sqlite_schema(str(tmp_path / "scheduler.db"))["checks"]
    for said in (check, embedded[2]):
        assert sorted(s.value for s in Status) == sorted(
            part.split("'")[1] for part in said.split(",")
        ), said


def test_changed_functions_are_installed_again_but_not_over_a_newer_ledger(new_database):
    url = new_database()
    migrate_postgres(url)
    with psycopg.connect(url, autocommit=True) as conn:
        conn.execute("DROP FUNCTION scheduler_claim")
        conn.execute("UPDATE scheduler_functions SET sha256 = 'installed by hand'")
    assert migrate_postgres(url) == CURRENT_VERSION
    with psycopg.connect(url, autocommit=True) as conn:
        assert conn.execute("SELECT 1 FROM pg_proc WHERE proname = 'scheduler_claim'").fetchone()
        # A newer release's replica migrated the ledger past this code: its functions stay.
        conn.execute("UPDATE scheduler_functions SET sha256 = 'a newer release'")
        conn.execute(
            "INSERT INTO scheduler_schema (version, applied_at)"
            f" VALUES ({CURRENT_VERSION + 1}, now())"
        )
    assert migrate_postgres(url) == CURRENT_VERSION + 1
    with psycopg.connect(url) as conn:
        assert conn.execute("SELECT sha256 FROM scheduler_functions").fetchall() == [
            ("a newer release",)
        ]
