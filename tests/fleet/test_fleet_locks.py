"""The lock invariant on real replicas: a row lock held from outside makes a claim fail.

A claim that takes a job's lock and then waits on a row another session holds
fails on its lock timeout; the lock it took must be given back at once (advisory
locks outlive the rollback). Otherwise the replica keeps the lock with nothing
running, and every later tick of the job is recorded `skipped` by the others.
Afterwards no replica holds a lock with no running row of its own behind it.
"""

from __future__ import annotations

import itertools
import time
from collections import Counter
from datetime import UTC, datetime, timedelta

import psycopg
import pytest

from tests.support import Fleet, parse_tick, wait_for

pytestmark = pytest.mark.fleet

NAMESPACE = 4646
SETTINGS = {"holder_timeout": 12, "lock_namespace": NAMESPACE}  # lock_timeout 2 s


def stray_locks(fleet: Fleet) -> list[tuple[str, int]]:
    """(replica, job key) of every job lock held with no running row of that replica."""
    with psycopg.connect(fleet.database_url, autocommit=True) as conn:
        held = conn.execute(
            "SELECT a.application_name, l.objid::integer FROM pg_locks l"
            " JOIN pg_stat_activity a ON a.pid = l.pid"
            " WHERE l.locktype = 'advisory' AND l.objsubid = 2 AND l.classid = %s::oid"
            " AND l.mode = 'ExclusiveLock' AND l.objid <> 0",
            (NAMESPACE,),
        ).fetchall()
        running = set(
            conn.execute(
                "SELECT instance, job_key FROM scheduler_ticks WHERE status = 'running'"
            ).fetchall()
        )
    return [(name, key) for name, key in held if (name, key) not in running]


def no_stray_lock_reported(fleet: Fleet) -> None:
    logs = fleet.logs()
    assert "stray lock" not in logs, logs


def test_a_retry_claim_that_meets_a_held_row_gives_its_lock_back(tmp_path, database_url):
    fleet = Fleet(
        tmp_path,
        database_url,
        {"retried": {"interval": "10s", "retries": 1, "retry_delay": "3s"}},
        SETTINGS,
        job_files=["locks.py"],
    )
    try:
        for name in ("r1", "r2"):
            fleet.start(name)
        fleet.wait_ready()

        def pending() -> dict | None:
            return next((r for r in fleet.ledger("retried") if r["retry_at"] is not None), None)

        row = wait_for(pending, 60, "a failed first attempt with its retry pending")
        with psycopg.connect(database_url) as outsider:  # one uncommitted transaction
            outsider.execute(
                "INSERT INTO scheduler_attempts (job_key, scheduled_at, attempt, status)"
                " VALUES (171, %s, 1, 'failed')",
                (row["scheduled_at"],),
            )
            time.sleep(5)  # the retry falls due meanwhile: its claim waits, then fails
            outsider.rollback()
        held_tick = row["scheduled_at"]
        # Three more ticks after the held row was let go: each ran, none was skipped.
        later = lambda: [  # noqa: E731
            r for r in fleet.ledger("retried")
            if r["scheduled_at"] > held_tick and r["status"] == "succeeded"
        ]  # fmt: skip
        wait_for(lambda: len(later()) >= 3, 90, "three later ticks to end succeeded")
        rows = fleet.ledger("retried")
        assert not [r for r in rows if r["status"] == "skipped"], rows
        held = next(r for r in rows if r["scheduled_at"] == held_tick)
        assert held["status"] == "succeeded" and held["attempt"] == 2, held
        attempts = Counter(
            (e["tick"], e["attempt"]) for e in fleet.evidence() if e.get("event") == "attempt"
        )
        assert set(attempts.values()) == {1}, attempts
        wait_for(lambda: stray_locks(fleet) == [], 10, "no lock without a running row")
        no_stray_lock_reported(fleet)
        assert "gave back lock(s) of retried" in fleet.logs()
    finally:
        fleet.kill_all()


def explained(skip: dict, rows: list[dict], held_until: datetime) -> bool:
    """A skip falls while a claim of its holder waited on the outsider's rows (it holds the
    job's lock while it waits: up to the lock timeout after the outsider let go), or names a
    replica whose run of the job was in flight at the skipped tick."""
    if skip["scheduled_at"] <= held_until:
        return True
    return any(
        r["instance"] == skip["holder"]
        and r["started_at"] is not None
        and r["started_at"] <= skip["scheduled_at"] + timedelta(seconds=5)  # decided late
        and (r["finished_at"] is None or r["finished_at"] >= skip["scheduled_at"])
        for r in rows
        if r is not skip
    )


