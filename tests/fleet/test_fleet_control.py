"""Changing a running fleet: pause and resume, reload (docs/changing.md).

Real replicas: a pause stops the job on every replica within a tick, survives
a restart of every replica, and each tick it covers is recorded `paused` once;
resuming lets the next tick run; the webhook hears of each change once.
"""

from __future__ import annotations

import contextlib
import json
import signal
import sqlite3
import time
from collections import Counter
from datetime import UTC, datetime, timedelta

import psycopg
import pytest

from tests.support import (
    Fleet,
    Proxy,
    Receiver,
    Replica,
    cli,
    host_port,
    parse_tick,
    wait_for,
    whole_seconds,
)

pytestmark = pytest.mark.fleet

JOBS = ["control.py"]
SCHEDULES = {"steady": {"interval": "1s"}}
# A short grace: the sweep explains the ticks of the restart gap soon after.
SETTINGS = {"misfire_grace": 5}


def swept_until(fleet: Fleet) -> datetime:
    """How far the sweep has judged ticks (its missed-tick watermark), on either backend."""
    query = "SELECT last_run_at FROM scheduler_maintenance WHERE task = 'missed'"
    if fleet.database_url is None:
        with contextlib.closing(sqlite3.connect(fleet.root / "scheduler.db")) as conn:
            (text,) = conn.execute(query).fetchone()
        at = datetime.fromisoformat(str(text))
        return at if at.tzinfo else at.replace(tzinfo=UTC)
    with psycopg.connect(fleet.database_url) as pg:
        (found,) = pg.execute(query).fetchone()  # type: ignore[misc]
    return found.astimezone(UTC)


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

    pausing_at = datetime.now(UTC)
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
    # The ticks of the gap, when no replica was up, are explained by the sweep: paused. Wait
    # for the sweep to have judged the whole gap (its missed-tick watermark past it): a gap
    # tick that no schedule in force had (between one replica's registration and the
    # next) gets no row at all, so waiting for a row can wait forever.
    gap = [down_at + timedelta(seconds=1), up_at - timedelta(seconds=1)]
    wait_for(lambda: swept_until(fleet) >= gap[1], 120, "the sweep to judge the restart gap")

    resuming_at = datetime.now(UTC)  # every tick before this one is paused
    done = cli(fleet, "resume", "steady", "--by", "ops@test")
    assert done.returncode == 0, done.stderr
    assert "resumed by ops@test; it was paused by ops@test" in done.stdout
    resumed_at = datetime.now(UTC)  # the command has returned: every tick from now runs
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
    # A tick is claimed at most misfire_grace (5 s) after it: one paused was claimed after
    # the pause began.
    assert paused and min(paused) >= pausing_at - timedelta(seconds=5)
    assert max(paused) < resumed_at + timedelta(seconds=2)
    assert all(r["run_id"] is None for r in rows if r["status"] == "paused")
    window = (paused_at + timedelta(seconds=1), resuming_at)
    within = [r for r in rows if window[0] <= parse_tick(r["scheduled_at"]) <= window[1]]
    # A tick of the gap that a sweep reaches only after the resume is `missed` (the job is
    # no longer paused then: docs/guarantees.md); every other one is `paused`, none ran.
    in_gap = [r for r in within if gap[0] <= parse_tick(r["scheduled_at"]) <= gap[1]]
    assert {r["status"] for r in within if r not in in_gap} == {"paused"}, within
    assert {r["status"] for r in in_gap} <= {"paused", "missed"}, in_gap
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


def _edit(fleet: Fleet, old: str, new: str) -> None:
    path = fleet.root / "config.yaml"
    text = path.read_text()
    assert old in text, text
    path.write_text(text.replace(old, new))


def _ticks(fleet: Fleet) -> list[datetime]:
    return [parse_tick(e["tick"]) for e in fleet.starts()]


def _runs_every_second_once_reloaded(fleet: Fleet, replica: Replica, timeout: float) -> None:
    """The watched edit from 2 s to 1 s is applied, and the new grid's odd seconds run."""
    said = "config.yaml changed: config.yaml reloaded"
    wait_for(lambda: said in replica.log(), timeout, "the reload")
    since = datetime.now(UTC)
    wait_for(
        lambda: sum(t > since and t.second % 2 for t in _ticks(fleet)) >= 2,
        60,
        "runs on the odd seconds of the new grid",
    )


