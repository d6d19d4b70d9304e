"""What `status`, the page and the sweep say of runs that went wrong, on both backends:
a dead replica's run at once, a crashed run's known duration, a run past its timeout,
a retry nobody will ever take."""

from __future__ import annotations

import logging
from dataclasses import replace
from datetime import UTC, datetime, timedelta

import pytest

from scheduler.backends.base import ClaimRequest, Intent, Outcome
from scheduler.cli.tables import lasted
from scheduler.config.settings import JobConfig, Settings
from scheduler.fleet.housekeeping import ORPHANED_RETRY_GRACE, Housekeeping, named
from scheduler.fleet.status import fleet_status, running_words
from scheduler.ledger import tables
from scheduler.ledger.history import TickFilter, history
from scheduler.ledger.registrations import mark_seen, register
from scheduler.ledger.retention import prune_batch
from scheduler.ledger.times import iso
from scheduler.registry.catalog import Catalog
from tests.support import make_job

ORPHAN, HELD, SLOW = 681, 682, 683


def jobs() -> Catalog:
    slow = make_job(SLOW, lambda ctx: None, name="slow")
    slow = replace(slow, schedule=JobConfig(interval="1h", timeout="1s"))
    return Catalog(
        (
            make_job(ORPHAN, lambda ctx: None, name="orphan"),
            make_job(HELD, lambda ctx: None, name="held"),
            slow,
        )
    )


def running_row(key: int, name: str, instance: str, started: datetime, run_id: int) -> dict:
    return {
        "job_key": key,
        "job_name": name,
        "scheduled_at": started.replace(microsecond=0),
        "status": "running",
        "instance": instance,
        "run_id": run_id,
        "started_at": started,
    }


def claim(backend, key: int, name: str, tick: datetime):
    request = ClaimRequest(
        key=key, name=name, scheduled_at=tick, intent=Intent.RUN, grace_s=30, skip_threshold=3
    )
    (result,) = backend.claim([request], backend.instance, capacity=1).every()
    assert result.outcome is Outcome.RUN
    return result


def state_of(status: dict, name: str) -> dict:
    (job,) = [j for j in status["jobs"] if j["name"] == name]
    return job


def test_a_dead_replicas_run_is_shown_gone_at_once_and_swept_with_what_is_known(
    backends, caplog, monkeypatch
):
    # The dead replica never had a lock file here; a fresh one proves its run over only
    # once it has settled (embedded mode: filelocks.SETTLE_S), which is not this test's.
    monkeypatch.setattr("scheduler.backends.filelocks.SETTLE_S", 0.0)
    alive = backends("alive")
    now = datetime.now(UTC)
    started = now - timedelta(seconds=100)
    with alive.ledger_engine.begin() as conn:  # "dead" ran it, was seen 42 s in, then died
        conn.execute(tables.ticks.insert(), [running_row(ORPHAN, "orphan", "dead", started, 90)])
        mark_seen(conn, "dead", started + timedelta(seconds=42))
    claim(alive, HELD, "held", now.replace(microsecond=0))  # alive, holding its lock
    status = fleet_status(alive, jobs(), now)
    gone, held = state_of(status, "orphan")["running"], state_of(status, "held")["running"]
    assert gone["replica_gone"] and not held["replica_gone"]
    assert gone["last_seen"] == iso(started + timedelta(seconds=42))
    said = running_words(gone, str)
    assert said.endswith(f"replica gone, not yet marked, last seen {gone['last_seen']}")
    assert running_words(held, str) == f"on alive since {held['since']}"

    keeper = Housekeeping(alive, jobs(), Settings(instance_name="alive"))
    with (
        caplog.at_level(logging.WARNING, "scheduler.housekeeping"),
        alive.ledger_engine.begin() as conn,
    ):
        assert len(keeper.sweep_crashed(conn, now, {"alive"})) == 1
    tick = started.replace(microsecond=0).isoformat()
    assert f"marked 1 run(s) crashed, their replica gone: orphan tick {tick} on dead" in caplog.text
    with alive.ledger_engine.connect() as conn:
        (row,) = history(conn, TickFilter(key=ORPHAN, limit=1))
    assert row.status == "crashed" and row.duration_s == pytest.approx(42.0)
    assert lasted(row.status, row.duration_s) == "at least 42s"
    assert state_of(fleet_status(alive, jobs(), now), "orphan")["running"] is None


def test_a_run_past_its_timeout_is_shown_so_from_when_it_passed_it(backends):
    alive = backends("alive")
    now = datetime.now(UTC)
    claim(alive, SLOW, "slow", now.replace(microsecond=0))
    running = state_of(fleet_status(alive, jobs(), now), "slow")["running"]
    assert running["past_timeout_since"] is None and not running["replica_gone"]
    later = fleet_status(alive, jobs(), now + timedelta(seconds=30))
    running = state_of(later, "slow")["running"]
    since = datetime.fromisoformat(running["since"]) + timedelta(seconds=1)
    assert running["past_timeout_since"] == iso(since)
    assert running_words(running, str).endswith(f": past its timeout since {iso(since)}")


def test_a_log_line_names_a_few_and_counts_the_rest():
    assert named(["a", "b"]) == "a, b"
    assert named([str(n) for n in range(8)]) == "0, 1, 2, 3, 4 and 3 more"


def test_a_retry_of_a_job_no_live_replica_has_ends_after_a_grace_and_is_pruned(backends):
    alive = backends("alive")
    now = datetime.now(UTC).replace(microsecond=0)
    overdue = now - ORPHANED_RETRY_GRACE - timedelta(minutes=1)
    base = {"status": "failed", "instance": "gone", "error": "boom", "attempt": 1}
    rows = [  # (key, how overdue): gone for good, gone a moment ago, still run by "alive"
        {**base, "job_key": ORPHAN, "job_name": "orphan", "scheduled_at": now - timedelta(days=3)},
        {**base, "job_key": ORPHAN, "job_name": "orphan", "scheduled_at": now - timedelta(hours=1)},
        {**base, "job_key": HELD, "job_name": "held", "scheduled_at": now - timedelta(hours=2)},
    ]
    retry_at = [overdue, now - timedelta(minutes=1), overdue]
    with alive.ledger_engine.begin() as conn:
        conn.execute(
            tables.ticks.insert(),
            [{**r, "retry_at": at} for r, at in zip(rows, retry_at, strict=True)],
        )
        register(conn, "gone", [(ORPHAN, "orphan", "x"), (HELD, "held", "x")], set(), now)
        register(conn, "alive", [(HELD, "held", "x")], {"gone"}, now)
    keeper = Housekeeping(alive, jobs(), Settings(instance_name="alive"))
    with alive.ledger_engine.begin() as conn:
        assert keeper.end_orphaned_retries(conn, now, {"alive"}) == 1
    with alive.ledger_engine.begin() as conn:
        assert keeper.end_orphaned_retries(conn, now, {"alive"}) == 0  # done once
    with alive.ledger_engine.connect() as conn:
        found = {r.scheduled_at: r for r in history(conn, TickFilter(limit=10))}
    ended = found[rows[0]["scheduled_at"]]
    assert ended.status == "failed" and ended.retry_at is None
    assert ended.error == "boom; not retried: no live replica runs this job"
    assert found[rows[1]["scheduled_at"]].retry_at is not None  # within the grace
    assert found[rows[2]["scheduled_at"]].retry_at is not None  # a live replica has the job
    with alive.ledger_engine.begin() as conn:  # final now: retention takes it
        assert prune_batch(conn, now - timedelta(days=1)) == 1
