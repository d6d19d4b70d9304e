"""`enabled: false` by a reload stops a job on every path, as a pause does (both backends).

From the moment the gate has the reloaded catalog, a disabled job starts
nothing on its own: no pending retry of it is taken, no tick of it queued
before the reload (deferred for lack of a worker) is claimed, no tick of a
catch-up pass under way is claimed. A run a person asks for still runs.
"""

from __future__ import annotations

import threading
from dataclasses import replace
from datetime import UTC, datetime, timedelta

from sqlalchemy import update

from scheduler.backends.base import Outcome
from scheduler.config.settings import JobConfig
from scheduler.gate import Gate
from scheduler.ledger import tables
from scheduler.observers import events
from tests.support import FakeMonotonic, JobsDesk, Recorder, make_job, now_tick, settle, wait_for


class Catalog(JobsDesk):
    """The replica's jobs as the run-now desk gives them; `disable` is a reload."""

    def disable(self, key: int) -> None:
        job = self.jobs[key]
        assert job.schedule is not None
        self.jobs[key] = replace(job, schedule=job.schedule.model_copy(update={"enabled": False}))


def gate_on(backends, catalog: Catalog, max_workers: int = 4):
    backend = backends("r1")
    seen, clock = Recorder(), FakeMonotonic()
    gate = Gate(
        backend,
        instance="r1",
        max_workers=max_workers,
        holder_timeout=30,
        listeners=[seen],
        monotonic=clock,
        desk=catalog,
    )
    return gate, seen, clock


def test_a_pending_retry_of_a_job_disabled_by_a_reload_is_not_taken(backends):
    attempts: list[int] = []

    def stubborn(ctx) -> None:
        attempts.append(ctx.attempt)
        raise RuntimeError("fails")

    job = replace(make_job(1501, stubborn), retries=2, retry_delay=timedelta(seconds=60))
    catalog = Catalog(job)
    gate, seen, clock = gate_on(backends, catalog)
    gate.submit(job, now_tick())
    settle(gate, lambda: seen.of(events.RunFinished), "the first attempt to fail")
    with gate.backend.ledger_engine.begin() as conn:  # the retry is due now
        conn.execute(
            update(tables.ticks)
            .where(tables.ticks.c.job_key == 1501)
            .values(retry_at=datetime.now(UTC) - timedelta(seconds=1))
        )
    catalog.disable(1501)
    gate.reloaded(catalog.job)
    for _ in range(20):
        gate.retries.due_in(0)
        clock.now += 1
        gate.step()
    assert attempts == [1]
    assert not gate.table.running_keys()


def test_a_tick_deferred_before_the_reload_is_dropped(backends):
    release = threading.Event()
    busy = make_job(1511, lambda ctx: release.wait(20), name="busy")
    waiting = make_job(1512, lambda ctx: None, name="waiting")
    catalog = Catalog(busy, waiting)
    gate, seen, clock = gate_on(backends, catalog, max_workers=1)
    try:
        tick = now_tick()
        gate.submit_all((busy, waiting), tick)
        settle(gate, lambda: 1511 in gate.table.running_keys(), "the busy run")
        assert len(gate.queue) == 1  # waiting's tick: no free worker for it yet
        catalog.disable(1512)
        gate.reloaded(catalog.job)
        assert len(gate.queue) == 0
    finally:
        release.set()
    settle(gate, lambda: not gate.table.running_keys(), "the busy run to end")
    for _ in range(5):
        clock.now += 1
        gate.step()
    assert [e.job for e in seen.of(events.RunStarted)] == ["busy"]


def test_a_catch_up_pass_under_way_claims_nothing_of_a_disabled_job(backends):
    ran: list[datetime] = []
    job = make_job(1521, lambda ctx: ran.append(ctx.scheduled_at), name="backlog")
    job = replace(job, schedule=JobConfig(interval="1s", catch_up="all"))
    catalog = Catalog(job)
    gate, _, _ = gate_on(backends, catalog)
    first = gate_thread(gate.catch_up, job, now_tick(-10))
    settle(gate, lambda: not first.is_alive(), "the first caught-up tick")
    assert len(ran) == 1
    catalog.disable(1521)
    gate.reloaded(catalog.job)
    answers: list = []
    second = gate_thread(lambda *a: answers.append(gate.catch_up(*a)), job, now_tick(-9))
    settle(gate, lambda: not second.is_alive(), "the second tick's answer")
    assert len(ran) == 1
    assert answers[0].outcome is Outcome.LOST


def test_a_run_a_person_asks_for_still_runs_a_disabled_job(backends):
    ran: list[int] = []
    job = make_job(1531, lambda ctx: ran.append(ctx.run_id), name="by_hand")
    catalog = Catalog(job)
    catalog.disable(1531)
    gate, _, _ = gate_on(backends, catalog)
    gate.reloaded(catalog.job)
    asked = gate_thread(gate.trigger, catalog.job(1531), 20)
    settle(gate, lambda: not asked.is_alive(), "the run asked for")
    assert len(ran) == 1


def gate_thread(target, *args) -> threading.Thread:
    thread = threading.Thread(target=target, args=args, daemon=True)
    thread.start()
    wait_for(lambda: True, 1, "the thread")
    return thread
