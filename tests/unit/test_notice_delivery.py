"""Delivering notices and pings to receivers that are slow or hostile, and the words Slack is
sent (docs/operating.md: Alerts and notices, Network budgets). Embedded ledger, real local
receivers."""

from __future__ import annotations

import logging
import socket
import time
from collections.abc import Iterator
from datetime import UTC, datetime

import pytest
from sqlalchemy import select

from scheduler.backends.embedded import EmbeddedBackend
from scheduler.config.budgets import ATTEMPT_DEADLINE
from scheduler.ledger import tables
from scheduler.ledger.outbox import add_notice
from scheduler.observers import alerts, events
from scheduler.observers.notices import Notices
from scheduler.observers.pings import Pings
from tests.support import RawReceiver, wait_for

DRIP_FOR = 40  # seconds a dripping receiver takes over its answer, a byte a second


def drip_for_slow_jobs(receiver: RawReceiver, conn: socket.socket, request: bytes) -> None:
    """The notices of job `slow` are answered a byte a second; the others at once."""
    if b'"job": "slow"' not in request and b"/slow" not in request.split(b"\r\n")[0]:
        receiver.send(conn, b"HTTP/1.0 200 OK\r\nContent-Length: 2\r\n\r\nok")
        return
    for byte in (b"HTTP/1.1 200 OK\r\n" + b"X-Slow: " + b"y" * DRIP_FOR)[:DRIP_FOR]:
        receiver.send(conn, bytes([byte]))
        time.sleep(1)


@pytest.fixture
def backend(tmp_path) -> Iterator[EmbeddedBackend]:
    backend = EmbeddedBackend(tmp_path / "scheduler.db", instance="u1", namespace=77)
    backend.migrate()
    yield backend
    backend.close()


@pytest.fixture
def receiver() -> Iterator[RawReceiver]:
    receiver = RawReceiver(drip_for_slow_jobs)
    yield receiver
    receiver.close()


def raise_notice(backend: EmbeddedBackend, job: str, key: int) -> int:
    with backend.ledger_engine.begin() as conn:
        return add_notice(
            conn, alerts.FAILURES_EXCEEDED, key, job,
            {"consecutive_failures": 3, "instance": "u1", "error": "disk full"},
            raised_by="u1", now=datetime.now(UTC), deliverer="u1",
        )  # fmt: skip


def row(backend: EmbeddedBackend, notice: int) -> object:
    with backend.ledger_engine.connect() as conn:
        return conn.execute(select(tables.notices).where(tables.notices.c.id == notice)).one()


def arrived(receiver: RawReceiver, job: str) -> float | None:
    """When the first POST of `job`'s notice reached the receiver."""
    for at, request in receiver.requests:
        if f'"job": "{job}"'.encode() in request:
            return at
    return None


def test_a_dripping_receiver_costs_one_attempt_and_holds_up_no_other_notice(
    backend, receiver, caplog
):
    caplog.set_level(logging.INFO, "scheduler.alerts")
    notices = Notices(backend.ledger_engine, "u1", receiver.url())
    try:
        slow = raise_notice(backend, "slow", 1)
        notices.schedule([slow])
        wait_for(lambda: arrived(receiver, "slow"), 10, "the first notice's POST")
        attempt_started = arrived(receiver, "slow")
        raised, raised_wall = time.monotonic(), time.time()
        fast = raise_notice(backend, "fast", 2)
        notices.schedule([fast])
        # Logged and POSTed while the first attempt still drips, within one attempt's deadline.
        wait_for(lambda: arrived(receiver, "fast"), ATTEMPT_DEADLINE, "the later notice's POST")
        (logged,) = [
            r for r in caplog.records if "ALERT" in r.getMessage() and "fast:" in r.getMessage()
        ]
        assert logged.levelno == logging.ERROR and logged.created - raised_wall < ATTEMPT_DEADLINE
        assert arrived(receiver, "fast") - raised < ATTEMPT_DEADLINE
        wait_for(lambda: row(backend, fast).outcome == "delivered", 10, "the later delivered")
        # The dripping receiver cost the first notice one failed attempt, which counts.
        wait_for(lambda: row(backend, slow).attempts == 1, 2 * ATTEMPT_DEADLINE, "one attempt")
        failed = [r for r in caplog.records if "not delivered" in r.getMessage()]
        assert len(failed) == 1 and "within 5 s" in failed[0].getMessage(), caplog.text
        took = failed[0].created - (time.time() - (time.monotonic() - attempt_started))
        assert took < ATTEMPT_DEADLINE + 3, f"the attempt ended {took:.1f} s after it began"
        assert row(backend, slow).outcome is None  # retried later, with backoff
    finally:
        notices.close(0)


