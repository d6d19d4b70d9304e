"""Pausing a job for the fleet, on both backends: the claim, the sweep, the notices, status."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pytest
from sqlalchemy import select

from scheduler.backends.base import Intent, Outcome
from scheduler.config.settings import Settings
from scheduler.fleet import pauses
from scheduler.fleet.housekeeping import MISSED_MARGIN, Housekeeping
from scheduler.fleet.status import fleet_status
from scheduler.ledger import tables
from scheduler.ledger.job_states import job_states, track_jobs
from scheduler.ledger.outbox import adopt_notices
from scheduler.ledger.registrations import register
from scheduler.registry.catalog import Catalog, schedule_text
from tests.integration.test_gate_protocol import KEY, claim, finish, rows, tick
from tests.support import make_job


def pause(backend, reason: str | None = "deploy", by: str = "ops@bastion", key: int = KEY):
    with backend.ledger_engine.begin() as conn:
        return pauses.pause(conn, key, "job", by=by, reason=reason, now=datetime.now(UTC))


def resume(backend, by: str = "ops@bastion", key: int = KEY):
    with backend.ledger_engine.begin() as conn:
        return pauses.resume(conn, key, "job", by=by, now=datetime.now(UTC))


def notices(backend) -> list[dict]:
    with backend.ledger_engine.connect() as conn:
        found = conn.execute(select(tables.notices).order_by(tables.notices.c.id))
        return [dict(row._mapping) for row in found]


def skip_streak(backend) -> int:
    with backend.ledger_engine.connect() as conn:
        return int(job_states(conn).get(KEY, {}).get("consecutive_skips") or 0)


def test_a_paused_jobs_tick_is_recorded_paused_once_for_the_fleet(backends):
    a, b = backends("a"), backends("b")
    pause(a)
    t = tick()
    first, second = claim(a, t), claim(b, t)
    assert first.outcome is Outcome.PAUSED and first.run_id is None
    assert second.outcome is Outcome.LOST  # recorded once, by whoever came first
    row = rows(a)[t]
    assert (row["status"], row["instance"], row["run_id"]) == ("paused", "a", None)
    late = tick(120)  # past its grace: still `paused`, never `missed`
    assert claim(b, late, grace=30).outcome is Outcome.PAUSED
    assert rows(b)[late]["status"] == "paused"


def test_a_run_going_when_the_job_is_paused_ends_as_it_would_have(backends):
    a, b = backends("a"), backends("b")
    t0 = tick(10)
    running = claim(a, t0)
    assert running.outcome is Outcome.RUN
    pause(b)
    # Neither the replica running it (intent skip) nor another one records a skip:
    # nothing was meant to run, so no streak grows and no overrun alert can come.
    own = claim(a, t0 + timedelta(seconds=1), intent=Intent.SKIP, threshold=1)
    other = claim(b, t0 + timedelta(seconds=2), threshold=1)
    assert (own.outcome, other.outcome) == (Outcome.PAUSED, Outcome.PAUSED)
    assert not own.alert and not other.alert and skip_streak(a) == 0
    done = finish(a, running)
    assert done.recorded
    assert rows(a)[t0]["status"] == "succeeded"


def test_a_manual_trigger_still_runs_a_paused_job(backends):
    a = backends("a")
    pause(a)
    manual = claim(a, tick(), intent=Intent.MANUAL)
    assert manual.outcome is Outcome.RUN and manual.run_id is not None
    finish(a, manual)


def test_resume_lets_the_next_tick_run_and_each_change_raises_one_notice(backends):
    a, b = backends("a"), backends("b")
    made = pause(a, reason="upstream down")
    again = pause(b, reason="something else", by="someone@else")
    assert made[1] and not again[1]
    assert again[0] == made[0]  # the pause in force is kept as it was
    assert claim(a, tick(2)).outcome is Outcome.PAUSED
    ended = resume(b)
    assert ended is not None and ended.reason == "upstream down" and ended.by == "ops@bastion"
    assert resume(a) is None  # not paused any more: nothing to end, no notice
    assert claim(a, tick()).outcome is Outcome.RUN
    sent = notices(a)
    assert [n["event"] for n in sent] == ["job.paused", "job.resumed"]
    # Raised by a command, not a replica: no lease, so the next live replica adopts them.
    assert all(n["lease_by"] is None and n["done_at"] is None for n in sent)
    with a.ledger_engine.begin() as conn:
        adopted = adopt_notices(conn, "a", datetime.now(UTC) + timedelta(seconds=1))
    assert adopted == [n["id"] for n in sent]


def test_status_shows_the_pause_with_who_when_and_why(backends):
    a = backends("a")
    job = make_job(KEY, lambda ctx: None, name="job")
    pause(a, reason="quarter close \x00 freeze", by="alice@laptop")
    found = fleet_status(a, Catalog((job,)), datetime.now(UTC))["jobs"][0]["paused"]
    assert found["by"] == "alice@laptop" and found["reason"] == "quarter close \\x00 freeze"
    assert datetime.fromisoformat(found["at"]) <= datetime.now(UTC)
    resume(a)
    assert fleet_status(a, Catalog((job,)), datetime.now(UTC))["jobs"][0]["paused"] is None


def test_the_sweep_records_ticks_of_a_paused_job_paused_and_earlier_ones_missed(backends):
    """No replica was up: ticks from the pause on were never meant to run."""
    backend = backends("h", connect=False)
    job = make_job(KEY, lambda ctx: None, name="job")  # every 1 s, 30 s grace
    keeper = Housekeeping(backend, Catalog((job,)), Settings(instance_name="hk"))
    now = datetime.now(UTC).replace(microsecond=0)
    track_jobs(backend.ledger_engine, [(KEY, "job", "every 1s")], now - timedelta(minutes=5))
    with backend.ledger_engine.begin() as conn:  # its schedule, in force (scheduler.fleet.due)
        register(conn, "h", [(KEY, "job", schedule_text(job))], set(), now - timedelta(minutes=5))
    cutoff = now - job.misfire_grace - MISSED_MARGIN
    paused_at = cutoff - timedelta(seconds=10)
    with backend.ledger_engine.begin() as conn:
        pauses.pause(conn, KEY, "job", by="ops", reason=None, now=paused_at)
        recorded = Housekeeping.sweep_missed(
            keeper, conn, job_states(conn), now - timedelta(seconds=60), now
        )
    found = rows(backend)
    missed = sorted(t for t, r in found.items() if r["status"] == "missed")
    paused = sorted(t for t, r in found.items() if r["status"] == "paused")
    assert recorded == len(missed) > 0 and len(paused) > 0
    assert max(missed) < paused_at <= min(paused)


def test_a_replica_of_a_version_before_pauses_reads_a_paused_tick_as_claimed_elsewhere(
    database_url,
):
    """A rolling upgrade: the old replica calls scheduler_claim without the last argument
    and could not parse `paused`; the tick is recorded paused and left out of its answer."""
    from sqlalchemy import text

    from scheduler.backends.postgres import PostgresBackend

    new = PostgresBackend(database_url, instance="new", namespace=4242, holder_timeout=30)
    new.migrate()
    try:
        pause(new)
        t = tick()
        old_call = text(
            "SELECT outcome, job_key FROM scheduler_claim(4242, 'old', 10, 60, 1000,"
            " 'crashed', ARRAY[:key], ARRAY['job'], ARRAY[CAST(:tick AS timestamptz)],"
            " ARRAY['run'], ARRAY[30.0::float8], ARRAY[3])"
        )
        with new.ledger_engine.begin() as conn:
            answer = conn.execute(old_call, {"key": KEY, "tick": t}).all()
        assert [outcome for outcome, _ in answer] == ["fleet"]  # the tick: read as lost
        assert rows(new)[t]["status"] == "paused"
    finally:
        new.ledger_engine.dispose()


def test_a_pause_committed_while_a_claim_waits_on_a_row_is_honoured(database_url):
    """The claim read "not paused", then waited on a row another session inserted; the
    pause committed meanwhile was acknowledged, so the tick is recorded paused, not run."""
    import threading
    import time

    import psycopg

    from scheduler.backends.postgres import PostgresBackend

    backend = PostgresBackend(database_url, instance="a", namespace=4747, holder_timeout=30)
    backend.migrate()
    backend.connect()
    t = tick()
    try:
        with psycopg.connect(database_url) as outsider:  # its row holds the claim's insert
            outsider.execute(
                "INSERT INTO scheduler_ticks (job_key, scheduled_at, job_name, status)"
                " VALUES (%s, %s, 'job', 'missed')",
                (KEY, t),
            )
            answers: list = []
            claiming = threading.Thread(target=lambda: answers.append(claim(backend, t)))
            claiming.start()
            time.sleep(0.5)  # the claim now waits on the outsider's row
            pause(backend)  # committed and acknowledged while it waits
            outsider.rollback()
            claiming.join(10)
        (result,) = answers
        assert result.outcome is Outcome.PAUSED and result.run_id is None
        row = rows(backend)[t]
        assert (row["status"], row["run_id"], row["started_at"]) == ("paused", None, None)
        assert backend.held_keys() == set()
    finally:
        backend.close()
        backend.ledger_engine.dispose()


def test_a_claim_that_waited_stamps_its_start_after_the_wait(database_url):
    import threading
    import time

    import psycopg

    from scheduler.backends.postgres import PostgresBackend

    backend = PostgresBackend(database_url, instance="a", namespace=4747, holder_timeout=30)
    backend.migrate()
    backend.connect()
    t = tick()
    try:
        with psycopg.connect(database_url) as outsider:
            outsider.execute(
                "INSERT INTO scheduler_ticks (job_key, scheduled_at, job_name, status)"
                " VALUES (%s, %s, 'job', 'missed')",
                (KEY, t),
            )
            answers: list = []
            claiming = threading.Thread(target=lambda: answers.append(claim(backend, t)))
            claiming.start()
            time.sleep(0.5)
            let_go = datetime.now(UTC)
            outsider.rollback()
            claiming.join(10)
        (result,) = answers
        assert result.outcome is Outcome.RUN
        assert result.started_at >= let_go - timedelta(milliseconds=50)
        assert rows(backend)[t]["started_at"] == result.started_at
    finally:
        backend.close()
        backend.ledger_engine.dispose()


def test_a_pause_committed_while_a_retry_look_waits_on_a_row_is_honoured(database_url):
    import threading
    import time

    import psycopg

    from scheduler.backends.postgres import PostgresBackend
    from tests.integration.test_retries_and_catch_up import fail_attempt, retries

    backend = PostgresBackend(database_url, instance="a", namespace=4747, holder_timeout=30)
    backend.migrate()
    backend.connect()
    t = tick()
    try:
        fail_attempt(backend, claim(backend, t), retry_in=0)
        with psycopg.connect(database_url) as outsider:  # holds the attempt's copy
            outsider.execute(
                "INSERT INTO scheduler_attempts (job_key, scheduled_at, attempt, status)"
                " VALUES (%s, %s, 1, 'failed')",
                (KEY, t),
            )
            answers: list = []
            looking = threading.Thread(target=lambda: answers.append(retries(backend)))
            looking.start()
            time.sleep(0.5)
            pause(backend)
            outsider.rollback()
            looking.join(10)
        (found,) = answers
        assert found.started == []
        assert rows(backend)[t]["status"] == "failed"
        assert backend.held_keys() == set()
    finally:
        backend.close()
        backend.ledger_engine.dispose()


def test_a_pause_found_in_force_and_resumed_before_it_is_read_pauses_the_job(backends):
    """The pause in force is ended by a resume that commits between this call's insert (which
    found it) and its read: the call pauses the job itself, and says so, never a KeyError."""
    from sqlalchemy import event

    if backends.kind != "postgresql":
        pytest.skip("SQLite has one writer at a time: no resume commits in between")
    a, b = backends("a"), backends("b")
    pause(a, reason="first", by="alice")
    inserts = []

    def resume_in_between(conn, cursor, statement, *args) -> None:
        if statement.lstrip().upper().startswith("INSERT INTO SCHEDULER_PAUSES") and not inserts:
            inserts.append(statement)
            resume(b, by="bob")  # another session, committed

    engine = a.ledger_engine
    event.listen(engine, "after_cursor_execute", resume_in_between)
    try:
        found, made = pause(a, reason="second", by="carol")
    finally:
        event.remove(engine, "after_cursor_execute", resume_in_between)
    assert inserts, "the pause's insert was not seen"
    assert made and found.by == "carol" and found.reason == "second"
    assert [n["event"] for n in notices(a)] == ["job.paused", "job.resumed", "job.paused"]