def test_sighup_reloads_a_schedule_without_a_restart_exactly_once_across_the_fleet(
    tmp_path, database_url
):
    fleet = Fleet(tmp_path, database_url, {"steady": {"interval": "2s"}}, job_files=JOBS)
    names = ["r1", "r2"]
    for name in names:
        fleet.start(name)
    try:
        fleet.wait_ready()
        wait_for(lambda: len(fleet.ends()) >= 3, 60, "runs on the 2 s grid")
        assert {t.second % 2 for t in _ticks(fleet)} == {0}

        _edit(fleet, "interval: 2s", "interval: 1s")
        for name in names:
            fleet.replicas[name].signal(signal.SIGHUP)
        wait_for(
            lambda: all("config.yaml reloaded" in fleet.replicas[n].log() for n in names),
            30,
            "both replicas to reload",
        )
        reloaded_at = datetime.now(UTC)
        wait_for(
            lambda: sum(t > reloaded_at and t.second % 2 for t in _ticks(fleet)) >= 3,
            60,
            "runs on the odd seconds of the new 1 s grid",
        )

        _edit(fleet, "interval: 1s", "interval: every now and then")
        fleet.replicas["r1"].signal(signal.SIGHUP)
        wait_for(lambda: "config.yaml not reloaded" in fleet.replicas["r1"].log(), 30, "the error")
        refused_at = datetime.now(UTC)
        wait_for(
            lambda: sum(t > refused_at for t in _ticks(fleet)) >= 4,
            60,
            "the 1 s grid to go on after the invalid edit",
        )
        assert all(r.process.poll() is None for r in fleet.replicas.values()), fleet.logs()
        end = datetime.now(UTC)
        codes = fleet.stop()
    finally:
        fleet.kill_all()
    assert set(codes.values()) == {0}, fleet.logs()
    error = next(
        line
        for line in fleet.replicas["r1"].log().splitlines()
        if "config.yaml not reloaded" in line
    )
    assert "jobs.steady.interval" in error and "keeps its configuration" in error
    ticks = _ticks(fleet)
    assert len(ticks) == len(set(ticks)), "a tick ran twice"
    assert not [e for e in fleet.ends() if e.get("overlap")]
    # Inside the window, every second of the new grid ran, once.
    window = whole_seconds(reloaded_at + timedelta(seconds=2), end - timedelta(seconds=2))
    ran = {r["scheduled_at"] for r in fleet.ledger("steady") if r["status"] == "succeeded"}
    assert [t for t in window if t not in ran] == [], fleet.logs()


def test_reload_watch_applies_an_edit_without_a_signal(tmp_path):
    settings = {"reload": "watch"}
    fleet = Fleet(tmp_path, None, {"steady": {"interval": "2s"}}, settings=settings, job_files=JOBS)
    fleet.start("r1")
    try:
        fleet.wait_ready()
        wait_for(lambda: len(fleet.ends()) >= 2, 60, "runs on the 2 s grid")
        _edit(fleet, "interval: 2s", "interval: 1s")
        _runs_every_second_once_reloaded(fleet, fleet.replicas["r1"], 30)
        codes = fleet.stop()
    finally:
        fleet.kill_all()
    assert codes == {"r1": 0}, fleet.logs()


def test_a_watched_edit_seen_while_the_database_is_down_applies_once_it_is_back(
    tmp_path, database_url
):
    proxy = Proxy(*host_port(database_url))
    settings = {"reload": "watch", "holder_timeout": 6}
    fleet = Fleet(
        tmp_path, database_url, {"steady": {"interval": "2s"}}, settings=settings, job_files=JOBS
    )
    replica = fleet.start("r1", env={"SCHEDULER_DATABASE_URL": proxy.url(database_url)})
    try:
        fleet.wait_ready()
        wait_for(lambda: len(fleet.ends()) >= 2, 60, "runs on the 2 s grid")
        proxy.down()
        _edit(fleet, "interval: 2s", "interval: 1s")
        wait_for(lambda: "config.yaml not reloaded" in replica.log(), 60, "the failed reload")
        time.sleep(5)  # the database stays away a while: the replica keeps trying, quietly
        proxy.restore()
        _runs_every_second_once_reloaded(fleet, replica, 90)
        codes = fleet.stop()
    finally:
        fleet.kill_all()
        proxy.close()
    assert codes == {"r1": 0}, fleet.logs()
    failed = [line for line in replica.log().splitlines() if "config.yaml not reloaded" in line]
    assert 1 <= len(failed) <= 4, failed  # once per distinct failure, not every second


