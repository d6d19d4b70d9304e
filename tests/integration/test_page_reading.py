"""The page over PostgreSQL: no GET route changes the ledger whatever it is sent, and a
reading connection is refused writes by the server itself (docs/operating.md: The page)."""

from __future__ import annotations

from datetime import UTC, datetime

import pytest
from sqlalchemy import event, insert
from sqlalchemy.exc import DBAPIError

from scheduler.ledger import tables
from scheduler.web.reading import ReadingBackend
from scheduler.web.server import Request
from tests.unit.conftest import page_of, two_jobs
from tests.unit.test_page_fuzz import answer, filled, walk_every_get
from tests.unit.test_page_input import dump
from tests.unit.test_page_views import TOKEN


@pytest.fixture
def page(tmp_path, monkeypatch, database_url):
    path = two_jobs(tmp_path, monkeypatch)
    monkeypatch.setenv("SCHEDULER_DATABASE_URL", database_url)
    monkeypatch.setenv("SCHEDULER_INSTANCE_NAME", "page-1")
    monkeypatch.setenv("SCHEDULER_HTTP_TOKEN", TOKEN)
    made = page_of(path)
    yield made
    made.backend.ledger_engine.dispose()


def test_every_get_route_with_every_hostile_value_changes_nothing_on_postgresql(page):
    """The walk of test_page_fuzz, logged in (who reads every route), over PostgreSQL's
    reading sessions; who may read what is the same on both backends and walked there."""
    page, cookie = filled(page)
    before = dump(page)
    walk_every_get(page, cookie, everyone=False)
    assert dump(page) == before


def test_a_reading_transaction_is_refused_writes_by_postgresql(page):
    reader = ReadingBackend(page.backend)
    row = {
        "job_key": 2001,
        "job_name": "sync",
        "scheduled_at": datetime.now(UTC),
        "status": "missed",
    }
    with (
        pytest.raises(DBAPIError, match="read-only transaction"),
        reader.ledger_engine.begin() as conn,
    ):
        conn.execute(insert(tables.ticks).values(**row))
    with page.backend.ledger_engine.begin() as conn:  # the pool still writes
        conn.execute(insert(tables.ticks).values(**row))


@pytest.mark.parametrize("path", ["/", "/jobs/sync", "/jobs/report"])
def test_a_page_request_opens_one_ledger_session(page, path):
    """A replica opens a ledger session for each use (docs/operating.md: Sessions): a page
    that read its parts on a session each would queue behind the other uses on a busy
    replica. Everything a page shows is read in one transaction, on one session."""
    page, cookie = filled(page)
    opened: list[object] = []
    event.listen(page.backend.ledger_engine, "connect", lambda *a: opened.append(a))
    reply = answer(page, Request("GET", path, "", {"cookie": cookie}, b"", "::1"))
    assert reply.status == 200, reply.body[:300]
    assert len(opened) == 1
