"""Retries and caught-up ticks, step by step, on both backends (two backends stand for
two replicas, as in test_gate_protocol)."""

from __future__ import annotations

import re
import time
from datetime import UTC, datetime, timedelta

from sqlalchemy import select

from scheduler.backends.base import FinishRequest, Intent, Outcome
from scheduler.ledger import tables
from scheduler.ledger.history import TickFilter, history
from scheduler.ledger.missed import existing_ticks
from scheduler.ledger.retention import prune_batch
from scheduler.statuses import CRASHED_LOST_LOCK
from tests.integration.test_gate_protocol import KEY, LATER, claim, die, finish, tick


def fail_attempt(backend, result, retry_in: float | None, error: str = "boom"):
    request = FinishRequest(
        key=result.key,
        scheduled_at=result.scheduled_at,
        run_id=result.run_id,
        status="failed",
        error=error,
        unlock=True,
        fail_threshold=2,
        next_due=LATER,
        retry_in_s=retry_in,
    )
    (outcome,) = backend.finish([request])
    return outcome


def retries(backend, keys=(KEY,), capacity=10):
    return backend.claim_retries(backend.instance, list(keys), capacity, CRASHED_LOST_LOCK)


def row(backend, at: datetime) -> dict:
    t = tables.ticks
    with backend.ledger_engine.connect() as conn:
        found = conn.execute(select(t).where(t.c.job_key == KEY, t.c.scheduled_at == at)).one()
    return dict(found._mapping)


def streak(backend) -> int:
    j = tables.jobs
    with backend.ledger_engine.connect() as conn:
        found = conn.execute(select(j.c.consecutive_failures).where(j.c.job_key == KEY)).scalar()
    return found or 0


def test_a_failed_attempt_is_retried_once_for_the_fleet_and_its_attempts_are_kept(backends):
    a, b = backends("a"), backends("b")
    at = tick()
    first = claim(a, at)
    assert first.outcome is Outcome.RUN and first.attempt == 1
    assert fail_attempt(a, first, retry_in=0.0).recorded
    assert row(a, at)["status"] == "failed" and row(a, at)["retry_at"] is not None
    assert streak(a) == 0  # not the tick's end: no failure yet

    # Both replicas look at once: exactly one takes attempt 2.
    found_b, found_a = retries(b), retries(a)
    taken = found_a.started + found_b.started
    assert len(taken) == 1 and taken[0].attempt == 2 and taken[0].run_id > first.run_id
    second = taken[0]
    winner = b if found_b.started else a
    assert row(a, at)["status"] == "running" and row(a, at)["instance"] == winner.instance

    # It succeeds: the tick's final status is its last attempt's; the first is kept.
    finish(winner, second, "succeeded")
    with a.ledger_engine.connect() as conn:
        (shown,) = history(conn, TickFilter(key=KEY))
    assert shown.status == "succeeded" and shown.attempt == 2
    assert [x["attempt"] for x in shown.attempts] == [1]
    assert shown.attempts[0]["status"] == "failed" and shown.attempts[0]["error"] == "boom"
    assert shown.attempts[0]["run_id"] == first.run_id
    assert streak(a) == 0


def test_the_failure_streak_counts_ticks_whose_last_attempt_failed(backends):
    a = backends("a")
    at = tick()
    first = claim(a, at)
    fail_attempt(a, first, retry_in=0.0)
    (second,) = retries(a).started
    outcome = fail_attempt(a, second, retry_in=None)
    assert outcome.recorded and outcome.consecutive_failures == 1
    assert row(a, at)["status"] == "failed" and row(a, at)["attempt"] == 2
    assert streak(a) == 1


def test_a_retry_waits_while_the_jobs_lock_is_held_and_is_no_skip(backends):
    a, b = backends("a"), backends("b")
    old = tick(10)
    first = claim(a, old, grace=60)
    fail_attempt(a, first, retry_in=0.0)
    holder = claim(b, tick())  # the next tick runs on b and holds the lock
    assert holder.outcome is Outcome.RUN
    found = retries(a)
    assert found.started == [] and found.next_in is not None and found.next_in <= 0
    assert row(a, old)["status"] == "failed" and row(a, old)["retry_at"] is not None
    finish(b, holder)
    (taken,) = retries(a).started
    assert taken.scheduled_at == old and taken.attempt == 2


