"""A fleet through the autumn DST change in Europe/Berlin, on replicas' own clocks.

Two embedded replicas run under libfaketime, each clock started at a chosen
instant (FAKETIME="@…", TZ=UTC) and running in real time from there. On
2026-10-25 the local clock goes from 03:00 CEST back to 02:00 CET at 01:00Z,
so 02:00-02:59 local happens twice: at 00:xxZ and again at 01:xxZ.

- Across 01:00Z: both replicas stay up, a 1 s interval job and a real-time
  cron job with seconds keep ticking (each tick once), the housekeeping sweep
  keeps running and looks at ticks inside the repeated hour, memory stays flat.
- `30 2 * * *` (a job at a specific time) runs at its first 02:30 (00:30Z) and
  not at its second (01:30Z): no run and no `missed` row for 01:30Z.

Three short runs on one folder and ledger, each starting a little before the
instant it is about.
"""

from __future__ import annotations

import sqlite3
from datetime import UTC, datetime
from pathlib import Path

import pytest

from tests.support import (
    Fleet,
    assert_exactly_once,
    faketime_library,
    runs_per_tick,
    wait_for,
    whole_seconds,
)

pytestmark = pytest.mark.fleet

JOBS = ["dst.py"]  # tick, wall, nightly: each run only leaves its evidence
# A short misfire grace on the cron jobs: the sweep looks at their ticks a few
# seconds after they fall due (grace + 5 s), so within one sweep period it walks
# ticks of the repeated hour.
SCHEDULES = {
    "tick": {"interval": "1s"},
    "wall": {"cron": "*/2 * * * * *", "misfire_grace": "3s"},
    "nightly": {"cron": "30 2 * * *", "misfire_grace": "3s"},
}


def Z(text: str) -> datetime:
    return datetime.fromisoformat(text).replace(tzinfo=UTC)


def _start(fleet: Fleet, names: list[str], at: str) -> None:
    for name in names:
        fleet.start(name, clock_offset=f"@{at}", env={"TZ": "UTC"})
    for name in names:  # Fleet.wait_ready would also wait for the earlier runs' replicas
        replica = fleet.replicas[name]
        wait_for(
            lambda r=replica: "lock session up" in r.log() or r.process.poll() is not None,
            60,
            f"{name} to start",
        )
        assert replica.process.poll() is None, f"{name} exited:\n{replica.log()}"


def _stop(fleet: Fleet, names: list[str]) -> None:
    alive = {name: fleet.replicas[name].process.poll() is None for name in names}
    codes = fleet.stop()
    assert alive == dict.fromkeys(names, True), f"a replica died:\n{fleet.logs()}"
    assert {n: codes[n] for n in names} == dict.fromkeys(names, 0), fleet.logs()


def _ran(fleet: Fleet, job: str, tick: str) -> int:
    """How many runs the tick at 2026-10-25 `tick` UTC had, from the jobs' evidence."""
    return runs_per_tick(fleet.evidence(), job)[Z(f"2026-10-25 {tick}")]


def _swept(root: Path, since: str) -> bool:
    """The fleet swept at 2026-10-25 `since` UTC or later (by the sweeping replica's clock)."""
    last = _last_sweep(root)
    return last is not None and last >= Z(f"2026-10-25 {since}")


def _ledger(root: Path) -> list[dict]:
    with sqlite3.connect(root / "scheduler.db") as conn:
        conn.row_factory = sqlite3.Row
        rows = [dict(r) for r in conn.execute("SELECT * FROM scheduler_ticks")]
    for row in rows:
        row["scheduled_at"] = datetime.fromisoformat(row["scheduled_at"]).replace(tzinfo=UTC)
    return rows


def _last_sweep(root: Path) -> datetime | None:
    """When the fleet last swept (by the sweeping replica's clock)."""
    try:
        with sqlite3.connect(root / "scheduler.db") as conn:
            row = conn.execute(
                "SELECT last_run_at FROM scheduler_maintenance WHERE task = 'sweep'"
            ).fetchone()
    except sqlite3.OperationalError:  # not created yet
        return None
    return datetime.fromisoformat(row[0]).replace(tzinfo=UTC) if row else None


def _rss_kb(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    raise AssertionError(f"no VmRSS for {pid}")


def test_a_fleet_through_the_autumn_change(tmp_path):
    faketime_library()  # fails with the install hint when libfaketime is missing
    fleet = Fleet(
        tmp_path,
        None,
        SCHEDULES,
        settings={"timezone": "Europe/Berlin"},
        job_files=JOBS,
    )
    try:
        # 1. The first 02:30 (CEST) is 00:30Z: the job runs.
        _start(fleet, ["a1", "b1"], "2026-10-25 00:29:45")
        wait_for(lambda: _ran(fleet, "nightly", "00:30:00"), 60, "nightly's 00:30Z run")
        _stop(fleet, ["a1", "b1"])

        # 2. Across the change at 01:00Z (03:00 CEST -> 02:00 CET).
        _start(fleet, ["a2", "b2"], "2026-10-25 00:59:40")
        pids = [fleet.replicas[n].pid for n in ("a2", "b2")]
        wait_for(lambda: _ran(fleet, "tick", "00:59:55"), 60, "the window to begin")
        rss_before = [_rss_kb(pid) for pid in pids]
        # A sweep at 01:00:08 or later walks `wall` up to 01:00:00 or later
        # (grace 3 s + 5 s): ticks inside the repeated hour.
        wait_for(lambda: _swept(tmp_path, "01:00:08"), 90, "a sweep after the change")
        wait_for(lambda: _ran(fleet, "tick", "01:00:14"), 30, "the window to end")
        rss_after = [_rss_kb(pid) for pid in pids]
        _stop(fleet, ["a2", "b2"])
        evidence = fleet.evidence()
        window = whole_seconds(Z("2026-10-25 00:59:55"), Z("2026-10-25 01:00:14"))
        assert_exactly_once(evidence, "tick", window, fleet.logs())
        assert_exactly_once(evidence, "wall", window[1::2], fleet.logs())  # even seconds
        grown = [(b - a) / 1024 for a, b in zip(rss_before, rss_after, strict=True)]
        assert max(grown) < 5, f"memory grew by {grown} MB across the change"

        # 3. The second 02:30 (CET) is 01:30Z: the job does not run, and the
        # sweep, walking past it, does not call it missed.
        _start(fleet, ["a3", "b3"], "2026-10-25 01:29:45")
        wait_for(lambda: _ran(fleet, "wall", "01:30:02"), 60, "wall to pass 01:30Z")
        wait_for(lambda: _swept(tmp_path, "01:30:08"), 90, "a sweep after 01:30Z")
        _stop(fleet, ["a3", "b3"])
    finally:
        fleet.kill_all()

    assert runs_per_tick(fleet.evidence(), "nightly") == {Z("2026-10-25 00:30"): 1}
    rows = [r for r in _ledger(tmp_path) if r["job_name"] == "nightly"]
    assert [(r["scheduled_at"], r["status"]) for r in rows] == [
        (Z("2026-10-25 00:30"), "succeeded")
    ], rows
    # The sweeps walked the repeated hour: what no replica was up for is `missed`.
    wall = {r["scheduled_at"]: r["status"] for r in _ledger(tmp_path) if r["job_name"] == "wall"}
    assert wall.get(Z("2026-10-25 01:29:00")) == "missed", fleet.logs()
    assert wall.get(Z("2026-10-25 01:30:00")) == "succeeded", fleet.logs()
