"""The library API (`scheduler.Replica`) on PostgreSQL: it runs ticks through the gate, and
its stop leaves no session behind in a process that goes on."""

from __future__ import annotations

import os
import textwrap
from pathlib import Path

import psycopg
import pytest

from scheduler import Replica
from tests.support import wait_for

JOBS = """
from scheduler import job

@job(key=3201)
def beat(ctx):
    pass
"""


def sessions(url: str, name: str) -> int:
    with psycopg.connect(url, autocommit=True) as conn:
        row = conn.execute(
            "SELECT count(*) FROM pg_stat_activity WHERE application_name = %s", (name,)
        ).fetchone()
    assert row is not None
    return int(row[0])


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
        assert sessions(database_url, name) >= 1  # the lock session, at least
        wait_for(lambda: succeeded(database_url) >= 2, 15, "two ticks recorded")
    assert not replica.active
    wait_for(lambda: sessions(database_url, name) == 0, 5, "no session of the stopped replica")