def test_a_retry_not_yet_due_is_left_and_its_time_is_told(backends):
    a = backends("a")
    first = claim(a, tick())
    fail_attempt(a, first, retry_in=60.0)
    found = retries(a)
    assert found.started == [] and 50 < (found.next_in or 0) <= 60
    due = a.retry_due_in() if a.name == "embedded" else (a.heartbeat(), a.retry_due_in())[1]
    assert due is not None and 50 < due <= 60


def test_a_retry_pending_when_its_replica_dies_is_taken_by_another(backends):
    a, b = backends("a"), backends("b")
    first = claim(a, tick())
    fail_attempt(a, first, retry_in=0.0)
    die(a)
    (taken,) = retries(b).started
    assert taken.attempt == 2 and taken.key == KEY


def test_a_retry_that_takes_the_lock_marks_a_dead_replicas_run_crashed(backends):
    a, b = backends("a"), backends("b")
    old, new = tick(10), tick()
    fail_attempt(a, claim(a, old, grace=60), retry_in=0.0)
    assert claim(b, new).outcome is Outcome.RUN
    die(b)  # its run's row stays `running`; its lock is gone
    (taken,) = retries(a).started
    assert taken.scheduled_at == old and taken.crashed == 1
    assert row(a, new)["status"] == "crashed"


def test_only_jobs_asked_for_and_one_attempt_per_job_per_look(backends):
    a = backends("a")
    one, two = claim(a, tick(20), grace=60), None
    fail_attempt(a, one, retry_in=0.0)
    two = claim(a, tick(10), grace=60)
    fail_attempt(a, two, retry_in=0.0)
    assert retries(a, keys=(KEY + 1,)).started == []
    found = retries(a)
    assert len(found.started) == 1 and found.started[0].scheduled_at == one.scheduled_at


def test_a_paused_jobs_retry_waits_for_the_resume(backends):
    a = backends("a")
    from scheduler.fleet import pauses

    first = claim(a, tick())
    fail_attempt(a, first, retry_in=0.0)
    with a.ledger_engine.begin() as conn:
        pauses.pause(conn, KEY, "job", by="ops", reason=None, now=datetime.now(UTC))
    assert retries(a).started == []
    with a.ledger_engine.begin() as conn:
        pauses.resume(conn, KEY, "job", by="ops", now=datetime.now(UTC))
    assert len(retries(a).started) == 1


def test_caught_up_ticks_take_the_lock_first_and_wait_instead_of_skipping(backends):
    a, b = backends("a"), backends("b")
    older, newer = tick(30), tick(28)
    ran = claim(a, older, Intent.CATCH_UP, grace=120)
    assert ran.outcome is Outcome.RUN
    assert row(a, older)["caught_up"] is True or row(a, older)["caught_up"] == 1
    # The newer one waits while the older runs: held, no row (not recorded skipped).
    held = claim(b, newer, Intent.CATCH_UP, grace=120)
    assert held.outcome is Outcome.HELD
    with a.ledger_engine.connect() as conn:
        assert not existing_ticks(conn, [(KEY, newer)])
    # Another replica trying the older one waits while it runs, then finds it taken.
    assert claim(b, older, Intent.CATCH_UP, grace=120).outcome is Outcome.HELD
    finish(a, ran)
    assert claim(b, older, Intent.CATCH_UP, grace=120).outcome is Outcome.LOST
    assert claim(b, newer, Intent.CATCH_UP, grace=120).outcome is Outcome.RUN
    # Past the window: missed.
    assert claim(a, tick(200), Intent.CATCH_UP, grace=120).outcome is Outcome.MISSED


def test_a_caught_up_tick_that_lost_its_row_gives_its_lock_back(backends):
    a, b = backends("a"), backends("b")
    at = tick(30)
    ran = claim(a, at, grace=60)  # a normal claim got it first
    finish(a, ran)
    assert claim(b, at, Intent.CATCH_UP, grace=120).outcome is Outcome.LOST
    assert claim(a, tick(), grace=60).outcome is Outcome.RUN  # b kept no lock


