"""The library API (`scheduler.Replica`) on PostgreSQL: it runs ticks through the gate, and
its stop leaves no session behind in a process that goes on."""

from __future__ import annotations

import os
import textwrap
import time
from pathlib import Path

import psycopg
import pytest

from scheduler import Replica
from tests.support import sessions_named, wait_for

JOBS = """
from scheduler import job

@job(key=3201)
def beat(ctx):
    pass
"""


def succeeded(url: str) -> int:
    with psycopg.connect(url, autocommit=True) as conn:
        row = conn.execute(
            "SELECT count(*) FROM scheduler_ticks WHERE status = 'succeeded'"
        ).fetchone()
    assert row is not None
    return int(row[0])


@pytest.fixture
def config(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    for var in [v for v in os.environ if v.startswith("SCHEDULER_")]:
        monkeypatch.delenv(var)
    (tmp_path / "jobs").mkdir()
    (tmp_path / "jobs" / "beat.py").write_text(textwrap.dedent(JOBS))
    (tmp_path / "config.yaml").write_text("jobs:\n  beat:\n    interval: 1s\n")
    return tmp_path / "config.yaml"


def test_a_replica_runs_ticks_on_postgresql_and_leaves_no_session(config, database_url):
    name = "api-3201"
    replica = Replica(config=config, database_url=database_url, instance_name=name)
    with replica:
        assert replica.active
        assert sessions_named(database_url, name) >= 1  # the lock session, at least
        wait_for(lambda: succeeded(database_url) >= 2, 15, "two ticks recorded")
    assert not replica.active
    wait_for(
        lambda: sessions_named(database_url, name) == 0, 5, "no session of the stopped replica"
    )


def test_between_chores_a_replica_holds_its_lock_session_alone(config, database_url):
    """The ledger's session is opened for a chore and closed after it, so a fleet of N
    replicas holds about N sessions, not 2N (chores come every 30 s)."""
    name = "api-3202"
    replica = Replica(config=config, database_url=database_url, instance_name=name)
    with replica:
        wait_for(lambda: succeeded(database_url) >= 2, 15, "two ticks recorded")
        seen = []
        for _ in range(20):
            seen.append(sessions_named(database_url, name))
            time.sleep(0.1)
        # A chore may be going at one sample or two (the first pass comes 1 s in).
        assert max(seen) <= 2, seen
        assert seen.count(1) >= 15, seen