def test_a_catch_up_claim_that_meets_held_rows_gives_its_lock_back(tmp_path, database_url):
    fleet = Fleet(
        tmp_path,
        database_url,
        {
            "caught": {
                "interval": "2s",
                "catch_up": "all",
                "catch_up_window": "1m",
                "catch_up_limit": 3,
                "misfire_grace": "1s",
            }
        },
        SETTINGS,
        job_files=["locks.py"],
    )
    try:
        fleet.start("r1")
        fleet.wait_ready()
        wait_for(lambda: len(fleet.ends()) >= 2, 60, "a few runs before the fleet stops")
        assert fleet.stop() == {"r1": 0}, fleet.logs()
        last_before = max(parse_tick(e["tick"]) for e in fleet.starts())
        time.sleep(9)  # four ticks or more with no replica up
        gap_end = last_before + timedelta(seconds=12)
        # The newest gap ticks' rows, uncommitted: the fleet comes up 9 to 13 s after the
        # last run, so the pass runs the newest three due by then, and one or more of them
        # are held; the older ones it records missed are not (that would hold the pass).
        held = [last_before + timedelta(seconds=2 * n) for n in range(4, 7)]
        with psycopg.connect(database_url) as outsider:
            for tick in held:
                outsider.execute(
                    "INSERT INTO scheduler_ticks (job_key, scheduled_at, job_name, status)"
                    " VALUES (172, %s, 'caught', 'missed')",
                    (tick,),
                )
            for name in ("r1", "r2"):
                fleet.start(name)
            fleet.wait_ready()
            wait_for(
                lambda: (
                    "(catch_up) failed (canceling statement due to lock timeout)" in fleet.logs()
                ),
                30,
                "a catch-up claim to wait on a held row, then fail",
            )
            time.sleep(3)  # the passes try again: each waits, then fails
            outsider.rollback()
        # A claim waiting on those rows holds the job's lock until its lock timeout (2 s).
        held_until = datetime.now(UTC) + timedelta(seconds=5)

        def caught_up() -> list[dict]:
            """Of the gap. (A tick that fell between the first start's registration and its
            lock session coming up, on a slow start, is caught up too, rightly.)"""
            rows = fleet.ledger("caught")
            return [r for r in rows if r["caught_up"] and r["scheduled_at"] > last_before]

        wait_for(
            lambda: sum(r["status"] == "succeeded" for r in caught_up()) >= 3,
            60,
            "three caught-up ticks",
        )
        ups = sorted(r["scheduled_at"] for r in caught_up())
        assert len(ups) == 3 and ups[-1] <= gap_end, ups
        assert [b - a for a, b in itertools.pairwise(ups)] == [timedelta(seconds=2)] * 2
        wait_for(
            lambda: (
                fleet.ledger("caught")[-1]["scheduled_at"]
                > max(ups[-1], held_until) + timedelta(seconds=6)
            ),
            30,
            "three ticks after the claims' wait",
        )
        rows = fleet.ledger("caught")
        # A tick may be skipped while a claim waits on the outsider's rows or a caught-up
        # run of the job goes on (by design); never for a lock kept with nothing in flight.
        unexplained = [
            r for r in rows if r["status"] == "skipped" and not explained(r, rows, held_until)
        ]
        assert not unexplained, rows
        starts = Counter(e["tick"] for e in fleet.starts())
        assert set(starts.values()) == {1}, starts
        assert not any(e.get("overlap") for e in fleet.starts())
        wait_for(lambda: stray_locks(fleet) == [], 10, "no lock without a running row")
        no_stray_lock_reported(fleet)
        assert "gave back lock(s) of caught left by a failed catch-up" in fleet.logs()
    finally:
        fleet.kill_all()


def test_a_job_whose_replica_dies_in_every_run_alerts(tmp_path, database_url):
    """Each run is recorded crashed; crashed runs count as failures, so the streak alerts."""
    from tests.support import Receiver

    receiver = Receiver()
    fleet = Fleet(
        tmp_path,
        database_url,
        {"doomed": {"interval": "3s", "fail_alert_after": 2}},
        {**SETTINGS, "alert_webhook_url": receiver.url()},
        job_files=["locks.py"],
    )
    try:
        for name in ("k1", "k2"):
            fleet.start(name)  # no wait_ready: a replica may die in its first run already

        def alerted() -> list[dict]:
            for replica in list(fleet.replicas.values()):  # a supervisor restarts the dead
                if replica.process.poll() is not None:
                    fleet.start(replica.name)
            return [b for b in receiver.bodies("job.failures_exceeded") if b["job"] == "doomed"]

        (alert,) = wait_for(alerted, 120, "a failure alert for the crashing job", every=0.5)
        assert alert["threshold"] == 2 and alert["consecutive_failures"] >= 2
        assert "crash" in alert["text"], alert
        crashed = [r for r in fleet.ledger("doomed") if r["status"] == "crashed"]
        assert len(crashed) >= 2
    finally:
        fleet.kill_all()
        receiver.close()