def test_a_slow_ping_service_holds_up_no_other_hosts_pings(receiver):
    good = RawReceiver(lambda r, conn, _: r.send(conn, b"HTTP/1.0 200 OK\r\n\r\n"))
    pings = Pings()
    try:
        for tick in range(3):
            pings.run_started(started(f"{receiver.url('/slow')}", tick))
        sent = time.monotonic()
        pings.run_started(started(good.url("/fine"), 9))
        wait_for(lambda: good.requests, ATTEMPT_DEADLINE, "the other host's ping")
        assert good.requests[0][0] - sent < ATTEMPT_DEADLINE
        assert good.requests[0][1].startswith(b"POST /fine/start ")
    finally:
        pings.close(0)
        good.close()


def started(ping_url: str, run_id: int) -> events.RunStarted:
    return events.RunStarted(
        job="j", key=1, scheduled_at=datetime.now(UTC), run_id=run_id, instance="u1",
        lateness_s=0.0, manual=False, crashed=0, skips_ended=0, ping_url=ping_url,
    )  # fmt: skip


@pytest.mark.parametrize(
    ("event", "field", "said"),
    [
        (alerts.JOB_PAUSED, "reason", "<!channel> & <@U0123|all> look"),
        (alerts.FAILURES_EXCEEDED, "error", "<!here> a > b & c"),
    ],
)
def test_the_webhook_text_is_escaped_for_slack_and_the_log_line_is_not(event, field, said):
    notice = alerts.Notice(
        id=1, event=event, job="sync", key=1, scheduled_at=None, facts={field: said},
        raised_by="u1", raised_at=datetime.now(UTC), attempts=0,
    )  # fmt: skip
    text = notice.body()["text"]
    assert "<" not in text and ">" not in text, text
    assert said.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;") in text
    assert said in notice.log_line()  # people read the log as it was said
    assert notice.body()[field] == said  # the JSON fields are data, not Slack text


def test_a_notice_is_retried_until_its_deadline_and_given_up_only_then(backend):
    """The last retry falls at GIVE_UP_AFTER itself, however long the backoff has grown:
    a notice is never given up before its 15 minutes (docs/operating.md: Alerts)."""
    from datetime import timedelta

    from scheduler.observers.alerts import Notice
    from scheduler.observers.notices import GIVE_UP_AFTER

    ident = raise_notice(backend, "late", 3)
    raised = row(backend, ident).raised_at.replace(tzinfo=UTC)
    deadline = raised + GIVE_UP_AFTER
    clock = [deadline - timedelta(seconds=20)]  # the backoff would now wait 60 s
    notices = Notices(backend.ledger_engine, "u1", "http://127.0.0.1:9/", clock=lambda: clock[0])
    try:
        notice = Notice.from_row({**row(backend, ident)._mapping, "attempts": 9})
        notices._record(notice, "connection refused")
        found = row(backend, ident)
        assert found.outcome is None
        assert found.next_attempt_at.replace(tzinfo=UTC) == deadline
        clock[0] = deadline  # that last retry failed too
        notices._record(notice, "connection refused")
        assert row(backend, ident).outcome == "given_up"
    finally:
        notices.close(0)
