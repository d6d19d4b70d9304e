"""Which ticks were due, on real replicas (README: Housekeeping): a tick is judged by the
schedule in force at it, never by today's. A restart with a new schedule catches up the
old one's ticks of the downtime only; a fleet that was down, came back with another schedule and was
reloaded has a row for each tick of the schedule in force then, and for no other."""

from __future__ import annotations

import json
import time
from datetime import UTC, datetime, timedelta

import psycopg
import pytest

from tests.support import Fleet, parse_tick, wait_for

pytestmark = pytest.mark.fleet

JOBS = ["policies.py"]


def edit(fleet: Fleet, old: str, new: str) -> None:
    path = fleet.root / "config.yaml"
    text = path.read_text()
    assert old in text, text
    path.write_text(text.replace(old, new))


def in_force_since(fleet: Fleet, seconds: int) -> datetime | None:
    """When replica p1's schedule `every <seconds>s` came in force, if it did."""
    with psycopg.connect(fleet.database_url) as conn:
        found = conn.execute(
            "SELECT schedule, since FROM scheduler_registrations WHERE instance = 'p1'"
        ).fetchall()
    return next(
        (
            s.astimezone(UTC)
            for text, s in found
            if text and json.loads(text)["interval"] == seconds
        ),
        None,
    )


def session_up(fleet: Fleet, name: str) -> datetime:
    """When replica `name`'s lock session came up: it holds (namespace, 0) in share mode."""
    with psycopg.connect(fleet.database_url, autocommit=True) as conn:
        row = conn.execute(
            "SELECT a.backend_start FROM pg_locks l JOIN pg_stat_activity a ON a.pid = l.pid"
            " WHERE l.locktype = 'advisory' AND l.objsubid = 2 AND l.objid = 0"
            " AND l.mode = 'ShareLock' AND a.application_name = %s"
            " AND a.datname = current_database()",
            (name,),
        ).fetchone()
    assert row is not None, f"{name} holds no lock session"
    return row[0].astimezone(UTC)


def swept_until(fleet: Fleet) -> datetime:
    """How far the sweep has recorded missed ticks."""
    with psycopg.connect(fleet.database_url) as conn:
        (at,) = conn.execute(
            "SELECT last_run_at FROM scheduler_maintenance WHERE task = 'missed'"
        ).fetchone()
    return at.astimezone(UTC)


def grid(seconds: int, after: datetime, before: datetime) -> list[datetime]:
    first = int(after.timestamp()) // seconds * seconds + seconds
    ticks = (
        datetime.fromtimestamp(t, UTC) for t in range(first, int(before.timestamp()) + 1, seconds)
    )
    return [t for t in ticks if t < before]


def off_schedule(rows: list[dict], changes: list[tuple[datetime, int]]) -> list[str]:
    """Rows whose tick the schedule in force at it (`changes`: from when, every n s) lacks."""
    wrong = []
    for row in rows:
        at = row["scheduled_at"]
        every = [n for since, n in changes if since <= at][-1]
        if at.timestamp() % every:
            wrong.append(f"{at.isoformat()} {row['status']} (every {every}s then)")
    return wrong


