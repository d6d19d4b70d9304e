"""Embedded mode: what a replica cannot survive, it ends (exit 70) for its supervisor to
start again, rather than staying up idle: a job that closes the replica's descriptors,
and the ledger file removed under the fleet. Neither may let a tick or a job run twice."""

from __future__ import annotations

import time
from collections import Counter
from typing import Any

from scheduler.backends.embedded_keeper import EXIT_RESTART
from tests.support import Fleet, parse_tick, wait_for

JOBS = ["shared_host.py"]
NAMES = ["r1", "r2"]


def starts(fleet: Fleet, job: str) -> list[dict[str, Any]]:
    return [e for e in fleet.starts() if e["job"] == job]


def twice(fleet: Fleet, job: str) -> list[str]:
    counts = Counter(parse_tick(e["tick"]) for e in starts(fleet, job))
    return [tick.isoformat() for tick, n in counts.items() if n > 1]


def test_a_job_that_closes_its_replicas_descriptors_ends_that_replica_and_nothing_overlaps(
    tmp_path,
):
    schedules = {"closes_descriptors": {"interval": "2s"}, "quick": {"interval": "1s"}}
    fleet = Fleet(tmp_path, None, schedules, job_files=JOBS)
    for name in NAMES:
        fleet.start(name)
    try:
        fleet.wait_ready()
        closing = wait_for(
            lambda: [e for e in starts(fleet, "closes_descriptors") if e.get("closes")],
            60,
            "the run that closes descriptors",
        )[0]
        culprit = fleet.replicas[closing["instance"]]
        assert culprit.wait(30) == EXIT_RESTART, culprit.log()
        said = culprit.log()  # its restart writes a new log
        wait_for(
            lambda: len(starts(fleet, "closes_descriptors")) >= 2, 60, "the job to run elsewhere"
        )
        restarted = time.time()
        fleet.start(culprit.name)  # its supervisor starts it again
        fleet.wait_ready()
        wait_for(
            lambda: [e for e in fleet.starts(culprit.name) if e["at"] > restarted],
            60,
            "the restarted replica to run ticks again",
        )
        codes = fleet.stop()
    finally:
        fleet.kill_all()
    logs = fleet.logs()
    assert set(codes.values()) == {0}, logs
    assert "closed under it" in said and f"status {EXIT_RESTART}" in said, said
    assert not [e for e in starts(fleet, "closes_descriptors") if e["overlap"]], logs
    assert not twice(fleet, "quick") and not twice(fleet, "closes_descriptors"), logs


def test_a_ledger_removed_under_the_fleet_ends_every_replica_and_they_start_on_one_ledger(
    tmp_path,
):
    fleet = Fleet(tmp_path, None, {"quick": {"interval": "1s"}}, job_files=JOBS)
    for name in NAMES:
        fleet.start(name)
    try:
        fleet.wait_ready()
        wait_for(lambda: len(starts(fleet, "quick")) >= 3, 60, "quick runs")
        (tmp_path / "scheduler.db").unlink()
        for name in NAMES:
            assert fleet.replicas[name].wait(30) == EXIT_RESTART, fleet.logs()
        said = fleet.logs()  # their restarts write new logs
        before = len(starts(fleet, "quick"))
        for name in NAMES:  # their supervisors start them again
            fleet.start(name)
        fleet.wait_ready()
        wait_for(lambda: len(starts(fleet, "quick")) >= before + 5, 60, "runs on the new ledger")
        codes = fleet.stop()
    finally:
        fleet.kill_all()
    logs = fleet.logs()
    assert set(codes.values()) == {0}, logs
    assert said.count("the ledger was removed while this replica had it open") == 2, said
    assert list(tmp_path.glob("scheduler.db-wal.removed-*")), logs
    assert not twice(fleet, "quick"), logs
