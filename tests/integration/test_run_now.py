"""Run-now requests on both backends: the fleet hears of one, exactly one replica takes it."""

from __future__ import annotations

import select
from datetime import UTC, datetime

from scheduler import run_now
from tests.support import wait_for

KEY = 91


def ask(backend, key: int = KEY) -> int:
    with backend.ledger_engine.begin() as conn:
        return run_now.ask(conn, key, "job", by="ops", now=datetime.now(UTC), namespace=4242)


def hears(backend) -> bool:
    """What the dispatcher does: a readable lock-session socket is read, then asked."""
    fd = backend.fileno()
    if fd is not None and select.select([fd], [], [], 0)[0]:
        backend.check_alive()
    return backend.requests_pending()


def test_a_request_is_heard_and_taken_by_exactly_one_replica(backends):
    a, b = backends("a"), backends("b")
    a.take_requests("a", [KEY])  # what a fresh session looks for: nothing yet
    b.take_requests("b", [KEY])
    request = ask(a)
    wait_for(lambda: hears(a) and hears(b), 10, "both replicas to hear of the request")
    first, second = a.take_requests("a", [KEY]), b.take_requests("b", [KEY])
    assert [r.id for r in first] == [request] and second == []
    with a.ledger_engine.begin() as conn:
        assert run_now.state(conn, request)["taken_by"] == "a"
        assert not run_now.withdraw(conn, request)  # taken: the command cannot withdraw it


def test_a_request_for_a_job_a_replica_does_not_run_is_left_to_others(backends):
    a = backends("a")
    request = ask(a, key=4444)
    assert a.take_requests("a", [KEY]) == []
    with a.ledger_engine.begin() as conn:
        assert run_now.withdraw(conn, request)  # nobody took it: the command withdraws it
        assert run_now.state(conn, request) is None


def test_the_heartbeat_finds_a_request_a_notification_missed(backends):
    a = backends("a")
    a.take_requests("a", [KEY])
    with a.ledger_engine.begin() as conn:  # no NOTIFY: as if the session was away
        run_now.ask(conn, KEY, "job", by="ops", now=datetime.now(UTC), namespace=None)
    a.heartbeat()
    wait_for(a.requests_pending, 5, "the heartbeat to see the request")
    assert len(a.take_requests("a", [KEY])) == 1
