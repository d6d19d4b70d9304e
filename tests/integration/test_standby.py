"""A replica never claims on a node that is not the primary (docs/faults.md: Failover).

A standby in the URL is passed over for the primary; a standby alone is refused
(by name) for the lock session and the ledger session; an old primary fenced
read-only loses the lock session at its next heartbeat or write, and the ledger's
next session on it is refused as it opens. A primary and a standby of the test's own.
"""

from __future__ import annotations

import os
import socket
import time
from collections.abc import Callable, Iterator
from datetime import UTC, datetime, timedelta

import psycopg
import pytest
from sqlalchemy import text
from sqlalchemy.exc import DBAPIError, OperationalError

from scheduler.backends.base import ClaimRequest, Intent, SessionLost, Unavailable
from scheduler.backends.postgres import PostgresBackend
from tests import clusters
from tests.fleet.replication import Pair

pytestmark = pytest.mark.failover

NAMESPACE = 4646


@pytest.fixture(scope="module")
def pair() -> Iterator[Pair]:
    reason = clusters.available()
    if reason and os.environ.get("CI"):
        pytest.fail(f"CI needs the PostgreSQL server binaries: {reason}")
    if reason:
        pytest.skip(f"cannot build a primary and a standby here: {reason}")
    built = Pair(synchronous=False)
    try:
        yield built
    finally:
        built.remove()


@pytest.fixture
def backends() -> Iterator:
    made: list[PostgresBackend] = []

    def make(url: str, instance: str) -> PostgresBackend:
        backend = PostgresBackend(url, instance=instance, namespace=NAMESPACE, holder_timeout=30)
        made.append(backend)
        return backend

    yield make
    for backend in made:
        backend.close()
        backend.ledger_engine.dispose()


def server_port(backend: PostgresBackend) -> int:
    with backend.ledger_engine.connect() as conn:
        return int(conn.execute(text("SELECT inet_server_port()")).scalar_one())


def test_a_standby_listed_first_is_passed_over_for_the_primary(pair, backends):
    assert pair.standby is not None
    url = (
        f"postgresql://postgres@127.0.0.1:{pair.standby.port},"
        f"127.0.0.1:{pair.primary.port}/postgres"
    )
    backend = backends(url, "first-is-standby")
    backend.migrate()
    backend.connect()
    assert server_port(backend) == pair.primary.port
    with psycopg.connect(pair.primary.url(), autocommit=True) as admin:
        names = {n for (n,) in admin.execute("SELECT application_name FROM pg_stat_activity")}
    assert "first-is-standby" in names


def test_a_dead_host_that_drops_packets_costs_a_tenth_of_holder_timeout(pair, backends):
    # A listening socket that never answers: the connection opens, the server never speaks.
    with socket.socket() as dead:
        dead.bind(("127.0.0.1", 0))
        dead.listen(8)
        url = (
            f"postgresql://postgres@127.0.0.1:{dead.getsockname()[1]},"
            f"127.0.0.1:{pair.primary.port}/postgres"
        )
        backend = backends(url, "past-a-dead-host")
        started = time.monotonic()
        backend.connect()
        took = time.monotonic() - started
    assert took < 8, f"took {took:.1f} s past the dead host (a third of 30 s would be 10)"
    assert server_port(backend) == pair.primary.port


def test_a_standby_alone_is_refused_by_name(pair, backends):
    assert pair.standby is not None
    where = f"127.0.0.1:{pair.standby.port}"
    anywhere = backends(pair.standby_url() + "?target_session_attrs=any", "on-standby")
    with pytest.raises(Unavailable, match=f"{where} is a standby"):
        anywhere.connect()
    with pytest.raises(OperationalError, match=f"{where} is a standby"):
        server_port(anywhere)
    by_default = backends(pair.standby_url(), "on-standby-2")
    with pytest.raises(Unavailable, match="read-only"):
        by_default.connect()


def test_an_old_primary_fenced_read_only_is_left_at_the_next_heartbeat_or_write(pair, backends):
    url = pair.primary.url()
    quiet, claiming = backends(url, "quiet"), backends(url, "claiming")
    quiet.migrate()
    quiet.connect()
    claiming.connect()
    assert server_port(quiet) == pair.primary.port  # a ledger session, for this read only
    fence(url, True)
    try:
        # A session applies the reload between two statements: one more may still pass.
        lost = until_raised(SessionLost, quiet.heartbeat)
        assert "no longer takes writes" in str(lost)
        tick = datetime.now(UTC).replace(microsecond=0)
        claims = (
            [ClaimRequest(1, "fenced", tick + timedelta(seconds=i), Intent.RUN, 30, 3)]
            for i in range(1000)
        )
        until_raised(SessionLost, lambda: claiming.claim(next(claims), "claiming", capacity=1))
        # The ledger's next session is refused as it opens (libpq's read-write check), the
        # node named: none of its sessions is kept from before the fence to meet 25006.
        refused = until_raised(DBAPIError, lambda: write(quiet))
        assert f"port {pair.primary.port} failed: session is read-only" in str(refused)
        with pytest.raises(OperationalError, match="is read-only"):
            server_port(quiet)
        with pytest.raises(Unavailable, match="is read-only"):
            quiet.connect()
    finally:
        fence(url, False)


def write(backend: PostgresBackend) -> None:
    with backend.ledger_engine.begin() as conn:
        conn.execute(text("CREATE TEMPORARY TABLE t (a int) ON COMMIT DROP"))


def until_raised(kind: type[BaseException], call: Callable[[], object]) -> BaseException:
    """Call until it raises `kind` (within 10 s); the reload reaches each session in turn."""
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        try:
            call()
        except kind as exc:
            return exc
        time.sleep(0.05)
    raise AssertionError(f"{call} never raised {kind.__name__}")


def fence(url: str, read_only: bool) -> None:
    """What an operator may do to an old primary that stays up: no more writes there."""
    with psycopg.connect(url, autocommit=True) as admin:
        if read_only:
            admin.execute("ALTER SYSTEM SET default_transaction_read_only = on")
        else:
            admin.execute("ALTER SYSTEM RESET default_transaction_read_only")
        admin.execute("SELECT pg_reload_conf()")
