"""The gate under faults, driven step by step: slow statements, lost sessions, slow disks.

Real backends underneath (PostgreSQL sessions, or the embedded SQLite file);
time is a fake monotonic clock where the test moves it.
"""

from __future__ import annotations

import sqlite3
import threading
import time
from datetime import UTC, datetime

import psycopg

from scheduler.backends.base import ClaimRequest, Intent, Outcome
from scheduler.backends.embedded import EmbeddedBackend
from scheduler.backends.postgres import PostgresBackend
from scheduler.gate import Gate
from scheduler.gate.session import LockSession
from scheduler.ledger.job_states import track_jobs
from scheduler.observers import events
from tests.support import (
    FakeMonotonic,
    Proxy,
    Recorder,
    host_port,
    make_job,
    now_tick,
    settle,
    wait_for,
)


def test_a_tick_of_a_job_still_running_on_a_lost_session_is_recorded_skipped(
    gate_factory, database_url
):
    """With one replica nobody else would record it: it must not become `missed`."""
    release = threading.Event()
    job = make_job(701, lambda ctx: release.wait(20), name="stuck")
    gate, seen, clock = gate_factory()
    gate.submit(job, now_tick(-1))
    settle(gate, lambda: seen.of(events.RunStarted), "the run to start")
    with psycopg.connect(database_url, autocommit=True) as admin:
        admin.execute(
            "SELECT pg_terminate_backend(pid) FROM pg_stat_activity"
            " WHERE application_name = 'g1' AND datname = current_database()"
        )
    settle(gate, lambda: seen.of(events.LockSessionLost) and gate.connected, "a new session")
    later = now_tick()
    gate.submit(job, later)

    def skipped():
        clock.now += 0.5  # another replica would have claimed it by now
        return [e for e in seen.of(events.TickSkipped) if e.scheduled_at == later]

    try:
        settle(gate, skipped, "the tick to be recorded skipped")
    finally:
        release.set()
    assert not seen.of(events.TickMissed)


def test_a_slow_embedded_ledger_never_hands_a_new_run_a_lock_lost_that_is_already_set(tmp_path):
    """The flock is the lock: a SQLite write that waits for another writer loses nothing."""
    started: list[bool] = []
    job = make_job(711, lambda ctx: started.append(ctx.lock_lost.is_set()), name="quick")
    database = tmp_path / "scheduler.db"
    backend = EmbeddedBackend(database, instance="e1", namespace=4242)
    backend.migrate()
    seen = Recorder()
    gate = Gate(backend, instance="e1", max_workers=2, holder_timeout=2, listeners=[seen])
    gate.start()
    try:
        gate.submit(job, now_tick())
        wait_for(lambda: len(seen.of(events.RunFinished)) == 1, 20, "the first run")
        other = sqlite3.connect(database, isolation_level=None, timeout=30)
        other.execute("BEGIN IMMEDIATE")  # another process holds the write lock
        gate.submit(job, now_tick(1))
        time.sleep(2.8)
        other.execute("COMMIT")
        other.close()
        wait_for(lambda: len(seen.of(events.RunFinished)) == 2, 20, "the delayed run")
        gate.submit(job, now_tick(3))
        wait_for(lambda: len(seen.of(events.RunFinished)) == 3, 20, "a later run")
    finally:
        gate.stop(5)
    assert started == [False, False, False]
    assert not seen.of(events.LockSessionLost)


def test_a_statement_timeout_is_not_a_lost_session(gate_factory, database_url):
    """A claim cut short by the server's statement_timeout keeps the session and its locks."""
    release = threading.Event()
    blocking = make_job(721, lambda ctx: release.wait(20), name="holder")
    gate, seen, clock = gate_factory(holder_timeout=3)  # statements end after a second or so
    track_jobs(gate.backend.ledger_engine, [(721, "holder", "every 1s")], datetime.now(UTC))
    gate.submit(blocking, now_tick(-1))
    settle(gate, lambda: seen.of(events.RunStarted), "the run to start")
    run = next(iter(gate.table.runs()))
    with psycopg.connect(database_url) as blocker:
        blocker.execute("SELECT 1 FROM scheduler_jobs WHERE job_key = 721 FOR UPDATE")
        gate.submit(blocking, now_tick())
        deadline = time.monotonic() + 4
        while time.monotonic() < deadline:
            gate.step()
            clock.now += 0.05
        blocker.rollback()

    def skipped():
        clock.now += 1  # the failed claim is tried again after a growing delay
        return seen.of(events.TickSkipped)

    try:
        settle(gate, skipped, "the skip to be recorded")
    finally:
        release.set()
    assert not seen.of(events.LockSessionLost)
    assert not run.ctx.lock_lost.is_set()
    settle(gate, lambda: seen.of(events.RunFinished), "the run to finish")
    assert seen.of(events.RunFinished)[0].recorded


