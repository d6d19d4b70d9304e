"""Changing a running fleet: pause and resume (README: Pausing a job).

Real replicas: a pause stops the job on every replica within a tick, survives
a restart of every replica, and each tick it covers is recorded `paused` once;
resuming lets the next tick run; the webhook hears of each change once.
"""

from __future__ import annotations

import json
import time
from collections import Counter
from datetime import UTC, datetime, timedelta

import pytest

from tests.support import Fleet, Receiver, cli, parse_tick, wait_for

pytestmark = pytest.mark.fleet

JOBS = ["control.py"]
SCHEDULES = {"steady": {"interval": "1s"}}
# A short grace: the sweep explains the ticks of the restart gap soon after.
SETTINGS = {"misfire_grace": 5}


def history(fleet: Fleet) -> list[dict]:
    done = cli(fleet, "history", "steady", "--json", "--limit", "2000")
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


def ran_after(fleet: Fleet, instant: datetime) -> list[dict]:
    return [e for e in fleet.starts() if parse_tick(e["tick"]) > instant]


def _pause_restart_resume(fleet: Fleet, receiver: Receiver | None, names: list[str]) -> None:
    for name in names:
        fleet.start(name)
    fleet.wait_ready()
    wait_for(lambda: len(fleet.ends()) >= 3, 60, "a few runs before the pause")

    done = cli(fleet, "pause", "steady", "--reason", "upstream maintenance", "--by", "ops@test")
    assert done.returncode == 0, done.stderr
    paused_at = datetime.now(UTC)
    wait_for(
        lambda: sum(r["status"] == "paused" for r in history(fleet)) >= 4,
        60,
        "ticks recorded paused",
    )
    status = cli(fleet, "status", "--json")
    (job,) = [j for j in json.loads(status.stdout)["jobs"] if j["name"] == "steady"]
    assert job["paused"]["by"] == "ops@test"
    assert job["paused"]["reason"] == "upstream maintenance"

    codes = fleet.stop()  # every replica restarts: the pause stays
    assert set(codes.values()) == {0}, fleet.logs()
    down_at = datetime.now(UTC)
    time.sleep(3)
    for name in names:
        fleet.start(name)
    fleet.wait_ready()
    up_at = datetime.now(UTC)
    wait_for(
        lambda: any(
            r["status"] == "paused" and parse_tick(r["scheduled_at"]) > up_at + timedelta(seconds=1)
            for r in history(fleet)
        ),
        60,
        "the restarted fleet to record ticks paused",
    )
    # Within one tick of the pause, no replica starts the job, before or after the restart.
    assert ran_after(fleet, paused_at + timedelta(seconds=1)) == [], fleet.logs()
    # The ticks of the gap, when no replica was up, are explained by the sweep: paused.
    gap = [down_at + timedelta(seconds=1), up_at - timedelta(seconds=1)]
    wait_for(
        lambda: any(
            r["status"] == "paused" and gap[0] <= parse_tick(r["scheduled_at"]) <= gap[1]
            for r in history(fleet)
        ),
        120,
        "the sweep to record the restart gap's ticks paused",
    )

    done = cli(fleet, "resume", "steady", "--by", "ops@test")
    assert done.returncode == 0, done.stderr
    assert "resumed by ops@test; it was paused by ops@test" in done.stdout
    resumed_at = datetime.now(UTC)
    wait_for(lambda: ran_after(fleet, resumed_at), 30, "a run after the resume")
    if receiver is not None:
        wait_for(
            lambda: receiver.bodies("job.paused") and receiver.bodies("job.resumed"),
            120,
            "the pause and resume notices",
        )
    codes = fleet.stop()
    assert set(codes.values()) == {0}, fleet.logs()

    rows = history(fleet)
    ticks = Counter(r["scheduled_at"] for r in rows)
    assert max(ticks.values()) == 1, f"a tick recorded twice: {ticks.most_common(3)}"
    paused = [parse_tick(r["scheduled_at"]) for r in rows if r["status"] == "paused"]
    assert paused and min(paused) >= paused_at - timedelta(seconds=2)
    assert max(paused) < resumed_at + timedelta(seconds=2)
    assert all(r["run_id"] is None for r in rows if r["status"] == "paused")
    window = (paused_at + timedelta(seconds=1), resumed_at)
    within = [r for r in rows if window[0] <= parse_tick(r["scheduled_at"]) <= window[1]]
    assert {r["status"] for r in within} == {"paused"}, within
    assert not [e for e in fleet.ends() if e.get("overlap")]
    if receiver is not None:
        paused_notices, resumed = receiver.bodies("job.paused"), receiver.bodies("job.resumed")
        assert len(paused_notices) == 1 and len(resumed) == 1, receiver.received
        assert paused_notices[0]["reason"] == "upstream maintenance"
        assert paused_notices[0]["by"] == "ops@test"
        assert resumed[0]["paused_by"] == "ops@test"
        assert "paused for the fleet by ops@test" in paused_notices[0]["text"]


def test_a_pause_holds_across_three_replicas_and_their_restart(tmp_path, database_url):
    receiver = Receiver()
    settings = {**SETTINGS, "alert_webhook_url": receiver.url("/hook")}
    fleet = Fleet(tmp_path, database_url, SCHEDULES, settings=settings, job_files=JOBS)
    try:
        _pause_restart_resume(fleet, receiver, ["r1", "r2", "r3"])
    finally:
        fleet.kill_all()
        receiver.close()


def test_embedded_mode_a_pause_holds_for_the_processes_of_a_host(tmp_path):
    fleet = Fleet(tmp_path, None, SCHEDULES, settings=SETTINGS, job_files=JOBS)
    try:
        _pause_restart_resume(fleet, None, ["r1", "r2"])
    finally:
        fleet.kill_all()
