"""Shutdown, slow statements and notices, against real replicas and a real PostgreSQL.

- A run still going when `shutdown_grace` ends is told (`ctx.lock_lost`) before
  its lock can pass to another replica (docs/faults.md: SIGTERM or SIGINT).
- A statement that waits on a row lock is not a lost session: no lock is
  dropped, no run is told, and the ticks it delayed are recorded afterwards.
- A notice survives the death of the replica that raised it (docs/operating.md: Alerts and notices).
"""

from __future__ import annotations

import signal
import threading
import time
from datetime import UTC, datetime

import psycopg
import pytest

from tests.support import Fleet, Receiver, parse_tick, wait_for, whole_seconds

pytestmark = pytest.mark.fleet

# stubborn: ignores `stopping`, records a beat every 20 ms until told its lock is lost;
# slow: 24 s; overrun: 30 s.
JOBS = ["hardening.py"]


def test_a_run_abandoned_at_shutdown_is_told_before_its_lock_passes_on(tmp_path, database_url):
    slow = Receiver(delay=10)  # the ping thread is busy while the replica stops
    fleet = Fleet(
        tmp_path,
        database_url,
        {"stubborn": {"interval": "1s", "ping_url": slow.url("/ping")}},
        settings={"shutdown_grace": 1},
        job_files=JOBS,
    )
    fleet.start("r1")
    fleet.start("r2")
    try:
        fleet.wait_ready()
        first = wait_for(lambda: fleet.starts(), 30, "the first run")[0]
        holder = fleet.replicas[first["instance"]]
        other = next(r for r in fleet.replicas.values() if r is not holder)
        time.sleep(1.5)  # a few ticks are skipped: the lock is held
        holder.signal(signal.SIGTERM)
        assert holder.wait(30) == 0, holder.log()
        taken = wait_for(lambda: fleet.starts(other.name), 30, "the other replica to take over")
    finally:
        fleet.kill_all()
        slow.close()
    taken_at = taken[0]["at"]
    beats = [
        e for e in fleet.evidence() if e.get("event") == "beat" and e["run_id"] == first["run_id"]
    ]
    late = [e["at"] for e in beats if e["at"] >= taken_at]
    assert beats, fleet.logs()
    assert not late, (
        f"the abandoned run went on believing it held the lock {max(late) - taken_at:.3f} s "
        f"after {other.name} started the job\n{fleet.logs()}"
    )
    rows = {r["run_id"]: r for r in fleet.ledger("stubborn") if r["run_id"]}
    assert rows[first["run_id"]]["status"] == "crashed"


def test_a_statement_waiting_on_a_row_lock_is_not_a_lost_session(tmp_path, database_url):
    fleet = Fleet(
        tmp_path,
        database_url,
        {"slow": {"interval": "1s"}},
        # Lock-session statements are cut short after a fraction of this.
        settings={"holder_timeout": 6, "skip_alert_after": 1000},
        job_files=JOBS,
    )
    fleet.start("r1")
    fleet.start("r2")
    try:
        fleet.wait_ready()
        start = wait_for(lambda: fleet.starts(), 30, "the slow run")[0]
        wait_for(
            lambda: any(r["status"] == "skipped" for r in fleet.ledger("slow")),
            30,
            "a first skip",
        )
        with psycopg.connect(database_url) as blocker:
            # Every skip of the job updates its row in scheduler_jobs: hold that row
            # for longer than any lock-session statement may take.
            blocker.execute("SELECT 1 FROM scheduler_jobs WHERE job_key = 62 FOR UPDATE")
            held_from = time.time()
            time.sleep(8)
            held_until = time.time()
            blocker.rollback()

        def all_recorded() -> list[dict] | None:  # the delayed ticks are recorded now
            rows = fleet.ledger("slow")
            seen = {r["scheduled_at"] for r in rows}
            due = whole_seconds(parse_tick(start["tick"]), seconds_to_utc(held_until + 3))
            return rows if all(t in seen for t in due) else None

        time.sleep(6)
        rows = wait_for(all_recorded, 30, "every tick until 3 s after the release to be recorded")
        with psycopg.connect(database_url) as conn:
            (streak,) = conn.execute(
                "SELECT consecutive_skips FROM scheduler_jobs WHERE job_key = 62"
            ).fetchone()
        ends = wait_for(lambda: fleet.ends(), 40, "the slow run to end")
    finally:
        fleet.kill_all()
    logs = fleet.logs()
    assert "lock session lost" not in logs, logs
    assert not ends[0]["lock_lost"], logs
    assert not [r for r in rows if r["status"] in ("crashed", "missed")], rows
    assert len(fleet.starts()) == 1, logs
    # Every tick from the run's start until a few seconds ago has its row: the ticks
    # delayed by the row lock were recorded `skipped` once it was released.
    recorded = {r["scheduled_at"] for r in rows}
    window = whole_seconds(parse_tick(start["tick"]), seconds_to_utc(held_until + 3))
    assert not [t for t in window if t not in recorded], (window, sorted(recorded))
    skipped = [r for r in rows if r["status"] == "skipped"]
    assert streak >= len(skipped) - 2, (streak, len(skipped))  # the streak caught up
    assert held_until - held_from >= 8


def seconds_to_utc(epoch: float) -> datetime:
    return datetime.fromtimestamp(int(epoch), UTC)


def test_an_alert_is_delivered_even_when_its_replica_dies_while_sending_it(tmp_path, database_url):
    receiver = Receiver()
    receiver.hold_first = threading.Event()  # the first POST hangs until released
    fleet = Fleet(
        tmp_path,
        database_url,
        {"overrun": {"interval": "1s"}},
        settings={"skip_alert_after": 2, "alert_webhook_url": receiver.url("/hook")},
        job_files=JOBS,
    )
    for name in ("r1", "r2", "r3"):
        fleet.start(name)
    try:
        fleet.wait_ready()
        wait_for(lambda: receiver.received, 60, "the alert to be POSTed")
        first = receiver.received[0]["body"]
        assert first["event"] == "job.skips_exceeded"
        sender = fleet.replicas[first["raised_by"]]
        sender.signal(signal.SIGKILL)  # dies before it learns the delivery succeeded
        sender.wait(10)
        receiver.hold_first.set()
        again = wait_for(
            lambda: [
                r["body"]
                for r in receiver.received[1:]
                if r["body"].get("event") == "job.skips_exceeded"
                and (r["body"]["raised_by"], r["body"]["scheduled_at"])
                == (first["raised_by"], first["scheduled_at"])
            ],
            120,
            "another replica to deliver the notice",
        )
    finally:
        receiver.hold_first.set()
        fleet.kill_all()
        receiver.close()
    assert again[0]["notice_id"] == first["notice_id"]  # the same notice, for idempotence