def test_a_restart_with_a_new_schedule_catches_up_only_ticks_of_the_old_one(tmp_path, database_url):
    schedule = {
        "interval": "5s",
        "catch_up": "all",
        "catch_up_window": "1m",
        "catch_up_limit": 10,
        "misfire_grace": "1s",
    }
    fleet = Fleet(
        tmp_path, database_url, {"backlog": schedule}, {"holder_timeout": 6}, job_files=JOBS
    )
    try:
        fleet.start("p1")
        fleet.wait_ready()
        wait_for(lambda: len(fleet.ends()) >= 7, 120, "35 s of runs every 5 s")
        assert fleet.stop() == {"p1": 0}, fleet.logs()
        edit(fleet, "interval: 5s", "interval: 7s")
        time.sleep(6)  # a tick of the 5 s schedule or two with no replica up
        fleet.start("p1")
        fleet.wait_ready()
        changed = wait_for(lambda: in_force_since(fleet, 7), 30, "the 7 s schedule")

        def on_seven() -> int:
            return sum(parse_tick(e["tick"]) > changed for e in fleet.ends())

        wait_for(lambda: on_seven() >= 2, 60, "two runs on the 7 s grid")  # the pass is done
        rows = fleet.ledger("backlog")
        first = min(r["scheduled_at"] for r in rows)
        wrong = off_schedule(rows, [(first, 5), (changed, 7)])
        assert wrong == [], f"rows no schedule in force had: {wrong}\n{fleet.logs()}"
        # Every tick of the 5 s schedule until the change has a row: run, caught up or missed.
        have = {r["scheduled_at"] for r in rows}
        assert [t for t in grid(5, first, changed) if t not in have and t > first] == []
        # Catch-up takes the ticks due before the fleet's first replica came up (its lock
        # session); later ones are fired live. The replica registers its schedule a moment
        # before its session comes up, so a tick of the new schedule may fall between.
        up = session_up(fleet, "p1")
        caught_up = [r["scheduled_at"] for r in rows if r["caught_up"]]
        assert caught_up and max(caught_up) <= max(changed, up), (caught_up, changed, up, rows)
    finally:
        fleet.kill_all()


def test_a_fleet_down_then_back_with_another_schedule_and_reloaded_explains_each_tick(
    tmp_path, database_url
):
    """7 s; every replica down for 25 s; back with 10 s; `reload: watch` makes it 5 s."""
    fleet = Fleet(
        tmp_path,
        database_url,
        {"backlog": {"interval": "7s", "misfire_grace": "1s"}},
        {"holder_timeout": 6, "reload": "watch"},
        job_files=JOBS,
    )
    try:
        fleet.start("p1")
        fleet.wait_ready()
        wait_for(lambda: len(fleet.ends()) >= 2, 60, "runs every 7 s")
        assert fleet.stop() == {"p1": 0}, fleet.logs()
        time.sleep(25)
        edit(fleet, "interval: 7s", "interval: 10s")
        fleet.start("p1")
        fleet.wait_ready()
        back = wait_for(lambda: in_force_since(fleet, 10), 30, "the 10 s schedule")
        margin = timedelta(seconds=7)  # the grace and the sweep's margin, and a second
        wait_for(lambda: swept_until(fleet) > back + margin, 120, "a sweep past the restart")
        first = min(r["scheduled_at"] for r in fleet.ledger("backlog"))
        wrong = off_schedule(fleet.ledger("backlog"), [(first, 7), (back, 10)])
        assert wrong == [], f"rows no schedule in force had: {wrong}\n{fleet.logs()}"

        edit(fleet, "interval: 10s", "interval: 5s")
        reloaded = wait_for(lambda: in_force_since(fleet, 5), 30, "the reload to 5 s")
        wait_for(lambda: swept_until(fleet) > reloaded + margin, 120, "a sweep past the reload")
        rows = fleet.ledger("backlog")
    finally:
        fleet.kill_all()
    changes = [(first, 7), (back, 10), (reloaded, 5)]
    wrong = off_schedule(rows, changes)
    assert wrong == [], f"rows no schedule in force had: {wrong}\n{fleet.logs()}"
    # The ledger explains every tick that was due: the downtime's are recorded missed.
    have = {r["scheduled_at"]: r["status"] for r in rows}
    due = [*grid(7, first, back), *grid(10, back, reloaded), *grid(5, reloaded, reloaded + margin)]
    assert [t.isoformat() for t in due if t not in have and t > first] == [], fleet.logs()
    down = [t for t in grid(7, first, back) if have[t] != "succeeded"]
    assert len(down) >= 3 and {have[t] for t in down} == {"missed"}, have
