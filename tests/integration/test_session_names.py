"""A replica's sessions carry its name whatever the URL says, and `scheduler check`
reaches each host of a URL whatever options it gives (docs/faults.md: Failover)."""

from __future__ import annotations

from urllib.parse import urlsplit, urlunsplit

from sqlalchemy import text

from scheduler.backends.pg_session import connect_args
from scheduler.backends.postgres import PostgresBackend
from scheduler.cli.checks import database_checks
from tests.support import free_port

OPTIONS = "connect_timeout=3&application_name=borrowed"


def with_options(url: str, hosts: str | None = None) -> str:
    parts = urlsplit(url)
    netloc = parts.netloc if hosts is None else parts.netloc.rsplit("@", 1)[0] + "@" + hosts
    return urlunsplit(parts._replace(netloc=netloc, query=OPTIONS))


def test_connect_args_give_the_replicas_name_over_the_urls():
    assert connect_args("r1", 30, "postgresql://u@a/db?application_name=x")["application_name"] == (
        "r1"
    )


def test_a_replica_is_live_under_its_own_name_whatever_application_name_the_url_gives(
    database_url,
):
    backend = PostgresBackend(
        with_options(database_url), instance="named-r1", namespace=4747, holder_timeout=30
    )
    try:
        backend.migrate()
        backend.connect()
        with backend.ledger_engine.connect() as conn:
            live = {i["name"] for i in backend.live_instances(conn)}
            mine = conn.execute(text("SELECT current_setting('application_name')")).scalar()
        assert "named-r1" in live and "borrowed" not in live
        assert mine == "named-r1"
    finally:
        backend.close()
        backend.ledger_engine.dispose()


def test_check_reaches_each_host_of_a_url_that_sets_connect_timeout_and_application_name(
    database_url,
):
    parts = urlsplit(database_url)
    dead = f"127.0.0.1:{free_port()}"
    url = with_options(database_url, f"{parts.hostname}:{parts.port or 5432},{dead}")
    checks = database_checks(url, "checker")
    nodes = [c for c in checks if c.name == "node"]
    assert len(nodes) == 2, checks
    assert nodes[0].ok and "is the primary" in nodes[0].detail
    assert not nodes[1].ok and dead in nodes[1].detail


def test_the_lock_session_never_compiles_a_plan(database_url):
    """JIT on the claim's path cost a second per claim whose plan was costed over a guessed
    number of rows; the lock session turns it off whatever the server's setting."""
    backend = PostgresBackend(database_url, instance="no-jit", namespace=4748, holder_timeout=30)
    try:
        backend.migrate()
        backend.connect()
        assert backend._conn is not None
        row = backend._conn.execute(text("SHOW jit")).fetchone()
        assert row is not None and row[0] == "off"
    finally:
        backend.close()