def test_a_claim_reply_is_small_whatever_the_burst(database_url):
    """A row per tick this replica recorded; the rest as spans of places in the batch.

    A frozen process stops reading its socket mid-reply; a reply that fits in
    the socket buffers lets the server commit and go idle (and the idle
    session then ends after holder_timeout) instead of holding the claim's
    rows while it waits to write.
    """
    host, port = host_port(database_url)
    proxy = Proxy(host, port)
    replica = PostgresBackend(
        proxy.url(database_url), instance="burst", namespace=4646, holder_timeout=30
    )
    replica.migrate()
    replica.connect()
    at = now_tick(-1)
    burst = [
        ClaimRequest(
            key=k, name=f"j{k}", scheduled_at=at, intent=Intent.RUN, grace_s=60, skip_threshold=3
        )
        for k in range(1, 60_001)
    ]
    before = proxy.replied
    try:
        answer = replica.claim(burst, "burst", 2)
    finally:
        replica.close()
        proxy.close()
    assert [r.outcome for r in answer.answered] == [Outcome.RUN] * 2
    assert len(answer.deferred) == 59_998 and not answer.lost + answer.yielded
    assert proxy.replied - before < 16_384, proxy.replied - before


class Unproven:
    """A backend whose calls would hang: only the watchdog can act (and it may fail)."""

    name = "stub"
    needs_watchdog = True

    def __init__(self, abort_fails: bool = False) -> None:
        self.aborts = 0
        self.abort_fails = abort_fails

    def abort(self) -> None:
        self.aborts += 1
        if self.abort_fails:
            raise RuntimeError("the connection was replaced under us")

    def connect(self) -> None:
        return None

    def close(self) -> None:
        return None


def test_runs_are_told_a_margin_before_the_server_may_end_the_session():
    """The server ends a quiet session at holder_timeout; the watchdog looks only now and
    then, so it must trip early enough that no other replica can start the job first."""
    told: list[str] = []
    clock = FakeMonotonic()
    session = LockSession(
        Unproven(), 30.0, clock, on_told=lambda n, reason, first: told.append(reason)
    )
    session.connected = True
    session.last_proof = clock.now
    run_event = session.generation.lock_lost
    clock.now += 26  # quiet, but well before the server would act: nothing yet
    session.watch_once(lambda: None)
    assert not run_event.is_set()
    # A watchdog that looks once a second must have told the run before the server ends
    # the session at holder_timeout, wherever its look falls.
    clock.now += 30 - 26 - 2 * session.watch_every
    session.watch_once(lambda: None)
    assert run_event.is_set() and told
    # Runs started from now on get a fresh event, never one already set.
    assert not session.generation.lock_lost.is_set()


def test_the_watchdog_survives_its_own_errors():
    backend = Unproven(abort_fails=True)
    clock = FakeMonotonic()
    session = LockSession(backend, 2.0, clock, on_told=lambda *_: None)
    session.connected = True
    session.last_proof = clock.now - 10  # in doubt: the watchdog aborts on every look
    stopped = threading.Event()
    watchdog = threading.Thread(target=session.watch, args=(stopped, lambda: None), daemon=True)
    watchdog.start()
    try:
        wait_for(lambda: backend.aborts >= 3, 10, "the watchdog to keep looking")
    finally:
        stopped.set()
        watchdog.join(5)
    assert watchdog.is_alive() is False


def test_starting_a_replica_does_not_lock_the_job_rows_it_finds_unchanged(database_url):
    """Claims update job rows all the time: a starting replica must not hold them."""
    backend = PostgresBackend(database_url, instance="st", namespace=4646, holder_timeout=30)
    backend.migrate()
    entries = [(k, f"job{k}", "every 1s") for k in (801, 802, 803)]
    track_jobs(backend.ledger_engine, entries, datetime.now(UTC))
    with psycopg.connect(database_url) as claim:  # a claim holding one job's row
        claim.execute("SELECT 1 FROM scheduler_jobs WHERE job_key = 802 FOR UPDATE")
        with backend.ledger_engine.connect() as conn:
            conn.exec_driver_sql("SET lock_timeout = '1s'")
            conn.commit()
        # With lock_timeout set, a start-up that waited for the row would raise here.
        track_jobs(backend.ledger_engine, entries, datetime.now(UTC))
        claim.rollback()
    backend.ledger_engine.dispose()
