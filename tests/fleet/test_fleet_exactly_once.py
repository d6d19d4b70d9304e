"""While a replica is healthy, every tick runs on exactly one replica, with clocks skewed
between replicas and with jobs that finish in a millisecond (docs/guarantees.md: How a tick runs).

Real `scheduler run` processes against a real PostgreSQL; the evidence is
what the jobs themselves wrote, not the ledger under test.
"""

from __future__ import annotations

import os
import time
from collections import Counter
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest

from tests.support import Fleet, assert_exactly_once, whole_seconds

pytestmark = pytest.mark.fleet

JOBS = ["exactly_once.py"]  # every_second, cron_second: 1 ms each
SCHEDULES = {"every_second": {"interval": "1s"}, "cron_second": {"cron": "* * * * * *"}}
WINDOW_S = 12


def _run_fleet(fleet: Fleet, offsets: dict[str, str | None]) -> list[dict]:
    for name, offset in offsets.items():
        fleet.start(name, clock_offset=offset)
    try:
        fleet.wait_ready()
        start = datetime.now(UTC) + timedelta(seconds=1.5)
        time.sleep(WINDOW_S + 1.5)
        end = datetime.now(UTC) - timedelta(seconds=1.5)
        codes = fleet.stop()
    finally:
        fleet.kill_all()
    assert codes == dict.fromkeys(offsets, 0), fleet.logs()
    evidence = fleet.evidence()
    window = whole_seconds(start, end)
    assert len(window) >= 10
    for job in ("every_second", "cron_second"):
        assert_exactly_once(evidence, job, window, fleet.logs())
    overlaps = [e for e in evidence if e.get("overlap")]
    assert not overlaps, f"runs of one job overlapped: {overlaps}"
    # The ledger agrees with the evidence: one row per tick, all succeeded.
    rows = fleet.ledger() if fleet.database_url else _sqlite_rows(fleet)
    keys = [(r["job_key"], r["scheduled_at"]) for r in rows]
    assert len(keys) == len(set(keys))
    in_window = [r for r in rows if start <= r["scheduled_at"] <= end]
    assert {r["status"] for r in in_window} == {"succeeded"}, in_window
    return evidence


def _sqlite_rows(fleet: Fleet) -> list[dict]:
    import sqlite3

    with sqlite3.connect(fleet.root / "scheduler.db") as conn:
        conn.row_factory = sqlite3.Row
        rows = [dict(r) for r in conn.execute("SELECT * FROM scheduler_ticks")]
    for row in rows:
        row["scheduled_at"] = datetime.fromisoformat(row["scheduled_at"]).replace(tzinfo=UTC)
    return rows


def test_three_replicas_run_each_tick_once(tmp_path, database_url):
    fleet = Fleet(tmp_path, database_url, SCHEDULES, job_files=JOBS)
    evidence = _run_fleet(fleet, {"r1": None, "r2": None, "r3": None})
    instances = {e["instance"] for e in evidence}
    assert len(instances) >= 2, f"expected the work spread over replicas, got {instances}"


def test_skewed_clocks_still_run_each_tick_once(tmp_path, database_url):
    if not list(Path("/usr/lib").glob("*/faketime/libfaketimeMT.so.1")):
        if os.environ.get("CI"):
            pytest.fail("faketime is required in CI (apt-get install faketime)")
        pytest.skip("faketime not installed (apt-get install faketime)")
    fleet = Fleet(tmp_path, database_url, SCHEDULES, job_files=JOBS)
    evidence = _run_fleet(fleet, {"ahead": "+0.45s", "behind": "-0.45s", "exact": None})
    # The skew was in effect: the replica whose clock runs ahead fires first and wins
    # most ticks; the others' triggers fire after its 1 ms runs have ended, and a
    # lock alone would have let them run every tick again.
    won = Counter(e["instance"] for e in evidence if e.get("event") == "start")
    assert won["ahead"] > sum(won.values()) / 2, won


def test_embedded_mode_two_replicas_in_one_folder_run_each_tick_once(tmp_path):
    """No database configured: SQLite and file locks coordinate the processes of one host."""
    fleet = Fleet(tmp_path, None, SCHEDULES, job_files=JOBS)
    evidence = _run_fleet(fleet, {"r1": None, "r2": None})
    assert "coordinates the processes of this host only" in fleet.logs()
    assert (tmp_path / "scheduler.db").exists()
    assert len(evidence) >= 20
