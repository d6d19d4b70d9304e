"""A replica killed mid-run frees its locks at once; the next tick runs elsewhere; the
killed run is recorded `crashed` (docs/faults.md: Faults)."""

from __future__ import annotations

import signal

import pytest

from tests.support import Fleet, parse_tick, wait_for

pytestmark = pytest.mark.fleet

JOBS = ["crash.py"]  # long_job: 30 s


@pytest.mark.parametrize("backend", ["postgresql", "embedded"])
def test_sigkill_mid_run_next_tick_runs_elsewhere(tmp_path, request, backend):
    url = request.getfixturevalue("database_url") if backend == "postgresql" else None
    fleet = Fleet(tmp_path, url, {"long_job": {"interval": "2s"}}, job_files=JOBS)
    fleet.start("r1")
    fleet.start("r2")
    try:
        fleet.wait_ready()
        first = wait_for(
            lambda: fleet.starts(),
            30,
            "the long job to start",
        )[0]
        victim = fleet.replicas[first["instance"]]
        survivor = next(r for r in fleet.replicas.values() if r is not victim)
        victim.signal(signal.SIGKILL)
        victim.wait(10)

        taken_over = wait_for(
            lambda: fleet.starts(survivor.name),
            20,
            "the next tick to start on the survivor",
        )[0]
        assert parse_tick(taken_over["tick"]) > parse_tick(first["tick"])
        assert taken_over["run_id"] > first["run_id"]
        assert not taken_over["overlap"]
        rows = wait_for(
            lambda: [
                r
                for r in _ledger(fleet, tmp_path)
                if r["scheduled_at"] == parse_tick(first["tick"]) and r["status"] == "crashed"
            ],
            20,
            "the killed run to be recorded crashed",
        )
        assert rows[0]["instance"] == victim.name
        codes = fleet.stop()
    finally:
        fleet.kill_all()
    assert codes[survivor.name] == 0, fleet.logs()
    starts = fleet.starts()
    ticks = [e["tick"] for e in starts]
    assert len(ticks) == len(set(ticks)), f"a tick ran twice: {starts}"


def _ledger(fleet: Fleet, root) -> list[dict]:
    if fleet.database_url:
        return fleet.ledger()
    import sqlite3
    from datetime import UTC, datetime

    with sqlite3.connect(root / "scheduler.db") as conn:
        conn.row_factory = sqlite3.Row
        rows = [dict(r) for r in conn.execute("SELECT * FROM scheduler_ticks")]
    for row in rows:
        row["scheduled_at"] = datetime.fromisoformat(row["scheduled_at"]).replace(tzinfo=UTC)
    return rows
