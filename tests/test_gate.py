"""The gate itself, driven step by step with a fake monotonic clock (no sleeping).

Real PostgreSQL sessions underneath; the gate's dispatcher thread is not
started: each test calls `step()` where the thread would.
"""

from __future__ import annotations

import threading
from datetime import UTC, datetime, timedelta

import psycopg
import pytest

from scheduler import events
from scheduler.backends.base import Outcome
from scheduler.backends.postgres import PostgresBackend
from scheduler.catalog import CatalogJob
from scheduler.config import JobConfig
from scheduler.gate import Gate
from scheduler.registry import JobSpec
from tests.support import wait_for

NAMESPACE = 4343


class FakeMonotonic:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def make_job(key: int, func, name: str | None = None, skip_alert_after: int = 3) -> CatalogJob:
    schedule = JobConfig(interval="1s", skip_alert_after=skip_alert_after)
    spec = JobSpec(
        key=key,
        name=name or func.__name__,
        func=func,
        takes_context=True,
        is_async=False,
        source="test",
    )
    return CatalogJob(
        spec=spec,
        schedule=schedule,
        timezone="UTC",
        skip_threshold=skip_alert_after,
        fail_threshold=3,
        misfire_grace=timedelta(seconds=30),
    )


class Recorder:
    def __init__(self) -> None:
        self.events: list[events.Event] = []

    def __call__(self, event: events.Event) -> None:
        self.events.append(event)

    def of(self, kind: type) -> list:
        return [e for e in self.events if isinstance(e, kind)]


@pytest.fixture
def gate_factory(database_url):
    made = []

    def make(instance: str = "g1", max_workers: int = 4, holder_timeout: float = 30.0):
        backend = PostgresBackend(
            database_url, instance=instance, namespace=NAMESPACE, holder_timeout=holder_timeout
        )
        backend.migrate()
        recorder, clock = Recorder(), FakeMonotonic()
        gate = Gate(
            backend,
            instance=instance,
            max_workers=max_workers,
            holder_timeout=holder_timeout,
            listeners=[recorder],
            monotonic=clock,
        )
        made.append(gate)
        return gate, recorder, clock

    yield make
    for gate in made:
        gate.backend.close()


def now_tick(offset: int = 0) -> datetime:
    return datetime.now(UTC).replace(microsecond=0) + timedelta(seconds=offset)


def settle(gate: Gate, until, what: str) -> None:
    """Step the gate until `until()` holds (runs execute on the gate's worker threads)."""

    def stepped():
        gate.step()
        return until()

    wait_for(stepped, 10, what, every=0.02)


def test_a_job_still_running_here_is_skipped_without_asking_for_its_lock_again(gate_factory):
    release = threading.Event()
    job = make_job(501, lambda ctx: release.wait(10), name="blocking")
    gate, seen, _ = gate_factory()
    gate.submit(job, now_tick(-1))
    settle(gate, lambda: seen.of(events.RunStarted), "the first run to start")
    gate.submit(job, now_tick())
    settle(gate, lambda: seen.of(events.TickSkipped), "the next tick to be skipped")
    skipped = seen.of(events.TickSkipped)[0]
    assert (skipped.holder, skipped.consecutive_skips) == ("g1", 1)
    release.set()
    settle(gate, lambda: seen.of(events.RunFinished), "the run to finish")
    assert seen.of(events.RunFinished)[0].status == "succeeded"


def test_only_free_workers_claim_ticks_the_rest_wait(gate_factory):
    release = threading.Event()
    first = make_job(511, lambda ctx: release.wait(10), name="first")
    second = make_job(512, lambda ctx: None, name="second")
    gate, seen, _ = gate_factory(max_workers=1)
    gate.submit(first, now_tick())
    settle(gate, lambda: seen.of(events.RunStarted), "the first run to start")
    gate.submit(second, now_tick())
    gate.step()
    assert [e.job for e in seen.of(events.RunStarted)] == ["first"]  # no free worker: waits
    release.set()
    settle(gate, lambda: len(seen.of(events.RunStarted)) == 2, "the waiting tick to run")
    assert [e.job for e in seen.of(events.RunStarted)] == ["first", "second"]


def test_a_killed_lock_session_sets_lock_lost_and_the_gate_reconnects(gate_factory, database_url):
    release = threading.Event()
    job = make_job(521, lambda ctx: release.wait(10), name="victim")
    gate, seen, _ = gate_factory()
    gate.submit(job, now_tick())
    settle(gate, lambda: seen.of(events.RunStarted), "the run to start")
    run = next(iter(gate._runs.values()))
    with psycopg.connect(database_url, autocommit=True) as admin:
        admin.execute(
            "SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE application_name = 'g1'"
        )
    settle(gate, lambda: seen.of(events.SessionLost), "the lost session to be noticed")
    assert run.ctx.lock_lost.is_set()
    assert seen.of(events.SessionLost)[0].runs == ("victim",)
    settle(gate, lambda: gate.connected, "the gate to reconnect")
    release.set()
    settle(gate, lambda: seen.of(events.RunFinished), "the stale run to report")
    finished = seen.of(events.RunFinished)[0]
    assert finished.lock_lost
    assert finished.recorded  # nobody took its row over, so the truth is recorded


def test_no_round_trip_within_holder_timeout_means_the_locks_are_lost(gate_factory):
    release = threading.Event()
    job = make_job(531, lambda ctx: release.wait(10), name="frozen")
    gate, seen, clock = gate_factory(holder_timeout=6)
    gate.submit(job, now_tick())
    settle(gate, lambda: seen.of(events.RunStarted), "the run to start")
    run = next(iter(gate._runs.values()))
    clock.now += 7  # as after a SIGSTOP: the server has ended the session by now
    gate.step()
    assert run.ctx.lock_lost.is_set()
    assert seen.of(events.SessionLost)
    release.set()


def test_a_manual_trigger_runs_through_the_gate(gate_factory):
    job = make_job(541, lambda ctx: None, name="by_hand")
    gate, seen, _ = gate_factory()
    gate.start()
    try:
        result = gate.trigger(job, timeout=20)
    finally:
        gate.stop(5)
    assert result.outcome is Outcome.RUN and result.status == "succeeded"
    assert seen.of(events.RunStarted)[0].manual