def test_replicas_that_run_different_schedules_are_shown_told_and_run_each_tick_once(
    tmp_path, database_url
):
    """A rolling deploy: r1 still runs every 2 s, r2 already every 1 s."""
    receiver = Receiver()
    settings = {"schedule_drift_grace": 3, "alert_webhook_url": receiver.url("/hook")}
    old = Fleet(
        tmp_path / "old",
        database_url,
        {"steady": {"interval": "2s"}},
        settings=settings,
        job_files=JOBS,
    )
    new = Fleet(
        tmp_path / "new",
        database_url,
        {"steady": {"interval": "1s"}},
        settings=settings,
        job_files=JOBS,
    )
    old.start("r1")
    new.start("r2")
    try:
        old.wait_ready()
        new.wait_ready()
        start = datetime.now(UTC)

        def shown() -> list[dict]:
            jobs = json.loads(cli(old, "status", "--json").stdout)["jobs"]
            (job,) = [j for j in jobs if j["name"] == "steady"]
            return job["schedules"] if not job["schedules_agree"] else []

        wait_for(lambda: len(shown()) == 2, 30, "status to show both schedules")
        assert shown() == [
            {"schedule": "every 2s", "instances": ["r1"]},
            {"schedule": "every 1s", "instances": ["r2"]},
        ]
        check = cli(old, "check")
        (line,) = [s for s in check.stdout.splitlines() if s.startswith("schedules ")]
        assert line.split()[1] == "warn" and "every 2s on r1; every 1s on r2" in line
        wait_for(lambda: receiver.bodies("job.schedule_drift"), 120, "the drift notice")

        _edit(old, "interval: 2s", "interval: 1s")
        old.replicas["r1"].signal(signal.SIGHUP)
        wait_for(lambda: "config.yaml reloaded" in old.replicas["r1"].log(), 30, "the reload")
        wait_for(lambda: receiver.bodies("job.schedule_agreed"), 120, "the agreement notice")
        end = datetime.now(UTC)
        codes = {**old.stop(), **new.stop()}
    finally:
        old.kill_all()
        new.kill_all()
        receiver.close()
    assert codes == {"r1": 0, "r2": 0}, old.logs() + new.logs()
    (drift,) = receiver.bodies("job.schedule_drift")
    (agreed,) = receiver.bodies("job.schedule_agreed")
    assert [v["instances"] for v in drift["schedules"]] == [["r1"], ["r2"]]
    assert agreed["schedules"] == [{"schedule": "every 1s", "instances": ["r1", "r2"]}]
    ticks = _ticks(old) + _ticks(new)
    assert len(ticks) == len(set(ticks)), "a tick ran twice"
    # Every second is a tick of r2's schedule (and every other one of r1's): each ran once.
    rows = {r["scheduled_at"]: r["status"] for r in old.ledger("steady")}
    window = whole_seconds(start + timedelta(seconds=2), end - timedelta(seconds=2))
    assert [t for t in window if rows.get(t) != "succeeded"] == [], rows


def test_trigger_runs_on_a_live_replica_here_with_here_and_not_at_all_with_none_up(
    tmp_path, database_url
):
    fleet = Fleet(tmp_path, database_url, {"steady": {"interval": "1d"}}, job_files=JOBS)
    for name in ("r1", "r2"):
        fleet.start(name)
    try:
        fleet.wait_ready()
        on_fleet = cli(fleet, "trigger", "steady")
        here = cli(fleet, "trigger", "steady", "--here")
        codes = fleet.stop()
        none_up = cli(fleet, "trigger", "steady")
    finally:
        fleet.kill_all()
    assert codes == {"r1": 0, "r2": 0}, fleet.logs()
    assert on_fleet.returncode == 0, on_fleet.stdout + on_fleet.stderr
    ran_on = on_fleet.stdout.strip().rsplit(" on ", 1)[-1]
    assert on_fleet.stdout.startswith("steady: run ") and ran_on in ("r1", "r2")
    assert here.returncode == 0, here.stdout + here.stderr
    starts = {e["run_id"]: e for e in fleet.starts()}
    rows = {r["run_id"]: r for r in fleet.ledger("steady")}
    assert len(starts) == len(rows) == 2 and all(r["manual"] for r in rows.values())
    fleet_run = int(on_fleet.stdout.split()[2])
    # The run happened in that replica's process, and the ledger names it.
    assert rows[fleet_run]["instance"] == ran_on == starts[fleet_run]["instance"]
    assert starts[fleet_run]["pid"] == fleet.replicas[ran_on].pid
    (local,) = [e for e in starts.values() if e["run_id"] != fleet_run]
    assert local["instance"] == "cli"  # --here: in the command's own process
    assert none_up.returncode == 3 and "no live replica" in none_up.stdout


def test_a_run_past_its_timeout_is_told_recorded_failed_and_alerted_once(tmp_path, database_url):
    receiver = Receiver()
    schedules = {"overstays": {"interval": "1d", "timeout": "1s"}}
    settings = {"alert_webhook_url": receiver.url("/hook")}
    fleet = Fleet(tmp_path, database_url, schedules, settings=settings, job_files=JOBS)
    fleet.start("r1")
    try:
        fleet.wait_ready()
        ran = cli(fleet, "trigger", "overstays")  # on the replica, through run-now
        wait_for(lambda: receiver.bodies("job.timed_out"), 60, "the job.timed_out notice")
        codes = fleet.stop()
    finally:
        fleet.kill_all()
        receiver.close()
    assert codes == {"r1": 0}, fleet.logs()
    assert ran.returncode == 1, ran.stdout + ran.stderr
    assert ran.stdout.strip().endswith("failed on r1: timed out after 1s"), ran.stdout
    (notice,) = receiver.bodies("job.timed_out")
    assert (notice["instance"], notice["timeout"]) == ("r1", "1s")
    (row,) = fleet.ledger("overstays")
    assert (row["status"], row["error"], row["run_id"]) == (
        "failed",
        "timed out after 1s",
        notice["run_id"],
    )
    assert "run timed out: overstays" in fleet.replicas["r1"].log()
