"""Test set-up: a real PostgreSQL, and one throwaway database per test run.

The server is the one at SCHEDULER_TEST_DATABASE_URL (default: the local one
on 127.0.0.1:5432). When none answers there, a throwaway cluster is started
from the PostgreSQL binaries (pytest-postgresql), so the suite also passes on
a fresh machine with PostgreSQL installed but not running.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
import uuid
from collections.abc import Iterator
from pathlib import Path

import psycopg
import pytest
from psycopg import sql

from scheduler.ledger.tables import metadata
from tests.support import SERVER_URL_ENV, FakeMonotonic, Recorder, with_database

DEFAULT_SERVER = "postgresql://postgres@127.0.0.1:5432/postgres"
SLOWEST_FIRST = ("tests/fleet/", "tests/simulation/", "tests/integration/", "tests/unit/")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """In a parallel run, the slowest tier is handed out first: the minutes of the fleet
    tier overlap the rest instead of trailing it. A serial run keeps testpaths' order."""
    if not config.getoption("numprocesses", default=None):
        return

    def tier(item: pytest.Item) -> int:
        path = item.nodeid
        return next((i for i, p in enumerate(SLOWEST_FIRST) if path.startswith(p)), 0)

    items.sort(key=tier)  # stable: each tier keeps its own order


def _answers(url: str) -> bool:
    try:
        with psycopg.connect(url, connect_timeout=3):
            return True
    except psycopg.OperationalError:
        return False


def _pg_ctl() -> str | None:
    found = shutil.which("pg_ctl")
    if found:
        return found
    try:
        bindir = subprocess.run(
            ["pg_config", "--bindir"], capture_output=True, text=True, check=True
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        candidates = sorted(Path("/usr/lib/postgresql").glob("*/bin/pg_ctl"))
        return str(candidates[-1]) if candidates else None
    path = Path(bindir) / "pg_ctl"
    return str(path) if path.exists() else None


@pytest.fixture(scope="session")
def pg_server() -> Iterator[str]:
    """An admin URL of a running PostgreSQL server."""
    url = os.environ.get(SERVER_URL_ENV, DEFAULT_SERVER)
    if _answers(url):
        yield url
        return
    pg_ctl = _pg_ctl()
    if pg_ctl is None:
        pytest.exit(
            f"no PostgreSQL answers at {url} and no PostgreSQL binaries were found to start one. "
            "Install them (Debian/Ubuntu: apt-get install postgresql; macOS: brew install "
            f"postgresql) or point {SERVER_URL_ENV} at a server.",
            returncode=2,
        )
    if os.geteuid() == 0:
        pytest.exit(
            f"no PostgreSQL answers at {url}, and a throwaway cluster cannot be started as root "
            f"(initdb refuses). Start the server or set {SERVER_URL_ENV}.",
            returncode=2,
        )
    from port_for import get_port
    from pytest_postgresql.executors.proc import PostgreSQLExecutor

    base = Path(tempfile.mkdtemp(prefix="scheduler-pg-"))
    port = get_port(None)
    executor = PostgreSQLExecutor(
        executable=pg_ctl,
        host="127.0.0.1",
        port=port,
        datadir=str(base / "data"),
        unixsocketdir=str(base),
        logfile=str(base / "postgresql.log"),
        startparams="-w",
        dbname="postgres",
    )
    executor.start()
    try:
        yield f"postgresql://postgres@127.0.0.1:{port}/postgres"
    finally:
        executor.stop()
        shutil.rmtree(base, ignore_errors=True)


@pytest.fixture(scope="session")
def run_database(pg_server: str) -> Iterator[str]:
    """This test run's own database, dropped at the end."""
    name = f"scheduler_test_{uuid.uuid4().hex[:10]}"
    with psycopg.connect(pg_server, autocommit=True) as admin:
        admin.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(name)))
    try:
        yield with_database(pg_server, name)
    finally:
        with psycopg.connect(pg_server, autocommit=True) as admin:
            admin.execute(
                sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(sql.Identifier(name))
            )


@pytest.fixture
def database_url(run_database: str) -> Iterator[str]:
    """The run's database with an empty ledger, and no replica of an earlier test still in it."""
    with psycopg.connect(run_database, autocommit=True) as conn:
        conn.execute(
            "SELECT pg_terminate_backend(pid) FROM pg_stat_activity"
            " WHERE datname = current_database() AND pid <> pg_backend_pid()"
        )
        tables = ", ".join(table.name for table in metadata.sorted_tables)
        conn.execute(
            f"DROP TABLE IF EXISTS {tables} CASCADE;"  # every ledger table, however many
            " DROP SEQUENCE IF EXISTS scheduler_run_id;"
            " DROP FUNCTION IF EXISTS scheduler_claim, scheduler_finish;"
            " DROP TABLE IF EXISTS test_runs"
        )
    yield run_database


@pytest.fixture(params=["postgresql", "embedded"])
def backends(request, tmp_path):
    """Opens backends of one kind, each standing for a replica: PostgreSQL, then embedded.

    `make(instance, connect=True)`: on PostgreSQL each is a session of its own;
    in embedded mode each has its own flock descriptors on one SQLite file.
    """
    from scheduler.backends.embedded import EmbeddedBackend
    from scheduler.backends.postgres import PostgresBackend

    opened = []

    def make(instance: str, connect: bool = True):
        if request.param == "postgresql":
            url = request.getfixturevalue("database_url")
            backend = PostgresBackend(url, instance=instance, namespace=4242, holder_timeout=30)
        else:
            backend = EmbeddedBackend(tmp_path / "scheduler.db", instance=instance, namespace=4242)
        backend.migrate()
        if connect:
            backend.connect()
        opened.append(backend)
        return backend

    make.kind = request.param
    yield make
    for backend in opened:
        backend.close()
        if hasattr(backend, "ledger_engine"):
            backend.ledger_engine.dispose()


GATE_NAMESPACE = 4343


@pytest.fixture
def gate_factory(database_url):
    """Gates on real PostgreSQL sessions, with a fake monotonic clock and no threads started.

    `make(instance, max_workers, holder_timeout)` returns (gate, recorder, clock);
    each test calls `gate.step()` where the dispatcher thread would.
    """
    from scheduler.backends.postgres import PostgresBackend
    from scheduler.gate import Gate

    made = []

    def make(instance: str = "g1", max_workers: int = 4, holder_timeout: float = 30.0):
        backend = PostgresBackend(
            database_url,
            instance=instance,
            namespace=GATE_NAMESPACE,
            holder_timeout=holder_timeout,
        )
        backend.migrate()
        recorder, clock = Recorder(), FakeMonotonic()
        gate = Gate(
            backend,
            instance=instance,
            max_workers=max_workers,
            holder_timeout=holder_timeout,
            listeners=[recorder],
            monotonic=clock,
        )
        made.append(gate)
        return gate, recorder, clock

    yield make
    for gate in made:
        gate.backend.close()
        gate.backend.ledger_engine.dispose()
