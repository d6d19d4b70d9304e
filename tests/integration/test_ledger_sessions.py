"""The ledger's sessions (`SessionPerUse`): opened for a use, closed after it, two at most."""

from __future__ import annotations

import logging
import threading
import uuid

import pytest
from sqlalchemy import text
from sqlalchemy.exc import TimeoutError as PoolTimeout

from scheduler.backends.pg_session import SessionPerUse, connect_args, psycopg_engine
from tests.support import sessions_named

NAME = f"ledger-sessions-{uuid.uuid4().hex[:8]}"  # this test worker's sessions only


def open_sessions(database_url: str) -> int:
    return sessions_named(database_url, NAME)


@pytest.fixture
def engine(database_url, monkeypatch):
    monkeypatch.setattr(SessionPerUse, "WAIT", 1.0)
    engine = psycopg_engine(
        database_url, connect_args(NAME, 12, database_url), poolclass=SessionPerUse
    )
    yield engine
    engine.dispose()


def test_a_session_is_closed_when_its_use_ends(engine, database_url):
    with engine.connect() as conn:
        conn.execute(text("SELECT 1"))
        assert open_sessions(database_url) == 1
    assert open_sessions(database_url) == 0


def test_a_third_use_at_once_waits_and_then_is_refused(engine, database_url):
    first, second = engine.connect(), engine.connect()
    try:
        assert open_sessions(database_url) == 2
        with pytest.raises(PoolTimeout, match="ledger sessions of this replica stayed busy"):
            engine.connect()
        assert open_sessions(database_url) == 2
    finally:
        first.close()
    with engine.connect() as third:  # a slot freed: the next use goes on
        third.execute(text("SELECT 1"))
    second.close()
    assert open_sessions(database_url) == 0


def test_a_use_waiting_for_a_slot_gets_it_when_one_frees(engine):
    first, second = engine.connect(), engine.connect()
    got = threading.Event()

    def third() -> None:
        with engine.connect() as conn:
            conn.execute(text("SELECT 1"))
            got.set()

    waiter = threading.Thread(target=third)
    waiter.start()
    assert not got.wait(0.2)
    second.close()
    waiter.join(5)
    assert got.is_set()
    first.close()


def test_a_failed_connect_gives_its_slot_back(database_url, monkeypatch):
    monkeypatch.setattr(SessionPerUse, "WAIT", 1.0)
    bad = database_url.rsplit("/", 1)[0] + "/no_such_database_here"
    engine = psycopg_engine(bad, connect_args(NAME, 12, bad), poolclass=SessionPerUse)
    for _ in range(3):  # more failures than slots: each gave its slot back
        with pytest.raises(Exception, match="no_such_database_here"):
            engine.connect()
    engine.dispose()


def test_a_disposed_engine_starts_with_every_slot_free(engine, database_url):
    held = engine.connect()
    engine.dispose()
    with engine.connect() as a, engine.connect() as b:
        a.execute(text("SELECT 1"))
        b.execute(text("SELECT 1"))
    held.close()
    assert open_sessions(database_url) == 0


def test_a_dispose_says_nothing_under_the_projects_logger(engine, caplog):
    with caplog.at_level(logging.INFO, logger="scheduler"):
        engine.dispose()
        with engine.connect() as conn:
            conn.execute(text("SELECT 1"))
    assert not [r for r in caplog.records if r.name.startswith("scheduler")], caplog.records
