"""`scheduler history` as a question: since, until, status, instance, zone (PostgreSQL)."""

from __future__ import annotations

import json
import os
import random
import textwrap
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest

from scheduler.backends.postgres import PostgresBackend
from scheduler.cli.commands import main
from scheduler.ledger import tables

JOBS = """
from scheduler import job

@job(key=4001)
def sync(ctx):
    pass

@job(key=4002)
def report(ctx):
    pass
"""

STATUSES = ["succeeded", "failed", "skipped", "missed", "crashed", "succeeded", "succeeded"]


@pytest.fixture
def run(tmp_path: Path, database_url: str, capsys, monkeypatch):
    for var in [v for v in os.environ if v.startswith("SCHEDULER_")]:
        monkeypatch.delenv(var)
    monkeypatch.setenv("SCHEDULER_DATABASE_URL", database_url)
    (tmp_path / "jobs").mkdir()
    (tmp_path / "jobs" / "work.py").write_text(textwrap.dedent(JOBS))
    (tmp_path / "config.yaml").write_text("jobs:\n  sync:\n    interval: 1s\n")

    def run(*args: str) -> tuple[int, str, str]:
        code = main(["history", "--config", str(tmp_path / "config.yaml"), *args])
        out, err = capsys.readouterr()
        return code, out, err

    return run


@pytest.fixture
def ledger_rows(database_url: str) -> list[dict]:
    """Three hours of ticks of two jobs, every 4 s, from three replicas: 5,400 rows."""
    backend = PostgresBackend(database_url, instance="seed", namespace=4242, holder_timeout=30)
    backend.migrate()
    rng = random.Random(7)
    now = datetime.now(UTC).replace(microsecond=0)
    rows = []
    for i in range(2700):
        tick = now - timedelta(seconds=4 * i)
        for key, name in ((4001, "sync"), (4002, "report")):
            status = rng.choice(STATUSES)
            rows.append(
                {
                    "job_key": key,
                    "scheduled_at": tick,
                    "job_name": name,
                    "status": status,
                    "instance": rng.choice(["r1", "r2", "r3"]),
                    "error": "boom" if status == "failed" else None,
                }
            )
    with backend.ledger_engine.begin() as conn:
        conn.execute(tables.ticks.insert(), rows)
    backend.ledger_engine.dispose()
    return rows


def test_the_failed_ticks_of_the_last_hour_exactly(run, ledger_rows):
    started = datetime.now(UTC)
    code, out, err = run("--since", "1h", "--status", "failed", "--json")
    assert (code, err) == (0, "")
    got = {(r["job"], r["scheduled_at"]) for r in json.loads(out)}
    hour_ago_at_most, hour_ago_at_least = (
        started - timedelta(hours=1),
        datetime.now(UTC) - timedelta(hours=1),
    )
    sure = {
        (r["job_name"], r["scheduled_at"].isoformat())
        for r in ledger_rows
        if r["status"] == "failed" and r["scheduled_at"] >= hour_ago_at_least
    }
    maybe = {  # a tick right at the edge of the hour, as the command read the clock
        (r["job_name"], r["scheduled_at"].isoformat())
        for r in ledger_rows
        if r["status"] == "failed" and hour_ago_at_most <= r["scheduled_at"] < hour_ago_at_least
    }
    assert sure <= got <= sure | maybe
    assert len(got) > 100  # more than the default limit of 50: a range shows all of it


def test_a_window_one_job_and_one_replica(run, ledger_rows):
    until = max(r["scheduled_at"] for r in ledger_rows) - timedelta(minutes=30)
    since = until - timedelta(minutes=20)
    code, out, _ = run(
        "sync",
        "--since",
        since.isoformat(),
        "--until",
        until.isoformat(),
        "--instance",
        "r2",
        "--status",
        "skipped,missed",
        "--json",
    )
    assert code == 0
    got = sorted((r["scheduled_at"], r["status"]) for r in json.loads(out))
    expected = sorted(
        (r["scheduled_at"].isoformat(), r["status"])
        for r in ledger_rows
        if r["job_name"] == "sync"
        and since <= r["scheduled_at"] <= until
        and r["instance"] == "r2"
        and r["status"] in ("skipped", "missed")
    )
    assert got == expected and got


def test_text_shows_times_to_the_millisecond_in_one_zone(run, ledger_rows):
    code, out, _ = run("--limit", "3", "--tz", "Asia/Kolkata")
    assert code == 0
    header, *lines = out.splitlines()
    assert header.split()[:7] == [
        "SCHEDULED_AT",
        "JOB",
        "STATUS",
        "ATTEMPT",
        "INSTANCE",
        "STARTED_AT",
        "DURATION",
    ]
    assert "HOLDER" in header and "NOTE" in header
    assert len(lines) == 3 and all(".000+05:30" in line.split()[0] for line in lines)