def test_history_pages_show_attempts_without_a_query_per_row(backends):
    a = backends("a")
    for n in range(5):
        first = claim(a, tick(50 - n), grace=120)
        fail_attempt(a, first, retry_in=0.0)
        (again,) = retries(a).started
        finish(a, again)
    started = time.monotonic()
    with a.ledger_engine.connect() as conn:
        shown = history(conn, TickFilter(key=KEY))
    assert time.monotonic() - started < 5
    assert len(shown) == 5 and all(len(r.attempts) == 1 for r in shown)
    assert all(r.as_json()["attempts"][0]["status"] == "failed" for r in shown)
    assert isinstance(shown[0].as_json()["attempt"], int)
    assert shown[0].scheduled_at > shown[-1].scheduled_at - timedelta(hours=1)


def _as_version_5(backend) -> None:
    """What a version-5 ledger looked like: no attempts, no retry_at."""
    engine = backend.ledger_engine
    with engine.begin() as conn:
        conn.exec_driver_sql("DROP TABLE scheduler_attempts")
        conn.exec_driver_sql("DROP INDEX scheduler_ticks_retry_at")
        if conn.dialect.name == "postgresql":
            conn.exec_driver_sql(
                "ALTER TABLE scheduler_ticks DROP COLUMN attempt, DROP COLUMN retry_at,"
                " DROP COLUMN caught_up"
            )
        else:
            made = conn.exec_driver_sql(
                "SELECT sql FROM sqlite_master WHERE name = 'scheduler_ticks'"
            ).scalar_one()
            # Each column's definition, wherever ADD COLUMN put it (no commas inside).
            old = re.sub(r",\s*(?:attempt|retry_at|caught_up) [^,]*", "", made)
            conn.exec_driver_sql("ALTER TABLE scheduler_ticks RENAME TO t_new")
            conn.exec_driver_sql("DROP INDEX IF EXISTS scheduler_ticks_scheduled_at")
            conn.exec_driver_sql("DROP INDEX IF EXISTS scheduler_ticks_running")
            conn.exec_driver_sql(old)
            names = "job_key, scheduled_at, job_name, status, instance, run_id, started_at"
            conn.exec_driver_sql(f"INSERT INTO scheduler_ticks ({names}) SELECT {names} FROM t_new")
            conn.exec_driver_sql("DROP TABLE t_new")
            assert "attempt" not in old and "retry_at" not in old
        conn.exec_driver_sql("DELETE FROM scheduler_schema")
        conn.exec_driver_sql(
            "INSERT INTO scheduler_schema (version, applied_at) VALUES (5, CURRENT_TIMESTAMP)"
        )


def test_a_version_5_ledger_is_migrated_with_its_rows(backends):
    from scheduler.backends.schema import CURRENT_VERSION

    a = backends("a")
    earlier = claim(a, tick(20), grace=60)
    finish(a, earlier)
    a.close()
    _as_version_5(a)
    assert a.migrate() == 5
    assert a.migrate() == CURRENT_VERSION
    a.connect()
    assert row(a, earlier.scheduled_at)["status"] == "succeeded"
    assert row(a, earlier.scheduled_at)["attempt"] == 1
    first = claim(a, tick())
    fail_attempt(a, first, retry_in=0.0)
    (again,) = retries(a).started
    assert again.attempt == 2


def test_pruning_takes_a_ticks_attempts_with_it_and_keeps_a_pending_retry(backends):
    a = backends("a")
    old = datetime.now(UTC).replace(microsecond=0) - timedelta(days=3)
    done_at, pending_at = old, old + timedelta(seconds=1)
    base = {"job_key": KEY, "job_name": "job", "instance": "a", "attempt": 2}
    with a.ledger_engine.begin() as conn:
        conn.execute(
            tables.ticks.insert(),
            [
                {**base, "scheduled_at": done_at, "status": "succeeded", "retry_at": None},
                {**base, "scheduled_at": pending_at, "status": "failed", "retry_at": old},
            ],
        )
        conn.execute(
            tables.attempts.insert(),
            [
                {"job_key": KEY, "scheduled_at": at, "attempt": 1, "status": "failed"}
                for at in (done_at, pending_at)
            ],
        )
    with a.ledger_engine.begin() as conn:
        assert prune_batch(conn, datetime.now(UTC) - timedelta(days=1)) == 1
    with a.ledger_engine.connect() as conn:
        left = conn.execute(select(tables.attempts.c.scheduled_at)).scalars().all()
        ticks_left = conn.execute(select(tables.ticks.c.scheduled_at)).scalars().all()
    assert left == [pending_at] and ticks_left == [pending_at]
